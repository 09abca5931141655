"""The trust model of a model folder: its files are data, never code, and never a reason
to reach the network.

A converted folder (and a source checkpoint) is untrusted input: ``config.json`` and the
tokenizer files were written by whoever produced the checkpoint. Everything here is pure
Python (no torch, no transformers at import):

* :func:`offline`: while transformers builds anything for us (config, skeleton,
  tokenizer), offline mode is forced whatever the environment says (the ``HF_HUB_OFFLINE``
  / ``TRANSFORMERS_OFFLINE`` variables and ``huggingface_hub.constants.HF_HUB_OFFLINE``,
  which transformers 5.17 and 5.25 read at call time through
  ``huggingface_hub.is_offline_mode``), and the socket layer refuses every connection
  and name lookup with a :class:`~converter.model.ModelError` naming ``config.json``;
  all of it is restored afterwards;
* :func:`check_config`: a ``config.json`` (or ``tokenizer_config.json``) that names
  remote code (``auto_map``), a backbone to fetch (``backbone``, ``use_timm_backbone``,
  ``use_pretrained_backbone``, a ``backbone_config`` given as a name) or any other hub
  id is refused with one line naming the field;
* :func:`short`: names in messages are cut (their length and a hash kept).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import ModelError

#: Longest name (tensor, layer, field) shown whole in a message.
NAME_LIMIT = 120
#: Most names listed in one message; the rest are counted.
LIST_LIMIT = 8


def short(name: object, limit: int = NAME_LIMIT) -> str:
    """``name`` as text, cut to about ``limit`` characters, with its length and a hash when cut."""
    text = str(name)
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{text[: limit // 2]}...[{len(text)} chars, sha256 {digest}]"


def names(items: list[str] | tuple[str, ...], limit: int = LIST_LIMIT) -> str:
    """Up to ``limit`` names (each :func:`short`), comma-separated, then how many more."""
    shown = ", ".join(short(n) for n in items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


# --------------------------------------------------------------------------- offline, no sockets

_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


class NetworkAttempt(ModelError):
    """Something tried to open a network connection while a model folder was being built."""


@contextlib.contextmanager
def offline(what: str | Path = "config.json") -> Iterator[None]:
    """Offline mode forced and the socket layer closed while this is active.

    Every ``socket.connect``, ``socket.create_connection``, ``getaddrinfo``,
    ``gethostbyname`` (``_ex``), ``gethostbyaddr`` or ``socket.sendto`` raises
    :class:`NetworkAttempt` naming ``what`` (the file whose content asked for it). The
    environment variables, huggingface_hub's and transformers' offline switches and the
    socket functions are restored on exit. Nested use is a no-op.
    """
    if getattr(_state, "depth", 0):
        _state.depth += 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    saved_env = {k: os.environ.get(k) for k in _ENV}
    switches: list[tuple[Any, str, Any]] = []
    for mod_name, attr in (
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ("transformers.utils.hub", "_is_offline_mode"),  # transformers releases that kept their own copy
        ("transformers.utils.import_utils", "_is_offline_mode"),
    ):
        mod = sys.modules.get(mod_name)
        if mod is not None and hasattr(mod, attr):
            switches.append((mod, attr, getattr(mod, attr)))
    saved_sock = (socket.socket.connect, socket.socket.connect_ex, socket.create_connection, socket.getaddrinfo)
    # Lookups that go to the resolver without socket.getaddrinfo, and a datagram sent
    # without connect: each reaches the network as surely as a connection does.
    saved_more = {
        (socket, name): getattr(socket, name) for name in ("gethostbyname", "gethostbyname_ex", "gethostbyaddr")
    }
    saved_more[(socket.socket, "sendto")] = socket.socket.sendto

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NetworkAttempt(
            "asks for a network connection while the model is built (a hub id or remote resource in it?); "
            "model folders are loaded offline only",
            path=what,
        )

    try:
        for k in _ENV:
            os.environ[k] = "1"
        for mod, attr, _ in switches:
            setattr(mod, attr, True)
        socket.socket.connect = refuse  # type: ignore[method-assign]
        socket.socket.connect_ex = refuse  # type: ignore[method-assign]
        socket.create_connection = refuse  # type: ignore[assignment]
        socket.getaddrinfo = refuse  # type: ignore[assignment]
        for owner, name in saved_more:
            setattr(owner, name, refuse)
        _state.depth = 1
        yield
    finally:
        _state.depth = 0
        (socket.socket.connect, socket.socket.connect_ex, socket.create_connection, socket.getaddrinfo) = saved_sock  # type: ignore[method-assign]
        for (owner, name), fn in saved_more.items():
            setattr(owner, name, fn)
        for mod, attr, value in switches:
            setattr(mod, attr, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _State:
    depth = 0


_state = _State()


# --------------------------------------------------------------------------- config fields

#: Fields whose presence means code from the folder or the hub.
_CODE_FIELDS = ("auto_map", "custom_pipelines", "trust_remote_code")
#: Fields naming a backbone to fetch; any value other than these is refused.
_BACKBONE_FIELDS = {
    "backbone": (None, ""),
    "use_timm_backbone": (None, False),
    "use_pretrained_backbone": (None, False),
}


def check_config(cfg: dict[str, Any], *, path: str | Path, field: str = "") -> None:
    """Refuse a config dict (at any depth: sub-configs too) that asks for code or the hub.

    Raises:
        ModelError: one line naming the file and the field (``auto_map``,
            ``text_config.backbone`` ...).
    """
    for key, value in cfg.items():
        here = f"{field}.{key}" if field else str(key)
        if key in _CODE_FIELDS and value not in (None, False, {}, []):
            raise ModelError(
                "names remote code (the folder's own Python or a hub repo); model folders are data only, "
                "remove this field",
                path=path,
                tensor=short(here),
            )
        if key in _BACKBONE_FIELDS and value not in _BACKBONE_FIELDS[key]:
            raise ModelError(
                f"is {short(repr(value), 60)}: a backbone fetched from the hub or timm; model folders are "
                "built offline from their own weights only",
                path=path,
                tensor=short(here),
            )
        if key == "backbone_config" and isinstance(value, str):
            raise ModelError(
                f"is {short(repr(value), 60)}: a config to fetch by name; model folders are built offline only",
                path=path,
                tensor=short(here),
            )
        if (
            isinstance(key, str)
            and key.endswith("_name_or_path")
            and key != "_name_or_path"
            and isinstance(value, str)
            and value
        ):
            # text_encoder_name_or_path, tokenizer_name_or_path ...: another repo to fetch.
            raise ModelError(
                f"is {short(repr(value), 60)}: another checkpoint to fetch by name; model folders are built "
                "offline from their own files only",
                path=path,
                tensor=short(here),
            )
        if isinstance(value, dict):
            check_config(value, path=path, field=here)
