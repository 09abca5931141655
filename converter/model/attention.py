"""``attn_implementation="sdpa_kv_heads"``: transformers' SDPA attention, with a decode
step's query heads folded onto their key/value heads instead of the key/value heads
repeated to the query heads.

Why: in a grouped-query model (Llama 3: 32 query heads, 8 key/value heads) transformers'
``sdpa`` (5.17; 5.25 folds the heads itself) repeats each key/value head for its group
whenever an attention mask is given, which a static cache always gives, and always under
``torch.compile``. That repeat
materialises the whole cache, four times over, in every layer of every decode step: at
batch 64 it is most of a step's memory traffic, for the fp16 model as for a converted one.
With one query token, the ``n_rep`` query heads of a group are ``n_rep`` rows that attend
to the same keys under the same mask, so ``(batch, heads, 1, dim)`` runs as
``(batch, kv_heads, n_rep, dim)`` against the cache as it is. Each output row is the same
softmax-weighted sum over the same keys as before; only the kernel's tiling differs (the
result agrees with ``sdpa`` to rounding, not bitwise).

Any other call (a prompt, no grouping, a head-dependent mask, a position bias, a softcap
or sinks) goes to transformers' own ``sdpa`` unchanged. Where a model's code treats the
names "eager" and "sdpa" apart from the rest, this one is made to get what ``sdpa`` gets:
see :func:`_sparse_mask` and :func:`_mask`.

:func:`register` adds the name to transformers' attention and mask registries (the mask
is ``sdpa``'s). ``load_model`` and ``from_pretrained`` with ``import converter`` register
it when asked for it; anything else (a plain fp16 model) calls :func:`register` first.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "sdpa_kv_heads"


def _packs(module: Any, query: torch.Tensor, mask: torch.Tensor | None, kwargs: dict[str, Any]) -> int:
    """The group size to fold (``n_rep``), or 0 where this call goes to plain ``sdpa``."""
    n_rep = int(getattr(module, "num_key_value_groups", 1) or 1)
    if n_rep <= 1 or query.shape[2] != 1:
        return 0
    if any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks")):
        return 0
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1):
        return 0
    return n_rep


def _sparse_mask(
    module: Any, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """``mask`` with a sparse-attention model's choice of keys applied, as its own code applies
    it under the names "eager" and "sdpa": under any other name it hands the choice over to
    the attention function instead (for a kernel that reads it), and ``sdpa`` ignores it."""
    indices = kwargs.pop("indices", None)  # DeepSeek V3.2, GLM-5, AXK2...: top-k keys per query
    if indices is not None:
        drop = indices.new_ones((query.shape[0], query.shape[2], key.shape[2]), dtype=torch.bool)
        drop = drop.scatter(-1, indices.long(), False).unsqueeze(1)
        if mask is not None and mask.dtype != torch.bool:
            return mask.masked_fill(drop, torch.finfo(mask.dtype).min)
        return ~drop if mask is None else mask & ~drop
    blocks = kwargs.pop("block_indices", None)  # MiniMax M3: key blocks per query, per head
    if blocks is not None:
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = torch.arange(key.shape[2] - query.shape[2], key.shape[2], device=query.device)
        pos = (pos if pos.ndim > 1 else pos[None]).expand(query.shape[0], -1)
        return module.indexer.build_block_mask(blocks, mask, key.shape[2], query.dtype, query.device, pos)
    return mask


def sdpa_kv_heads_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``(b, h, s, d)``, ``key`` and
    ``value`` ``(b, kv, L, d)``; returns ``(b, s, h, d)`` and no weights."""
    attention_mask = _sparse_mask(module, query, key, attention_mask, kwargs)
    n_rep = _packs(module, query, attention_mask, kwargs)
    if not n_rep:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    b, h, _, d = query.shape
    # (b, h, 1, d) -> (b, kv, n_rep, d): query head j*n_rep + r is row r of key/value head j,
    # the order transformers' repeat_kv gives them. A (b, 1, 1, L) mask broadcasts over the rows.
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, h // n_rep, n_rep, d),
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=False,
    )
    return out.reshape(out.shape[0], h, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """``sdpa``'s mask, never skipped (None, for SDPA's ``is_causal``) in a model with KV-shared
    layers: before those, Gemma 4 cuts a prompt's queries down to the logits kept, which a
    skipped mask cannot follow, and it checks for that by the name "sdpa" only."""
    from transformers.masking_utils import sdpa_mask

    if getattr(kwargs.get("config"), "num_kv_shared_layers", 0):
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Add ``sdpa_kv_heads`` to transformers' attention functions (with ``sdpa``'s mask);
    returns the name. Registering again does nothing new."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_kv_heads_forward)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME
