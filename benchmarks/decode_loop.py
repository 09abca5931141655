"""Greedy decoding with a static KV cache, one decode step at a time: eager, captured in a
CUDA graph, or compiled (``torch.compile(fullgraph=True)``) and then captured.

Shared by ``benchmarks/bench_generate.py`` (timing) and ``scripts/gpu_generate_parity.py``
(token parity); ``tests/test_decode_loop.py`` checks it against ``model.generate`` on the CPU.

How a step is made static (transformers 5.17 and 5.25 alike):

* the cache is a ``StaticCache`` sized ``prompt + max_new``, filled by an eager prefill;
* the step's inputs are fixed buffers: ``ids`` ``(B, 1)`` and ``position_ids`` ``(B, 1)``.
  These transformers versions take no ``cache_position``: each ``StaticLayer`` keeps its
  write position on the device (``cumulative_length``) and advances it in place, so the
  captured step advances the cache by itself;
* the step also does its own bookkeeping on the device: the greedy token (argmax of the
  last logits) goes into ``tokens[:, n]`` and into ``ids``, and ``position_ids`` and ``n``
  advance by one. A replayed graph is then a complete decode step with no host work;
* warm-up runs (and ``torch.compile``'s first call) really execute and advance all of
  that state: :meth:`Decoder.snapshot` / :meth:`Decoder.restore` put it back. The keys
  and values they wrote sit past the restored position, so the real steps overwrite them
  and the causal mask hides them until then.

On a device other than CUDA, ``graph`` mode runs the same sequence (warm-up, restore) and
then calls the step instead of replaying it, so the CPU test covers the state handling.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

EAGER, GRAPH, COMPILE = "eager", "graph", "compile"
MODES = (EAGER, GRAPH, COMPILE)
#: torch.compile's mode for COMPILE: inductor with autotuning, without its own CUDA graphs
#: (we capture the step ourselves, the same way for every model).
DEFAULT_COMPILE_MODE = "max-autotune-no-cudagraphs"


def cache_keyword(model: Any) -> str:
    """The forward's name for the cache: ``cache`` (transformers >= 5.25), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def static_cache(model: Any, max_len: int) -> Any:
    """A ``StaticCache`` of ``max_len`` tokens for ``model`` (allocated by the first forward)."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def _position_state(cache: Any) -> list[tuple[Any, str]]:
    """``(layer, attribute)`` of the cache's own position counters (``cumulative_length``
    tensors, ``cumulative_length_int`` of sliding layers): what a step mutates besides keys and values."""
    out = []
    for layer in getattr(cache, "layers", ()):
        for name, value in vars(layer).items():
            small = isinstance(value, torch.Tensor) and value.numel() <= 16
            if "length" in name and (small or (isinstance(value, int) and not isinstance(value, bool))):
                out.append((layer, name))
    return out


class Decoder:
    """One batch of greedy decoding on a static cache.

    Args:
        model: a transformers causal LM (``logits`` output, ``logits_to_keep``).
        batch, prompt_len: the prompt's shape.
        max_new: tokens to generate (``tokens`` holds them; the cache holds ``prompt_len + max_new``).
        device: where the buffers live (the model's device).
        ban_repeats: pick the best token not yet in the row (prompt included), i.e.
            ``generate``'s ``no_repeat_ngram_size=1``: a random model's greedy output
            settles into one repeated token, this makes every step a fresh decision.
    """

    def __init__(
        self, model: Any, batch: int, prompt_len: int, max_new: int, device: Any, *, ban_repeats: bool = False
    ) -> None:
        if max_new < 1:
            raise ValueError("max_new must be at least 1")
        self.model, self.batch, self.prompt_len, self.max_new = model, batch, prompt_len, max_new
        self.device = torch.device(device)
        self.keyword = cache_keyword(model)
        self.cache = static_cache(model, prompt_len + max_new)
        zeros = dict(dtype=torch.long, device=self.device)
        self.ids = torch.zeros(batch, 1, **zeros)
        self.pos = torch.zeros(batch, 1, **zeros)
        self.n = torch.zeros(1, **zeros)
        self.tokens = torch.zeros(batch, max_new, **zeros)
        self.ban_repeats = ban_repeats
        self.seen: torch.Tensor | None = None  # (B, V) bool, made by the prefill when ban_repeats

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, **kw: Any) -> torch.Tensor:
        kw[self.keyword] = self.cache
        return self.model(input_ids=ids, position_ids=pos, use_cache=True, **kw).logits[:, -1, :]

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits the pick was made on, (B, 1) greedy token)``."""
        if self.seen is not None:
            logits = logits.masked_fill(self.seen, float("-inf"))
        nxt = logits.argmax(-1, keepdim=True)
        if self.seen is not None:
            self.seen.scatter_(1, nxt, True)
        return logits, nxt

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``(B, P)`` eagerly into the cache; the first token is its greedy pick.

        Returns:
            The last position's logits ``(B, V)``.
        """
        b, p = prompt.shape
        if (b, p) != (self.batch, self.prompt_len):
            raise ValueError(f"prompt of shape {(b, p)}, this decoder is for {(self.batch, self.prompt_len)}")
        pos = torch.arange(p, device=prompt.device).expand(b, p)
        logits = self._forward(prompt, pos, logits_to_keep=1)
        if self.ban_repeats:
            if self.seen is None:
                self.seen = torch.zeros(logits.shape, dtype=torch.bool, device=self.device)
            self.seen.zero_()
            self.seen.scatter_(1, prompt, True)
        logits, nxt = self._pick(logits)
        self.tokens[:, :1].copy_(nxt)
        self.ids.copy_(nxt)
        self.pos.fill_(p)
        self.n.fill_(1)
        return logits

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One decode step, all on the device (the function that is captured or compiled).

        Returns:
            This step's logits ``(B, V)``, those that chose ``tokens[:, n]``.
        """
        logits, nxt = self._pick(self._forward(self.ids, self.pos))
        self.tokens.index_copy_(1, self.n, nxt)
        self.ids.copy_(nxt)
        self.pos.add_(1)
        self.n.add_(1)
        return logits

    def _mine(self) -> list[torch.Tensor]:
        return [t for t in (self.ids, self.pos, self.n, self.seen) if t is not None]

    def snapshot(self) -> tuple[list[Any], list[torch.Tensor]]:
        """The decoding state (the cache's counters, ``ids``, ``position_ids``, ``n``, ``seen``), copied."""
        cache = [(layer, name, _copy(getattr(layer, name))) for layer, name in _position_state(self.cache)]
        return cache, [t.clone() for t in self._mine()]

    def restore(self, snap: tuple[list[Any], list[torch.Tensor]]) -> None:
        """Put a :meth:`snapshot` back, in place (a captured graph keeps its addresses)."""
        cache, mine = snap
        for layer, name, value in cache:
            current = getattr(layer, name)
            if isinstance(current, torch.Tensor):
                current.copy_(value)
            else:
                setattr(layer, name, value)
        for t, v in zip(self._mine(), mine, strict=True):
            t.copy_(v)


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


@dataclasses.dataclass
class Runner:
    """A decode step ready to run: ``runner()`` advances one token and returns its logits
    (in ``graph``/``compile`` mode on CUDA the graph's static output: copy it to keep it).

    Attributes:
        mode: ``eager``, ``graph`` or ``compile``.
        fn: the step as called without a graph (the compiled function in ``compile`` mode).
        graph: the ``torch.cuda.CUDAGraph``, or None (eager, or no CUDA: emulated).
        output: the graph's static logits.
        setup_s: seconds spent in warm-up, compilation and capture.
    """

    mode: str
    fn: Callable[[], torch.Tensor]
    graph: Any = None
    output: torch.Tensor | None = None
    setup_s: float = 0.0

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.output  # type: ignore[return-value]


def raise_recompile_limits(limit: int = 64) -> None:
    """Let dynamo keep one compiled step per (model, batch) of a benchmark (default 8)."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(limit, getattr(cfg, name)))
            break
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(limit * 4, cfg.accumulated_recompile_limit)


def make_runner(
    dec: Decoder,
    mode: str,
    *,
    warmup: int = 3,
    compile_mode: str | None = DEFAULT_COMPILE_MODE,
    capture_error_mode: str = "global",
) -> Runner:
    """The decode step of ``dec`` in ``mode``, after its prefill; leaves ``dec``'s state as it found it.

    ``graph``: ``warmup`` eager steps on a side stream, then one step captured with
    ``torch.cuda.graph``. ``compile``: the step under ``torch.compile(fullgraph=True,
    mode=compile_mode, dynamic=False)``, warmed up (that compiles it), then captured the same way.

    Raises:
        ValueError: an unknown mode.
        Whatever capture or compilation raises (a host sync while capturing ...).
    """
    import time

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    fn: Callable[[], torch.Tensor] = dec.step
    if mode == EAGER:
        return Runner(mode, fn)
    t0 = time.perf_counter()
    if mode == COMPILE:
        raise_recompile_limits()
        fn = torch.compile(dec.step, fullgraph=True, mode=compile_mode, dynamic=False)
    # Warm-up steps write tokens[:, n]: keep n inside the buffer.
    warmup = max(1, min(warmup, dec.max_new - 1))
    snap = dec.snapshot()
    if dec.device.type != "cuda":
        for _ in range(warmup):
            fn()
        dec.restore(snap)
        return Runner(mode, fn, setup_s=time.perf_counter() - t0)
    side = torch.cuda.Stream(dec.device)
    side.wait_stream(torch.cuda.current_stream(dec.device))
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(dec.device).wait_stream(side)
    dec.restore(snap)
    torch.cuda.synchronize(dec.device)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        out = fn()
    # Capture runs nothing, but restore anyway: cheap, and exact whatever the backend did.
    dec.restore(snap)
    torch.cuda.synchronize(dec.device)
    return Runner(mode, fn, graph, out, time.perf_counter() - t0)


def greedy(
    model: Any,
    prompt: torch.Tensor,
    max_new: int,
    mode: str = EAGER,
    *,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
    ban_repeats: bool = False,
    **runner_kw: Any,
) -> torch.Tensor:
    """Greedy-decode ``max_new`` tokens after ``prompt`` ``(B, P)`` (on the model's device).

    Args:
        mode: how each decode step after the prefill runs (see :func:`make_runner`).
        on_step: called as ``on_step(i, logits)`` with the ``(B, V)`` logits that chose
            token ``i`` (0: the prefill's; banned tokens at -inf); a graph's static output,
            valid during the call.
        ban_repeats: see :class:`Decoder`.
        runner_kw: passed to :func:`make_runner`.

    Returns:
        ``(B, max_new)`` token ids.
    """
    b, p = prompt.shape
    dec = Decoder(model, b, p, max_new, prompt.device, ban_repeats=ban_repeats)
    logits = dec.prefill(prompt)
    if on_step is not None:
        on_step(0, logits)
    if max_new > 1:
        run = make_runner(dec, mode, **runner_kw)
        for i in range(1, max_new):
            logits = run()
            if on_step is not None:
                on_step(i, logits)
    return dec.tokens.clone()
