"""``attn_implementation="sdpa_kv_heads"``: transformers' SDPA attention, with a decode
step's query heads folded onto their key/value heads instead of the key/value heads
repeated to the query heads.

Why: in a grouped-query model (Llama 3: 32 query heads, 8 key/value heads) transformers'
``sdpa`` repeats each key/value head for its group whenever an attention mask is given,
which a static cache always gives, and always under ``torch.compile``. That repeat
materialises the whole cache, four times over, in every layer of every decode step: at
batch 64 it is most of a step's memory traffic, for the fp16 model as for a converted one.
With one query token, the ``n_rep`` query heads of a group are ``n_rep`` rows that attend
to the same keys under the same mask, so ``(batch, heads, 1, dim)`` runs as
``(batch, kv_heads, n_rep, dim)`` against the cache as it is. Each output row is the same
softmax-weighted sum over the same keys as before; only the kernel's tiling differs (the
result agrees with ``sdpa`` to rounding, not bitwise).

Any other call (a prompt, no grouping, a head-dependent mask, a position bias, a softcap
or sinks) goes to transformers' own ``sdpa`` unchanged.

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


def register() -> str:
    """Add ``sdpa_kv_heads`` to transformers' attention functions (with ``sdpa``'s mask);
    returns the name. Registering again does nothing new."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_kv_heads_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
