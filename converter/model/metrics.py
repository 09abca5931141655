"""The numbers that compare a model's output with the fp32 reference's: errors, top-k,
cosine, perplexity, and per position the top-1 token, its margin and the largest error
(float64, a few positions at a time).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: Rows (positions) per chunk of the comparison, so that float64 temporaries stay small
#: whatever the vocabulary.
_CHUNK_ELEMENTS = 1 << 20


def output_metrics(y: np.ndarray, ref: np.ndarray, *, encoder: bool, ids: np.ndarray | None) -> dict[str, Any]:
    """Compare one model's output with the fp32 reference's, a few positions at a time.

    Args:
        y, ref: float32 ``(sequences, tokens, features)``.
        encoder: hidden states, not logits: also the cosine of mean-pooled embeddings; no
            top-1 / top-5 (an argmax over hidden features means nothing), and the max
            error per position relative to that position's norm.
        ids: the tokens, for the perplexity of ``y`` (causal LMs on ``--text``), or None.

    Returns:
        ``mean_rel_err`` (mean |y - ref| / mean |ref|), ``max_rel_err`` (logits: max
        |y - ref| / mean |ref|; hidden states: max over positions of ||y - ref|| / ||ref||,
        which near-zero features cannot inflate), ``top1``, ``top5`` (see
        :class:`ModelReport`; None for hidden states), and when asked ``cosine`` (lowest
        over sequences) and ``ppl``; errors are ``inf`` and the cosine -1 when ``y`` is
        not finite. Temporaries: about ``_CHUNK_ELEMENTS`` float64 values.
    """
    b, t, v = y.shape
    k = min(5, v)
    rows = max(1, _CHUNK_ELEMENTS // max(v, 1))
    sum_diff = sum_ref = 0.0
    max_diff = max_pos = 0.0
    top1 = top5 = 0.0
    finite = True
    pooled_y = np.zeros((b, v)) if encoder else None
    pooled_r = np.zeros((b, v)) if encoder else None
    nll, n_nll = 0.0, 0
    for i in range(b):
        for t0 in range(0, t, rows):
            yc = y[i, t0 : t0 + rows].astype(np.float64)
            rc = ref[i, t0 : t0 + rows].astype(np.float64)
            finite &= bool(np.isfinite(yc).all())
            d = np.abs(yc - rc)
            sum_diff += float(d.sum())
            max_diff = max(max_diff, float(d.max()))
            sum_ref += float(np.abs(rc).sum())
            if not encoder:
                top1 += float(np.sum(np.argmax(yc, axis=1) == np.argmax(rc, axis=1)))
                ty = np.argpartition(-yc, k - 1, axis=1)[:, :k]
                tr = np.argpartition(-rc, k - 1, axis=1)[:, :k]
                top5 += sum(len(set(a) & set(c)) / k for a, c in zip(ty.tolist(), tr.tolist(), strict=True))
            else:
                rel = np.linalg.norm(yc - rc, axis=1) / np.maximum(np.linalg.norm(rc, axis=1), 1e-30)
                max_pos = max(max_pos, float(rel.max()))
                pooled_y[i] += yc.sum(axis=0)
                pooled_r[i] += rc.sum(axis=0)
            if ids is not None:
                nxt = ids[i, t0 + 1 : t0 + 1 + len(yc)]  # position p predicts token p + 1
                lg = yc[: len(nxt)]
                if len(nxt):
                    m = lg.max(axis=1, keepdims=True)
                    logz = m[:, 0] + np.log(np.exp(lg - m).sum(axis=1))
                    nll += float(np.sum(logz - lg[np.arange(len(nxt)), nxt]))
                    n_nll += len(nxt)
    n = b * t
    scale = (sum_ref / (n * v)) or 1.0
    out: dict[str, Any] = {
        "mean_rel_err": sum_diff / (n * v) / scale if finite else math.inf,
        "max_rel_err": (max_pos if encoder else max_diff / scale) if finite else math.inf,
        "top1": None if encoder else top1 / n,
        "top5": None if encoder else top5 / n,
    }
    if encoder:
        cos = (pooled_y * pooled_r).sum(axis=1) / (
            np.linalg.norm(pooled_y, axis=1) * np.linalg.norm(pooled_r, axis=1) + 1e-30
        )
        out["cosine"] = float(cos.min()) if finite else -1.0
    if ids is not None:
        mean_nll = nll / max(n_nll, 1)
        out["ppl"] = math.exp(mean_nll) if finite and math.isfinite(mean_nll) and mean_nll < 700 else math.inf
    return out


def reference_decisions(ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32's top-1 token and its margin over the second (float64) at every position,
    ``(sequences, tokens)`` each; computed a few positions at a time."""
    b, t, v = ref.shape
    top = np.zeros((b, t), dtype=np.int64)
    margin = np.full((b, t), np.inf)
    rows = max(1, _CHUNK_ELEMENTS // max(v, 1))
    for i in range(b):
        for t0 in range(0, t, rows):
            rc = ref[i, t0 : t0 + rows].astype(np.float64)
            top[i, t0 : t0 + len(rc)] = np.argmax(rc, axis=1)
            if v > 1:
                two = -np.partition(-rc, 1, axis=1)[:, :2]
                margin[i, t0 : t0 + len(rc)] = two[:, 0] - two[:, 1]
    return top, margin


def position_errors(y: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A model's top-1 token and its largest absolute logit error against ``ref`` at every
    position, ``(sequences, tokens)`` each (inf where ``y`` is not finite)."""
    b, t, v = y.shape
    top = np.zeros((b, t), dtype=np.int64)
    err = np.zeros((b, t))
    rows = max(1, _CHUNK_ELEMENTS // max(v, 1))
    for i in range(b):
        for t0 in range(0, t, rows):
            yc = y[i, t0 : t0 + rows].astype(np.float64)
            rc = ref[i, t0 : t0 + rows].astype(np.float64)
            top[i, t0 : t0 + len(yc)] = np.argmax(yc, axis=1)
            e = np.abs(yc - rc).max(axis=1)
            err[i, t0 : t0 + len(yc)] = np.where(np.isfinite(yc).all(axis=1), e, np.inf)
    return top, err
