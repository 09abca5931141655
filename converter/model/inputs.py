"""The tokens the three models of ``marlin-verify --model`` run on: the fixed input, or
``--text`` through the folder's own tokenizer (offline, no remote code).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConverterError
from . import ModelError
from .config import quiet_transformers
from .guard import check_config, offline

#: The fixed input when no --text is given: this many sequences of this many tokens
#: (fewer when max_position_embeddings is smaller), ids uniform over the vocabulary, seed 0.
FIXED_SEQUENCES, FIXED_TOKENS = 4, 128
#: --text is cut to this many tokens (or max_position_embeddings).
MAX_TEXT_TOKENS = 512


def input_ids(folder: Path, cfg: dict[str, Any], text: str | Path | None) -> tuple[np.ndarray, dict[str, Any]]:
    """The tokens all three models run on: int64 ``(sequences, tokens)`` and a description.

    With ``text``: the file tokenized by the folder's own tokenizer (offline), one
    sequence of at most ``MAX_TEXT_TOKENS`` (or ``max_position_embeddings``) tokens.
    Without: ``FIXED_SEQUENCES`` x ``FIXED_TOKENS`` ids drawn uniformly from the
    vocabulary with seed 0.

    Raises:
        ModelError: no ``vocab_size``; no tokenizer in the folder; fewer than 2 tokens.
        ConverterError: the text file cannot be read.
    """
    max_pos = cfg.get("max_position_embeddings")
    limit = lambda n: min(n, max_pos) if isinstance(max_pos, int) and max_pos > 0 else n  # noqa: E731
    if text is None:
        vocab = cfg.get("vocab_size")
        if not isinstance(vocab, int) or vocab <= 0:
            raise ModelError(
                "config.json has no vocab_size: cannot make the fixed input",
                path=folder / "config.json",
                tensor="vocab_size",
            )
        ids = np.random.default_rng(0).integers(0, vocab, (FIXED_SEQUENCES, limit(FIXED_TOKENS)), dtype=np.int64)
        return ids, {"from": "fixed", "text": None, "sequences": int(ids.shape[0]), "tokens": int(ids.shape[1])}
    text = Path(text)
    try:
        with text.open("r", encoding="utf-8") as f:
            f.read(1)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConverterError(f"cannot read --text: {getattr(exc, 'strerror', None) or exc}", path=text) from None
    if not any(
        (folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt")
    ):
        raise ModelError(
            "--text needs a tokenizer, and the folder has none (tokenizer.json / tokenizer_config.json)", path=folder
        )
    tok = _tokenizer(folder)
    budget = limit(MAX_TEXT_TOKENS)
    ids = _tokenize_prefix(tok, text, budget)[:budget]
    if len(ids) < 2:
        raise ModelError(f"--text gives {len(ids)} token(s); at least 2 are needed", path=text)
    arr = np.asarray([ids], dtype=np.int64)
    return arr, {"from": "text", "text": str(text), "sequences": 1, "tokens": int(arr.shape[1])}


def _first_line(exc: BaseException) -> str:
    from .guard import short

    text = str(exc).strip()
    return f"{type(exc).__name__}: {short(text.splitlines()[0], 300) if text else ''}"


def _tokenizer(folder: Path) -> Any:
    """The folder's tokenizer: offline, ``trust_remote_code=False``, its ``tokenizer_config.json``
    refused first if it names remote code.

    Raises:
        ModelError: remote code named; anything the tokenizer's loading raises, a panic of
            the Rust tokenizer (a ``BaseException``) included.
    """
    from ..formats.hf_checkpoint import read_json_file

    tc_path = folder / "tokenizer_config.json"
    if tc_path.is_file():
        tc = read_json_file(tc_path)
        if isinstance(tc, dict):
            check_config(tc, path=tc_path)
    from transformers import AutoTokenizer

    try:
        with quiet_transformers(), offline(folder / "config.json"):
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except ModelError:
        raise
    except BaseException as exc:  # the Rust tokenizer's PanicException is a BaseException
        raise ModelError(f"cannot load the folder's tokenizer: {_first_line(exc)}", path=folder) from None


#: --text is read this many characters at a time (doubling) until it gives enough tokens.
TEXT_CHUNK_CHARS = 16 << 10
#: ... and never more than this many characters in all.
MAX_TEXT_CHARS = 4 << 20
#: Tokens beyond the budget that a prefix must give before its first ``budget`` are trusted:
#: the tokens at the cut may differ from the whole text's.
TEXT_SLACK_TOKENS = 16


def _tokenize_prefix(tok: Any, text: Path, budget: int) -> list[int]:
    """The token ids of ``text``'s beginning: read and tokenized in growing prefixes until
    one gives ``budget + TEXT_SLACK_TOKENS`` tokens (or the file ends, or
    ``MAX_TEXT_CHARS`` were read), so memory and time follow the budget, not the file.

    Raises:
        ConverterError: the file cannot be read or is not UTF-8 (in the part read).
        ModelError: the tokenizer fails on it (a Rust panic included).
    """
    want = budget + TEXT_SLACK_TOKENS
    n = TEXT_CHUNK_CHARS
    content = ""
    try:
        with text.open("r", encoding="utf-8") as f:
            while True:
                more = f.read(n - len(content))
                content += more
                ids = _encode(tok, content, text)
                if len(ids) >= want or not more or len(content) >= MAX_TEXT_CHARS:
                    return ids
                n = min(2 * n, MAX_TEXT_CHARS)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConverterError(f"cannot read --text: {getattr(exc, 'strerror', None) or exc}", path=text) from None


def _encode(tok: Any, content: str, text: Path) -> list[int]:
    try:
        return list(tok(content)["input_ids"])
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # a Rust panic is a BaseException
        raise ModelError(f"the folder's tokenizer fails on --text: {_first_line(exc)}", path=text) from None
