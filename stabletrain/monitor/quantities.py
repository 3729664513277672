"""Monitor maths: tensors in, metric values out, no model or hook in sight (docs/methods.md §7).

Every ``*_stats``/``*_metrics`` function returns a dict keyed by ``group/quantity`` (or just
``group`` for single-valued groups such as ``token_sim``); :func:`names.for_block` prefixes
the block, so ``"sigma1/wq_t_wk_max"`` becomes ``"sigma1/blocks.3/wq_t_wk_max"``.

Weight convention: ``y = x W^T``. The fused qkv weight's rows are ``W_q, W_k, W_v`` (each
``H d_h x d``); ``W_o`` (the output projection) is ``d x H d_h``. Per-head slices are
``W_q^h = W_q[h d_h:(h+1) d_h]`` and ``W_o^h = W_o[:, h d_h:(h+1) d_h]``.

Two implementations of the weight-side metrics, with the same names and values:

- :func:`stacked_weight_metrics` / :func:`model_weight_metrics`, what the training monitor
  runs: every block at once, a handful of batched device ops and one device-to-host copy per
  pass (see its docstring). On one H100 the per-block path below cost ~540 ms per ViT-B pass,
  mostly solver launches per small matrix and host syncs.
- the per-block functions (:func:`block_weight_metrics` and the ``*_stats`` it calls), the
  readable reference the batched path is tested against; fine for one block in a notebook.

How each sigma1 is obtained (through :mod:`stabletrain.spectral`, but the activations' ``||X||_2``,
an eigensolve that returns NaN instead of raising where the solver gives up):

- single matrices (``W_q`` ... ``W_2``): batched power iteration, warm-started across calls,
  since per-step telemetry must be cheap (lower bounds, ~1% on random-init weights,
  tightening over warm passes);
- per-head products ``W_q^h^T W_k^h`` and ``W_o^h W_v^h``: exact, from a ``d_h x d_h``
  matrix: after thin QR (:func:`spectral.product_singular_values`, per block) or from the
  heads' Gram matrices (:func:`spectral.gram_product_core`, batched); the whole per-head
  spectrum also gives the SEC curve;
- full-width products ``W_q^T W_k``, ``W_o W_v``, ``W_2 W_1`` (``d x d``, rank up to ``d``):
  batched, :func:`spectral.pair_power_iteration` on the factors, never forming the product.
  Per block, **Decision:** the ``d x d`` product is formed with one matmul; up to
  ``exact_max_dim`` (256) its exact largest singular value is taken, beyond that batched power
  iteration on the formed product (``iters`` steps, warm start when a ``warm`` dict is
  passed). Power iteration approaches sigma1 from below; warm starts make it tighten over
  successive monitor calls.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
from torch import Tensor

from stabletrain import spectral
from stabletrain.layers.deescalate import token_similarity as deesc_similarity
from stabletrain.layers.locater import qk_eigen_stats
from stabletrain.monitor import names as N

EXACT_MAX_DIM = 256
POWER_ITERS = 20

Warm = dict  # metric key -> (u, v) power-iteration vectors, updated in place


# --- helpers ---------------------------------------------------------------------------


def split_heads(w: Tensor, num_heads: int) -> Tensor:
    """Rows of a ``(H d_h) x d`` projection as ``(H, d_h, d)``: ``W_q^h`` for every head."""
    rows, d = w.shape
    if rows % num_heads:
        raise ValueError(f"{rows} rows do not split into {num_heads} heads")
    return w.reshape(num_heads, rows // num_heads, d)


def split_out_heads(wo: Tensor, num_heads: int) -> Tensor:
    """``(W_o^h)^T`` for every head as ``(H, d_h, d)``, from ``W_o`` of shape ``d x (H d_h)``."""
    return split_heads(wo.transpose(0, 1), num_heads)


def to_floats(values: Mapping[str, Tensor | float]) -> dict[str, float]:
    """A dict of scalar tensors (and floats) as floats, in its order: one device-to-host read per
    device the tensors are on, not one per value."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, Tensor)}
    by_device: dict[torch.device, list[str]] = {}
    for k, v in values.items():
        if isinstance(v, Tensor):
            by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        by_dtype: dict[torch.dtype, list[str]] = {}
        for k in keys:
            by_dtype.setdefault(values[k].dtype, []).append(k)
        # a few ops for the lot (each op is a launch on a GPU), not three a value
        groups = [(ks, torch.stack([_scalar(values[k]) for k in ks]).double()) for ks in by_dtype.values()]
        flat = torch.cat([g for _, g in groups]) if len(groups) > 1 else groups[0][1]
        out.update(zip([k for ks, _ in groups for k in ks], flat.detach().tolist()))
    return {k: out[k] for k in values}


def _scalar(v: Tensor) -> Tensor:
    return v if v.dim() == 0 else v.reshape(())


def _sigma1_formed(products: Mapping[str, Tensor], exact_max_dim: int, iters: int,
                   warm: Warm | None) -> dict[str, Tensor]:
    """sigma1 of explicitly formed matrices: exact when small, batched power iteration else."""
    out: dict[str, Tensor] = {}
    big = {}
    for key, m in products.items():
        if max(m.shape) <= exact_max_dim:
            out[key] = spectral.sigma1_exact(m)
        else:
            big[key] = m
    if big:
        keys = list(big)
        vecs = [warm.get(k) if warm is not None else None for k in keys]
        sig, new = _batched_sigma1([big[k] for k in keys], vecs, iters)
        for k, s, v in zip(keys, sig, new):
            out[k] = s
            if warm is not None:
                warm[k] = v
    return out


def _batched_sigma1(mats: Sequence[Tensor], vecs, iters: int):
    """:func:`spectral.batched_sigma1` on unit-scale copies (see :func:`_pair_sigma1`), in float64."""
    tops = [_magnitude(m.reshape(1, -1, m.shape[-1]))[0] for m in mats]
    sig, new = spectral.batched_sigma1([m / t for m, t in zip(mats, tops)], vecs, iters=iters)
    return [s.double() * t.double() for s, t in zip(sig, tops)], new


# --- weight-side quantities ------------------------------------------------------------


def weight_sigma1(mats: Mapping[str, Tensor], iters: int = POWER_ITERS,
                  warm: Warm | None = None) -> dict[str, float]:
    """sigma1 of single weights by batched power iteration, ``{"sigma1/<name>": value}``.

    ``mats`` maps a quantity name (``wq``, ``w1``, ...) to a parameter, viewed through
    :func:`spectral.as_matrix`. ``warm``, if given, maps the result keys to ``(u, v)`` from
    the previous call and is updated in place.
    """
    keys = [f"{N.SIGMA1}/{k}" for k in mats]
    vecs = [warm.get(k) if warm is not None else None for k in keys]
    sig, new = _batched_sigma1([spectral.as_matrix(m.detach()) for m in mats.values()], vecs, iters)
    if warm is not None:
        warm.update({k: v for k, v in zip(keys, new) if v is not None})
    return to_floats(dict(zip(keys, sig)))


def sec_curve(svals: Tensor) -> dict[str, Tensor]:
    """``SEC(d_h, s)`` for ``s = 1, 2, 4, ..., d_h``, max over heads (000 Eq. 4; docs/methods.md §7).

    ``svals`` is ``(H, d_h)`` in descending order, the nonzero spectrum of ``W_q^h^T W_k^h``.
    A head whose product is zero has no energy to concentrate and counts as SEC 0.
    """
    energy = svals.double().pow(2)
    cum = energy.cumsum(-1) / energy.sum(-1, keepdim=True).clamp_min(1e-300)
    d_h = svals.shape[-1]
    return {f"{N.SEC}/{N.sec_name(s)}": cum[:, s - 1].max() for s in N.sec_sizes(d_h)}


def qk_spectrum_stats(wq: Tensor, wk: Tensor, num_heads: int) -> dict[str, float]:
    """LocAteR's QK eigenspectrum statistics, per head, summed over heads (docs/methods.md §4).

    With ``W_QK = W_q^h^T W_k^h`` (``d x d``, never formed; ``d`` = model width):
    ``eig_mean_trace = tr(W_QK) = <W_q^h, W_k^h>``,
    ``eig_scale_fro2 = tr(W_QK^T W_QK) = tr((W_q^h W_q^h^T)(W_k^h W_k^h^T))`` (the loss term),
    ``eig_scale_tr2 = tr(W_QK^2) = tr((W_k^h W_q^h^T)^2)`` (what 003 Fig. 6 plots),
    ``eig_var_d2 = d tr(W_QK^2) - tr(W_QK)^2`` (003 Eq. 8). Computed in float64 by
    :func:`stabletrain.layers.locater.qk_eigen_stats`, the regulariser's own formulas.
    """
    stats = qk_eigen_stats(split_heads(wq.detach().double(), num_heads),
                           split_heads(wk.detach().double(), num_heads))
    return to_floats({f"{N.QK_SPECTRUM}/{k}": v.sum() for k, v in stats.items()})


def qk_ov_stats(wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, num_heads: int,
                per_head: bool = False, exact_max_dim: int = EXACT_MAX_DIM,
                iters: int = POWER_ITERS, warm: Warm | None = None) -> dict[str, float]:
    """The attention products of one block (docs/methods.md §7 decisions).

    Returns ``sigma1/wq_t_wk_{max,mean,full}``, ``sigma1/wo_wv_{max,mean,full}`` (max and
    mean over heads of the per-head product; ``full`` is the full-width product, the sum
    over heads, the paper's single-head magnitude), ``sigma1/wq_t_wk_head{h}`` and
    ``sigma1/wo_wv_head{h}`` when ``per_head``, the SEC curve ``sec/s{s}`` and the QK
    eigenspectrum statistics ``qk_spectrum/eig_*``.
    """
    wq, wk, wv, wo = (w.detach() for w in (wq, wk, wv, wo))
    qk = spectral.product_singular_values(split_heads(wq, num_heads), split_heads(wk, num_heads))
    ov = spectral.product_singular_values(split_out_heads(wo, num_heads), split_heads(wv, num_heads))
    qk1, ov1 = qk[:, 0], ov[:, 0]
    out: dict[str, Tensor] = {
        f"{N.SIGMA1}/{N.WQ_T_WK_MAX}": qk1.max(),
        f"{N.SIGMA1}/{N.WQ_T_WK_MEAN}": qk1.mean(),
        f"{N.SIGMA1}/{N.WO_WV_MAX}": ov1.max(),
        f"{N.SIGMA1}/{N.WO_WV_MEAN}": ov1.mean(),
    }
    if per_head:
        for h in range(num_heads):
            out[f"{N.SIGMA1}/{N.head(N.WQ_T_WK + '_head', h)}"] = qk1[h]
            out[f"{N.SIGMA1}/{N.head(N.WO_WV + '_head', h)}"] = ov1[h]
    full = _sigma1_formed({
        f"{N.SIGMA1}/{N.WQ_T_WK_FULL}": wq.float().T @ wk.float(),
        f"{N.SIGMA1}/{N.WO_WV_FULL}": wo.float() @ wv.float(),
    }, exact_max_dim, iters, warm)
    out.update(full)
    out.update(sec_curve(qk))
    res = to_floats(out)
    res.update(qk_spectrum_stats(wq, wk, num_heads))
    return res


def mlp_stats(w1: Tensor, w2: Tensor, exact_max_dim: int = EXACT_MAX_DIM,
              iters: int = POWER_ITERS, warm: Warm | None = None) -> dict[str, float]:
    """``sigma1/w1``, ``sigma1/w2`` (power iteration) and ``sigma1/w2_w1`` of the ``d x d`` product."""
    out = weight_sigma1({N.W1: w1, N.W2: w2}, iters=iters, warm=warm)
    prod = _sigma1_formed({f"{N.SIGMA1}/{N.W2_W1}": w2.detach().float() @ w1.detach().float()},
                          exact_max_dim, iters, warm)
    out.update(to_floats(prod))
    return out


def norm_stats(gamma: Tensor | None, beta: Tensor | None, which: str = "norm1") -> dict[str, float]:
    """L2 norms of a norm layer's gain and bias, ``norm/<which>_gamma``, ``norm/<which>_beta``.

    A missing tensor (RMSNorm, nanoGPT's bias-free LayerNorm, no-norm models) gives no entry,
    which is how the 15 quantities become 13 (docs/methods.md §7).
    """
    out = {}
    if gamma is not None:
        out[f"{N.NORM}/{which}_gamma"] = gamma.detach().float().norm()
    if beta is not None:
        out[f"{N.NORM}/{which}_beta"] = beta.detach().float().norm()
    return to_floats(out)


# --- activation-side quantities (probe batch) ------------------------------------------


def _key_mask(shape: torch.Size, mask: Tensor | None, causal: bool, device) -> Tensor | None:
    """Boolean ``True = key allowed``, broadcastable to ``(B, H, T, S)``; None = all allowed."""
    t, s = shape[-2], shape[-1]
    keep = None
    if causal:
        # SDPA's is_causal alignment (top-left), as the attention layers: query i sees keys j <= i
        keep = torch.ones(t, s, dtype=torch.bool, device=device).tril()
    if mask is not None:
        m = mask.to(device=device, dtype=torch.bool)
        keep = m if keep is None else keep & m
    return keep


def head_entropy(probs: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
    """Mean attention entropy per head, ``(H,)`` float64, natural log (001; docs/methods.md §7).

    ``probs`` is ``(B, H, T, S)``; ``mask`` (bool, ``True`` = key allowed) broadcasts to it.
    Masked entries contribute 0; rows with no allowed key are left out of the mean, which
    runs over queries and examples.
    """
    if probs.dim() != 4:
        raise ValueError(f"attention probabilities must be (batch, heads, queries, keys); got shape "
                         f"{tuple(probs.shape)}: add the missing dims, e.g. probs[None] for one example")
    p = probs.detach()
    keep = _key_mask(p.shape, mask, causal, p.device)
    # p log p in the probabilities' dtype, masked in place, each row summed in it (pairwise
    # summation: fp32 rows of 1024 keys to ~1e-7), rows averaged in float64. One temporary the
    # size of ``probs``: at T = 1024 float64 copies of it cost more than the probe's forward.
    ent_terms = torch.special.xlogy(p, p)
    if keep is not None:
        ent_terms.masked_fill_(~keep, 0.0)
        valid = keep.any(-1).expand(p.shape[:-1]).double()
    else:
        valid = torch.ones(p.shape[:-1], dtype=torch.float64, device=p.device)
    row_ent = -ent_terms.sum(-1).double() * valid
    return row_ent.sum((0, 2)) / valid.sum((0, 2)).clamp_min(1.0)


def reference_entropy(shape: torch.Size, mask: Tensor | None = None, causal: bool = False,
                      device=None) -> Tensor | float:
    """Entropy of uniform attention over the allowed keys, mean over rows: ``log T`` when
    unmasked, ``mean_i log(i + 1)`` for causal rows (0-indexed); rows with no allowed key are
    left out (0 when none has one). A tensor left on the device where a mask counts the keys."""
    t, s = shape[-2], shape[-1]
    if mask is None and causal:  # row i sees min(i + 1, S) keys: a sum of logs, on the host
        return (math.lgamma(min(t, s) + 1) + max(t - s, 0) * math.log(s)) / t if t and s else 0.0
    keep = _key_mask(shape, mask, causal, device)
    if keep is None:
        return math.log(shape[-1])
    # rows repeat along the dims ``keep`` broadcasts over: its own rows have the same mean
    # (a mask of one column stands for every key)
    n = keep.sum(-1, dtype=torch.float64) * (shape[-1] // keep.shape[-1])
    valid = n > 0
    return torch.where(valid, n.clamp_min(1.0).log(), 0.0).sum() / valid.sum().clamp_min(1)


def attention_entropy(probs: Tensor, mask: Tensor | None = None, causal: bool = False,
                      per_head: bool = True) -> dict[str, Tensor | float]:
    """``entropy/min``, ``entropy/mean`` (over heads), ``entropy/log_T`` (the uniform reference)
    and ``entropy/head{h}`` when ``per_head``, left on the device (:func:`to_floats` reads them);
    see :func:`head_entropy`."""
    ent = head_entropy(probs, mask, causal)
    out: dict[str, Tensor | float] = {
        f"{N.ENTROPY}/{N.ENT_MIN}": ent.min(),
        f"{N.ENTROPY}/{N.ENT_MEAN}": ent.mean(),
    }
    if per_head:
        out.update({f"{N.ENTROPY}/{N.head('head', h)}": e for h, e in enumerate(ent)})
    out[f"{N.ENTROPY}/{N.ENT_LOG_T}"] = reference_entropy(probs.shape, mask, causal, probs.device)
    return out


def theorem31_bound(s: Tensor, n_keys: Tensor) -> Tensor:
    """001 Theorem 3.1's entropy lower bound for logit scale ``s`` and ``n_keys`` keys, float64.

    ``beta = exp(-s sqrt(T/(T-1)))``, bound ``log(1 + (T-1) beta) + s sqrt(T(T-1)) beta /
    (1 + (T-1) beta)``. A row with a single key has entropy exactly 0, which is its bound.
    """
    s, t = torch.broadcast_tensors(s.double(), n_keys.double())
    many = t >= 2
    tt = torch.where(many, t, torch.full_like(t, 2.0))
    beta = torch.exp(-s * torch.sqrt(tt / (tt - 1)))
    z = 1 + (tt - 1) * beta
    bound = torch.log(z) + s * torch.sqrt(tt * (tt - 1)) * beta / z
    return torch.where(many, bound, torch.zeros_like(bound))


def bound_heads(wq: Tensor, wk: Tensor, bq: Tensor | None, num_heads: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """``W_q, W_k`` ``(H d_h, d)`` and the q bias ``(H d_h,)`` or None as the per-head slices
    :func:`entropy_lower_bound` takes: ``(H, d_h, d)``, ``(H, d_h, d)``, ``(H, d_h)``."""
    return split_heads(wq, num_heads), split_heads(wk, num_heads), None if bq is None else bq.reshape(num_heads, -1)


def entropy_lower_bound(wq_h: Tensor, wk_h: Tensor, x: Tensor, causal: bool = False,
                        bq_h: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
    """Theorem 3.1 (001) beside the measured entropy, per head ``(H,)`` float64.

    docs/methods.md §7 mapping: ``sigma = ||W_q^h^T W_k^h||_2 / sqrt(d_h)`` (the softmax scale
    folded in; position biases and q/k norms are outside the theorem),
    ``sigma_x = ||X||_2^2`` of the attention input ``X`` (``T x d``, after the pre-norm),
    per sequence, ``s = sigma sigma_x``. Non-causal rows use ``T`` keys. Causal row ``i``
    (1-indexed) uses ``T = i``; **Decision:** it keeps the whole sequence's ``sigma_x``
    (``||X_{1:i}||_2 <= ||X||_2`` and the bound falls with ``s``, so it stays a valid bound)
    and the first row, whose entropy is exactly 0, counts with bound 0, so that the mean
    over rows is over the same rows as the measured entropy. Mean over the batch.
    ``mask`` (bool, ``True`` = key allowed, broadcastable to ``(B, H, T, S)``, as
    :func:`head_entropy` takes it): row ``i`` uses its allowed keys' count (with the causal
    limit, if any) and rows with none are left out of the mean, as they are of the entropy's;
    a row's logits over fewer keys are a part of the same row, whose norm is still at most ``s``.

    ``wq_h, wk_h``: ``(H, d_h, d)`` stacked head slices (or one ``(d_h, d)`` head); ``x``:
    ``(B, T, d)`` or ``(T, d)``. Each norm is exact or an upper bound of it (4e-7 above at most for a
    768-wide matrix,
    :func:`spectral.top_eigenvalue_upper`), never below it: an underestimate would overstate
    a lower bound.

    q/k biases. The theorem needs only ``||u|| <= s`` for a row ``u`` of logits, up to a
    constant added to the row (softmax ignores it). The k bias adds such a constant,
    ``q_i . b_k``, so it drops out. The q bias does not; ``W_q x + b_q = [W_q | b_q] [x; 1]``,
    so with ``bq_h`` (``(H, d_h)`` or ``(d_h,)``) row ``i`` is ``X W_k^T [W_q | b_q] [x_i; 1]``
    and ``s = ||[W_q | b_q]^T W_k||_2 / sqrt(d_h) * ||X||_2 * ||[X | 1]||_2`` bounds it.
    Without it, a q bias can lower the entropy below the bias-free "bound".
    """
    return entropy_lower_bounds([(wq_h, wk_h, x, causal, bq_h, mask)])[0]


def entropy_lower_bounds(blocks: Sequence[tuple], by_squaring: bool | None = None) -> list[Tensor]:
    """:func:`entropy_lower_bound` of several blocks, ``(wq_h, wk_h, x, causal, bq_h)`` or
    ``(wq_h, wk_h, x, causal, bq_h, mask)`` each.
    Blocks of one layout (shapes, dtypes, devices, causal, a q bias or none: every block of a
    ViT or GPT, a Swin stage's) are stacked and go through each step together, so that the
    ops dispatched do not grow with their number (on a GPU each op is a launch, a host cost:
    GPT-2 S's twelve blocks, in the three runs its memory budget cuts them into, took 1,688 ops
    block by block and take 774 stacked)."""
    layouts: dict[tuple, list[int]] = {}
    parts = []
    for i, (wq_h, wk_h, x, causal, bq_h, *rest) in enumerate(blocks):
        if wq_h.dim() == 2:
            wq_h, wk_h = wq_h[None], wk_h[None]
            bq_h = None if bq_h is None else bq_h[None]
        x = x[None] if x.dim() == 2 else x
        keep = None
        if rest and rest[0] is not None:  # (B | 1, H | 1, T, S | 1), the causal limit in it
            keep = _key_mask((x.shape[-2],) * 2, rest[0], bool(causal), x.device)
            keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        parts.append((wq_h.detach(), wk_h.detach(), x.detach(), None if bq_h is None else bq_h.detach(), keep))
        key = [(tuple(t.shape), t.dtype, t.device) for t in parts[-1] if t is not None]
        layouts.setdefault((*key, bq_h is not None, keep is not None, bool(causal)), []).append(i)
    out: list[Tensor] = [torch.empty(0)] * len(parts)
    for (*_, biased, masked, causal), idx in layouts.items():
        wq_h, wk_h, x = (torch.stack([parts[i][j] for i in idx]) for j in range(3))  # (n, H, d_h, d), (n, B, T, d)
        if biased:
            bq_h = torch.stack([parts[i][3] for i in idx])
            wq_h = torch.cat([wq_h, bq_h.to(wq_h.dtype)[..., None]], -1)
        a, b = wq_h.double(), wk_h.double()
        # ||W_q^h^T W_k^h||_2^2: the top eigenvalue of a d_h x d_h core per head
        core = spectral.gram_product_core(a @ a.transpose(-1, -2), b @ b.transpose(-1, -2))
        sigma = spectral.top_eigenvalue_upper(core).sqrt() / math.sqrt(wk_h.shape[-2])  # (n, H)
        xd = x.double()
        # ||X||_2^2 = ||X X^T||_2 (the theorem's sigma_x): the top eigenvalue of the smaller Gram
        sigma_x = _gram_top(_gram(xd), by_squaring)  # (n, B)
        if biased:
            with_one = torch.cat([xd, torch.ones_like(xd[..., :1])], -1)  # [X | 1]
            sigma_x = (sigma_x * _gram_top(_gram(with_one), by_squaring)).sqrt()
            del with_one
        del xd
        s = sigma.to(sigma_x.device)[:, None, :, None] * sigma_x[:, :, None, None]  # (n, B, H, 1)
        t = x.shape[-2]
        if masked:  # each row's allowed keys; rows with none left out, as head_entropy leaves them
            keep = torch.stack([parts[i][4] for i in idx])  # (n, B | 1, H | 1, T, S | 1)
            n_keys = keep.sum(-1, dtype=torch.float64) * (t // keep.shape[-1])
            valid = (n_keys > 0).double().expand(s.shape[:3] + n_keys.shape[-1:])
            rows = (theorem31_bound(s, n_keys) * valid).sum((1, 3)) / valid.sum((1, 3)).clamp_min(1.0)
        else:
            if causal:
                n_keys = torch.arange(1, t + 1, dtype=torch.float64, device=s.device)
            else:
                n_keys = torch.full((1,), float(t), dtype=torch.float64, device=s.device)
            rows = theorem31_bound(s, n_keys).mean(-1).mean(1)
        for i, bound in zip(idx, rows.unbind(0)):  # (H,) each
            out[i] = bound
    return out


def bound_bytes(x_shape: Sequence[int] | None, qkv_shape: Sequence[int], biased: bool) -> int:
    """Roughly the memory one block takes in :func:`entropy_lower_bounds`: its whole fused
    ``W_qkv`` (gathered under FSDP), its input stacked and in float64 (12 bytes an entry), and
    its input Grams in float64, four times over (the squarings' temporaries); ``x_shape`` is the
    attention input's ``(B, T, d)``."""
    weights = 4 * int(qkv_shape[0]) * int(qkv_shape[1])
    if x_shape is None:
        return weights
    b, t, d = (1, *x_shape) if len(x_shape) == 2 else x_shape
    k = min(t, d + biased)
    return weights + 12 * b * t * d + 4 * 8 * b * k * k * (2 if biased else 1)


def runs_under(sizes: Sequence[int], budget: int | None = None) -> list[list[int]]:
    """Indices of ``sizes`` cut into consecutive runs whose sum stays under ``budget``
    (``STACK_BUDGET_BYTES`` unset; a run holds one item at least)."""
    budget = STACK_BUDGET_BYTES if budget is None else budget
    runs: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not runs or total + size > budget:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += size
    return runs


def _gram(x: Tensor) -> Tensor:
    """The smaller Gram of each ``(T, d)`` matrix of ``x`` ``(B, T, d)``: its largest eigenvalue
    is ``||X||_2^2``."""
    return x @ x.transpose(-1, -2) if x.shape[-2] <= x.shape[-1] else x.transpose(-1, -2) @ x


def _gram_top(gram: Tensor, by_squaring: bool | None = None) -> Tensor:
    """The largest eigenvalue of Grams ``(..., k, k)``. On a GPU (``by_squaring`` unset) an upper
    bound, relatively at most ``k^(2^-24) - 1`` above it (4e-7 at ``k = 768``;
    :func:`spectral.top_eigenvalue_upper`): cuSOLVER's eigensolver took 55 ms a block there for
    a GPT-2 S probe batch, two thirds of the probe pass; repeated squaring is batched matmuls. On
    a CPU LAPACK's exact eigenvalues cost less than the squarings."""
    if gram.is_cuda if by_squaring is None else by_squaring:
        return spectral.top_eigenvalue_upper(gram)
    return _top_eigenvalue(gram.flatten(0, -3)).clamp_min(0.0).view(gram.shape[:-2])


def bound_stats(bound: Tensor, per_head: bool = False) -> dict[str, Tensor]:
    """``entropy/bound_min`` (min over heads: a lower bound of ``entropy/min``) and, when
    ``per_head``, ``entropy/bound_head{h}``, left on the device."""
    out: dict[str, Tensor] = {f"{N.ENTROPY}/{N.ENT_BOUND_MIN}": bound.min()}
    if per_head:
        out.update({f"{N.ENTROPY}/{N.head('bound_head', h)}": b for h, b in enumerate(bound)})
    return out


def token_similarity(x: Tensor) -> Tensor:
    """Token similarity (docs/methods.md §3) of ``(B, T, d)`` or ``(T, d)``, mean over sequences,
    a 0-dim float64 tensor; the formula lives with de-escalation,
    :func:`stabletrain.layers.deescalate.token_similarity`."""
    x = x.detach().double()
    return deesc_similarity(x[None] if x.dim() == 2 else x).mean()


def activation_norms(x: Tensor, grad: Tensor | None = None) -> dict[str, Tensor]:
    """``norm/x`` and ``norm/grad_x``: Frobenius norm per sample (tokens x width), mean over
    the batch (docs/methods.md §7), left on the device. ``x`` and ``grad`` are ``(B, ...)``."""
    out = {f"{N.NORM}/{N.ACT_X}": x.detach().float().flatten(1).norm(dim=1).mean()}
    if grad is not None:
        out[f"{N.NORM}/{N.ACT_GRAD_X}"] = grad.detach().float().flatten(1).norm(dim=1).mean()
    return out


# --- one block at a time ---------------------------------------------------------------


def block_weight_metrics(block: str, *, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor,
                         w1: Tensor, w2: Tensor, num_heads: int,
                         norm1: tuple[Tensor | None, Tensor | None] = (None, None),
                         norm2: tuple[Tensor | None, Tensor | None] = (None, None),
                         per_head: bool = False, iters: int = POWER_ITERS,
                         exact_max_dim: int = EXACT_MAX_DIM,
                         warm: Warm | None = None) -> dict[str, float]:
    """Every weight-side metric of one block under its full name (``sigma1/<block>/...``,
    ``sec/<block>/...``, ``qk_spectrum/<block>/...``, ``norm/<block>/norm{1,2}_*``).

    ``warm`` holds this block's power-iteration vectors between calls (one dict per block).
    """
    rel = weight_sigma1({N.WQ: wq, N.WK: wk, N.WV: wv, N.WO: wo}, iters=iters, warm=warm)
    rel.update(qk_ov_stats(wq, wk, wv, wo, num_heads, per_head, exact_max_dim, iters, warm))
    rel.update(mlp_stats(w1, w2, exact_max_dim, iters, warm))
    rel.update(norm_stats(*norm1, which="norm1"))
    rel.update(norm_stats(*norm2, which="norm2"))
    return N.for_block(block, rel)


def block_probe_values(block: str, *, probs: Tensor | None = None, attn_input: Tensor | None = None,
                       wq: Tensor | None = None, wk: Tensor | None = None,
                       bq: Tensor | None = None, num_heads: int = 1,
                       block_input: Tensor | None = None, block_input_grad: Tensor | None = None,
                       mask: Tensor | None = None, causal: bool = False,
                       per_head: bool = False, logit_max: Tensor | float | None = None,
                       bound: Tensor | None = None) -> dict[str, Tensor | float]:
    """Activation-side metrics of one block on the probe batch, under full names, as scalar
    tensors left on the device (a model's blocks are read in one go: :func:`to_floats`).

    ``probs`` (B, H, T, S) gives the entropy; with ``attn_input`` (the attention's input
    after the pre-norm) and ``wq, wk`` (and the q bias ``bq``, if any) also the Theorem 3.1
    bound (or ``bound``, that bound computed already: :func:`entropy_lower_bounds` of every
    block at once); ``block_input`` gives the
    token similarity and ``norm/<block>/x``, ``block_input_grad`` ``norm/<block>/grad_x``;
    ``logit_max`` (what ``attend()`` stores as ``probe["logit_max"]``, the largest scaled
    pre-bias attention logit) ``attn_logit_max/<block>``.
    """
    rel: dict[str, Tensor | float] = {}
    if logit_max is not None:
        rel[N.ATTN_LOGIT_MAX] = logit_max
    if probs is not None:
        rel.update(attention_entropy(probs, mask, causal, per_head))
        if bound is None and attn_input is not None and wq is not None and wk is not None:
            wq_h, wk_h, bq_h = bound_heads(wq, wk, bq, num_heads)
            bound = entropy_lower_bound(wq_h, wk_h, attn_input, causal, bq_h, mask)
        if bound is not None:
            rel.update(bound_stats(bound, per_head))
    if block_input is not None:
        rel[N.TOKEN_SIM] = token_similarity(block_input)
        rel.update(activation_norms(block_input, block_input_grad))
    return N.for_block(block, rel)


# --- every block at once (what the training monitor runs) ------------------------------

POWER_ITERS_COLD = 50  # first pass, random starts: ~1% worst on random-init ViT-B (30: ~2%)
POWER_ITERS_WARM = 10  # later passes start from the previous pass's vectors
STACK_BUDGET_BYTES = 1 << 30  # stacked copies per chunk of blocks (fp32 + fp64 attention)
GRAM_JITTER = 1e-11


class BlockWeights(NamedTuple):
    """One block's weight-side inputs. ``wq, wk, wv``: ``(H d_h, d)``; ``wo``: ``(d, H d_h)``;
    ``w1``: ``(hidden, d)``; ``w2``: ``(d, hidden)``; ``norms``: ``(quantity, tensor)`` pairs
    such as ``("norm1_gamma", gain)``, written as ``norm/<block>/<quantity>``."""

    name: str
    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    w1: Tensor
    w2: Tensor
    num_heads: int
    norms: tuple[tuple[str, Tensor], ...] = ()


def readable_block(block) -> bool:
    """Whether :func:`block_weights` can read ``block``: timm's layout, a fused ``attn.qkv`` of
    3 x its input width rows, ``attn.proj``, ``attn.num_heads``, ``mlp.fc1`` and ``mlp.fc2``."""
    from stabletrain.layers.reparam import raw_weight

    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    layers = [getattr(m, k, None) for m, k in ((attn, "qkv"), (attn, "proj"), (mlp, "fc1"), (mlp, "fc2"))]
    if not all(isinstance(m, torch.nn.Module) for m in layers):
        return False
    # the tensors themselves: a parametrised .weight would compute sigmaReparam's W / sigma (and
    # under FSDP2, gather it) just to be looked at
    weights = [raw_weight(m) if hasattr(m, "weight") else None for m in layers]
    if not all(isinstance(w, Tensor) and w.dim() == 2 for w in weights):
        return False
    heads, rows = getattr(attn, "num_heads", None), weights[0].shape[0]
    return isinstance(heads, int) and heads > 0 and rows % (3 * heads) == 0


def block_weights(name: str, block) -> BlockWeights:
    """Read a transformer block (``.attn.qkv`` fused ``q|k|v`` rows, ``.attn.proj``,
    ``.attn.num_heads``, ``.mlp.fc1/fc2``, ``.norm1/.norm2`` with optional ``.weight/.bias``).

    Weights are read once and detached; under sigmaReparam ``.weight`` is the effective
    weight (the parametrisation runs on this read).
    """
    wq, wk, wv = block.attn.qkv.weight.detach().chunk(3, 0)
    norms = []
    for which in ("norm1", "norm2"):
        mod = getattr(block, which, None)
        for attr, label in (("weight", "gamma"), ("bias", "beta")):
            t = getattr(mod, attr, None)
            if isinstance(t, Tensor):
                norms.append((f"{which}_{label}", t.detach()))
    return BlockWeights(name, wq, wk, wv, block.attn.proj.weight.detach(), block.mlp.fc1.weight.detach(),
                        block.mlp.fc2.weight.detach(), int(block.attn.num_heads), tuple(norms))


@torch.no_grad()
def model_weight_metrics(blocks, per_head: bool = False, warm: Warm | None = None,
                         **kwargs) -> dict[str, float]:
    """Every weight-side metric of every block, ``blocks`` being ``(name, module)`` pairs
    (:func:`stabletrain.models.registry.transformer_blocks`); see :func:`stacked_weight_metrics`."""
    return stacked_weight_metrics([block_weights(n, b) for n, b in blocks], per_head, warm, **kwargs)


@contextlib.contextmanager
def _ieee_fp32_matmul():
    """fp32 matmuls in full precision (no TF32) for the duration; the trainer enables TF32."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def _chunks(weights: Sequence[BlockWeights], budget: int) -> list[list[BlockWeights]]:
    """Blocks grouped by shapes (ViT/GPT: one group; Swin: one per stage), in order of first
    appearance, each group cut into chunks whose stacked copies fit in ``budget`` bytes (:func:`_cut`)."""
    for w in weights:
        r, d = w.wq.shape
        if w.wk.shape != (r, d) or w.wv.shape != (r, d) or w.wo.shape != (d, r):
            raise ValueError(f"{w.name}: W_q, W_k, W_v must be (H d_h, d) and W_o (d, H d_h); got "
                             f"{tuple(w.wq.shape)}, {tuple(w.wk.shape)}, {tuple(w.wv.shape)}, {tuple(w.wo.shape)}")
        if w.w1.shape[1] != d or w.w2.shape != (d, w.w1.shape[0]):
            raise ValueError(f"{w.name}: W_1 must be (hidden, d) and W_2 (d, hidden); got "
                             f"{tuple(w.w1.shape)}, {tuple(w.w2.shape)}")
        if r % w.num_heads:
            raise ValueError(f"{w.name}: {r} rows do not split into {w.num_heads} heads")
    keys = [(tuple(w.wq.shape), tuple(w.w1.shape), w.num_heads, w.wq.device, w.wq.dtype) for w in weights]
    return [[weights[i] for i in chunk] for chunk in _cut(keys, budget)]


def _cut(keys: Sequence[tuple], budget: int) -> list[list[int]]:
    """Indices of blocks grouped by ``key = ((H d_h, d), (hidden, d), ...)``, in order of first
    appearance, each group cut into runs whose stacked copies fit in ``budget`` bytes."""
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    out = []
    for ((r, d), (hidden, _), *_), members in groups.items():
        per_block = 4 * r * d * (4 + 8) + 2 * hidden * d * 4
        step = max(1, budget // per_block)
        out += [members[i:i + step] for i in range(0, len(members), step)]
    return out


def block_chunks(blocks, budget: int = STACK_BUDGET_BYTES) -> list[list]:
    """``blocks`` (``(name, module)`` pairs) cut as :func:`stacked_weight_metrics` cuts their
    weights, from the shapes of the raw weights alone (which FSDP2 keeps whole in ``.shape``
    while it shards them), so that a sharded model can be gathered one chunk at a time and give
    the numbers of the whole model: the chunk fixes the power iteration's start vectors and warm keys."""
    from stabletrain.layers.reparam import raw_weight

    keys = []
    for _, blk in blocks:
        qkv, fc1 = raw_weight(blk.attn.qkv), raw_weight(blk.mlp.fc1)
        keys.append(((qkv.shape[0] // 3, qkv.shape[1]), tuple(fc1.shape), int(blk.attn.num_heads),
                     qkv.device, qkv.dtype))
    return [[blocks[i] for i in chunk] for chunk in _cut(keys, budget)]


def _start_vectors(shapes, device, seed: int = 0) -> tuple[Tensor, ...]:
    """Unit vectors from a private generator on the device: no host sync, no global RNG draw."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return tuple(spectral.random_unit(*s, device=device, generator=gen) for s in shapes)


def _usable(vecs: tuple[Tensor, ...], fresh: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Stored start vectors must be finite unit vectors: a zero or NaN weight would otherwise
    leave a zero or NaN vector that no later pass escapes from. Replaced by fresh ones."""
    out = []
    for v, f in zip(vecs, fresh):
        ok = torch.isfinite(v).all(-1, keepdim=True) & (v.norm(dim=-1, keepdim=True) > 0.5)
        out.append(torch.where(ok, v, f))
    return tuple(out)


def _pair_sigma1(a: Tensor, b: Tensor, key, warm: Warm | None, iters_cold: int, iters_warm: int):
    """:func:`spectral.pair_power_iteration` warm-started from ``warm[key]`` when it fits."""
    n, k, d = a.shape
    shapes = ((n, k), (n, d), (n, d))
    fresh = _start_vectors(shapes, a.device)
    prev = warm.get(key) if warm is not None else None
    if prev is not None and tuple(tuple(v.shape) for v in prev) == shapes and prev[0].device == a.device:
        state, iters = prev, iters_warm
    else:
        state, iters = fresh, iters_cold
    # Iterated on unit-scale copies: in fp32 the norms inside the iteration overflow once
    # entries pass ~1e19 / sqrt(width), and x / inf would report a diverging run's sigma1 as 0
    ka, kb = _magnitude(a), _magnitude(b)
    sa, sb, sab, state = spectral.pair_power_iteration(a / ka[:, None, None], b / kb[:, None, None], state,
                                                       max(1, iters))
    if warm is not None:
        warm[key] = _usable(state, fresh)
    ka, kb = ka.double(), kb.double()
    return sa * ka, sb * kb, sab * (ka * kb)


def _magnitude(stack: Tensor) -> Tensor:
    """Each matrix's largest |entry| (1 where that is 0 or not finite), shape ``(n,)``."""
    top = stack.abs().amax(dim=(-2, -1))
    return torch.where(torch.isfinite(top) & (top > 0), top, torch.ones_like(top))


def _chunk_on_device(blocks: list[BlockWeights], warm: Warm | None, iters_cold: int, iters_warm: int,
                     jitter: float) -> dict[str, Tensor]:
    """All device work of one chunk of equal-shaped blocks: a dict of result tensors (no sync).

    Stacks, with ``n`` blocks: ``X = [W_q, W_o^T, W_k, W_v]`` as ``(4, n, H d_h, d)`` and
    ``Y = [W_2^T, W_1]`` as ``(2, n, hidden, d)``; the products are ``A^T B`` with ``A`` the
    first half and ``B`` the second: ``W_q^T W_k``, ``W_o W_v``, ``W_2 W_1``.
    """
    n, h = len(blocks), blocks[0].num_heads
    r, d = blocks[0].wq.shape
    hidden, k = blocks[0].w1.shape[0], r // h
    x = torch.stack([b.wq for b in blocks] + [b.wo.T for b in blocks] + [b.wk for b in blocks]
                    + [b.wv for b in blocks]).float().view(4, n, r, d)
    y = torch.stack([b.w2.T for b in blocks] + [b.w1 for b in blocks]).float().view(2, n, hidden, d)
    # a NaN or inf anywhere makes the block's sum non-finite (a reduction, no bool copy of the
    # stacks); finite weights large enough to overflow it would overflow the spectra as well
    finite = torch.isfinite(x.view(4, n, -1).sum(-1)).all(0) & torch.isfinite(y.view(2, n, -1).sum(-1)).all(0)

    # per-head Grams in float64: (4, n, H, d_h, d_h), and M = W_k^h W_q^h^T for the traces
    x64 = x.double().view(4, n * h, k, d)
    gram = (x64 @ x64.transpose(-1, -2)).view(4, n, h, k, k)
    m = (x64[2] @ x64[0].transpose(-1, -2)).view(n, h, k, k)
    del x64
    trace = m.diagonal(dim1=-2, dim2=-1).sum(-1)
    fro2 = (gram[0] * gram[2]).sum((-2, -1))
    tr2 = (m * m.transpose(-2, -1)).sum((-2, -1))
    qk_stats = torch.stack([trace.sum(-1), fro2.sum(-1), tr2.sum(-1), (d * tr2 - trace.pow(2)).sum(-1)])
    core = spectral.gram_product_core(gram[:2], gram[2:], jitter)  # (2, n, H, d_h, d_h): qk, ov
    ov_top = spectral.top_eigenvalue(core[1])  # OV needs sigma1 only: on the device, (n, H)

    names = tuple(b.name for b in blocks)
    attn_a, attn_b, attn_ab = _pair_sigma1(x[:2].reshape(2 * n, r, d), x[2:].reshape(2 * n, r, d),
                                           ("attn",) + names, warm, iters_cold, iters_warm)
    mlp_a, mlp_b, mlp_ab = _pair_sigma1(y[0], y[1], ("mlp",) + names, warm, iters_cold, iters_warm)
    return {
        "finite": finite,
        "wq_wo": attn_a.view(2, n), "wk_wv": attn_b.view(2, n), "qk_ov_full": attn_ab.view(2, n),
        "w2": mlp_a, "w1": mlp_b, "w2_w1": mlp_ab,
        "qk_stats": qk_stats, "qk_core": core[0], "ov_top": ov_top,
    }


_EIG_POOL: ThreadPoolExecutor | None = None


def _host_spectra(core: Tensor) -> Tensor:
    """:func:`spectral.symmetric_spectra` of host matrices ``(..., k, k)``, as fast as the CPU allows.

    LAPACK runs single-threaded (its threads only slow ``64 x 64`` problems down: up to 2x on a
    busy 2-core box) and a large batch is split over up to 4 Python threads (torch releases
    the GIL), one per two cores. ~130 us per ``64 x 64`` matrix and core on the 2-core dev
    box: the one part of a weight pass that runs on the host and grows with blocks x heads.
    """
    global _EIG_POOL
    k = core.shape[-1]
    flat = core.reshape(-1, k, k)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(4, cores // 2, flat.shape[0] // 32)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if workers <= 1:
            ev = spectral.symmetric_spectra(flat)
        else:
            if _EIG_POOL is None:
                _EIG_POOL = ThreadPoolExecutor(4, thread_name_prefix="monitor-eig")
            ev = torch.cat(list(_EIG_POOL.map(spectral.symmetric_spectra, flat.chunk(workers))))
    finally:
        torch.set_num_threads(prev)
    return ev.view(core.shape[:-1])


def _schema(k: int, num_heads: int, per_head: bool) -> list[tuple[str, str]]:
    """``(group, quantity)`` of the per-block scalars, in :func:`block_weight_metrics`'s order
    (the norms, which vary by block, come last)."""
    sig = [N.WQ, N.WK, N.WV, N.WO, N.WQ_T_WK_MAX, N.WQ_T_WK_MEAN, N.WO_WV_MAX, N.WO_WV_MEAN]
    if per_head:
        for h in range(num_heads):
            sig += [N.head(N.WQ_T_WK + "_head", h), N.head(N.WO_WV + "_head", h)]
    sig += [N.WQ_T_WK_FULL, N.WO_WV_FULL]
    return ([(N.SIGMA1, q) for q in sig] + [(N.SEC, N.sec_name(s)) for s in N.sec_sizes(k)]
            + [(N.QK_SPECTRUM, q) for q in N.QK_STATS] + [(N.SIGMA1, q) for q in (N.W1, N.W2, N.W2_W1)])


def _chunk_on_host(blocks: list[BlockWeights], res: dict[str, Tensor], norms: dict[str, dict[str, float]],
                   per_head: bool) -> dict[str, dict[str, float]]:
    """Metric dicts of one chunk's blocks from its results, now host tensors: the per-head
    eigenvalues (CPU, float64), then one table of every block's scalars in :func:`_schema` order."""
    n, h, k = res["qk_core"].shape[:3]
    qk_ev = _host_spectra(res["qk_core"])  # (n, H, d_h): sigma^2 of each QK head, descending
    qk1, ov1 = qk_ev[..., 0].sqrt(), res["ov_top"].clamp_min(0.0).sqrt()  # (n, H)
    cum = qk_ev.cumsum(-1) / qk_ev.sum(-1, keepdim=True).clamp_min(1e-300)
    sec = cum[..., [s - 1 for s in N.sec_sizes(k)]].amax(1)  # (n, S): max over heads
    cols = [res["wq_wo"][0], res["wk_wv"][0], res["wk_wv"][1], res["wq_wo"][1],
            qk1.amax(1), qk1.mean(1), ov1.amax(1), ov1.mean(1)]
    if per_head:
        cols.append(torch.stack([qk1, ov1], -1).reshape(n, 2 * h))
    cols += [res["qk_ov_full"][0], res["qk_ov_full"][1], sec, res["qk_stats"].T,
             res["w1"], res["w2"], res["w2_w1"]]
    table = torch.cat([c.double().reshape(n, -1) for c in cols], 1).tolist()
    schema = _schema(k, h, per_head)
    out: dict[str, dict[str, float]] = {}
    for b, finite, row in zip(blocks, res["finite"].tolist(), table):
        if not finite:
            out[b.name] = {N.metric(N.SIGMA1, b.name, "nonfinite_weights"): 1.0}  # no spectrum of a NaN
            continue
        rec = {N.metric(g, b.name, q): v for (g, q), v in zip(schema, row)}
        for q, v in norms.get(b.name, {}).items():
            rec[N.metric(N.NORM, b.name, q)] = v
        out[b.name] = rec
    return out


@torch.no_grad()
def stacked_weight_metrics(weights: Sequence[BlockWeights], per_head: bool = False, warm: Warm | None = None,
                           *, iters_cold: int = POWER_ITERS_COLD, iters_warm: int = POWER_ITERS_WARM,
                           budget_bytes: int = STACK_BUDGET_BYTES,
                           jitter: float = GRAM_JITTER) -> dict[str, float]:
    """Every weight-side metric of every block in a handful of batched device ops and one
    device-to-host copy; the names of :func:`block_weight_metrics`, the same values up to the
    power-iteration tolerance.

    - Blocks of equal shapes are stacked (:func:`_chunk_on_device`); a block with a non-finite
      ``W_q ... W_2`` gets only ``sigma1/<block>/nonfinite_weights = 1.0``, the others are
      unaffected (every computation is per block).
    - Single matrices and the full-width products ``W_q^T W_k``, ``W_o W_v``, ``W_2 W_1``:
      :func:`spectral.pair_power_iteration` on the stacks, never forming a ``d x d`` product,
      ``iters_cold`` iterations from fresh vectors, ``iters_warm`` from ``warm`` (a dict the
      caller keeps between passes, keyed by tuples of block names). Lower bounds of sigma1,
      within about 1% after a cold pass on random-init weights, tightening over warm passes.
    - Per-head products: ``d_h x d_h`` Gram matrices of all heads of all blocks (one batched
      float64 matmul) and :func:`spectral.gram_product_core` on the device; the QK cores'
      eigenvalues (``sigma^2``: per-head sigma1 and the SEC curve) on the CPU in float64
      (:func:`_host_spectra`), the OV cores' largest by :func:`spectral.top_eigenvalue` on the
      device. Exact up to rounding (OV: relative error < 1e-6 by construction).
    - QK eigenspectrum traces from the same Grams (float64); norms by ``torch._foreach_norm``.
    - TF32 is off for these matmuls (restored afterwards).
    """
    weights = list(weights)
    if not weights:
        return {}
    with _ieee_fp32_matmul():
        chunks = _chunks(weights, budget_bytes)
        results = [_chunk_on_device(c, warm, iters_cold, iters_warm, jitter) for c in chunks]
        norm_keys = [(w.name, q) for w in weights for q, _ in w.norms]
        norm_ts = [t.float() for w in weights for _, t in w.norms]
        if norm_ts:
            dev = norm_ts[0].device
            if all(t.device == dev for t in norm_ts):
                norm_vals = torch.stack(torch._foreach_norm(norm_ts))
            else:
                norm_vals = torch.stack([t.norm().to(dev) for t in norm_ts])
            results.append({"norms": norm_vals})
        results = _to_host(results)
    norms: dict[str, dict[str, float]] = {}
    if norm_ts:
        for (blk, q), v in zip(norm_keys, results.pop()["norms"].tolist()):
            norms.setdefault(blk, {})[q] = v
    per_block: dict[str, dict[str, float]] = {}
    for chunk, res in zip(chunks, results):
        per_block.update(_chunk_on_host(chunk, res, norms, per_head))
    out: dict[str, float] = {}
    for w in weights:
        out.update(per_block[w.name])
    return out


def _to_host(results: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """The same dicts with host tensors, float64: one concatenated copy per device (one device
    in practice, so one device-to-host transfer and one sync for the whole pass)."""
    flat: dict[torch.device, list[Tensor]] = {}
    where = []
    for res in results:
        for t in res.values():
            flat.setdefault(t.device, []).append(t.double().reshape(-1))
            where.append((t.device, len(flat[t.device]) - 1, t.shape))
    host = {dev: torch.cat(ts).cpu().split([t.numel() for t in ts]) for dev, ts in flat.items()}
    it = iter(where)
    out = []
    for res in results:
        out.append({})
        for name in res:
            dev, i, shape = next(it)
            out[-1][name] = host[dev][i].view(shape)
    return out


def _top_eigenvalue(gram: torch.Tensor) -> torch.Tensor:
    """The largest eigenvalue of each symmetric matrix; NaN where it is not finite or the solver
    gives up (a diverging run's activations), so a monitor reports the state instead of failing."""
    out = torch.full(gram.shape[:1], float("nan"), dtype=gram.dtype, device=gram.device)
    ok = torch.isfinite(gram).flatten(1).all(1)
    if ok.any():
        try:
            out[ok] = torch.linalg.eigvalsh(gram[ok])[:, -1]
        except torch.linalg.LinAlgError:  # one matrix at a time: only the one the solver gives up on is NaN
            for i in ok.nonzero().flatten().tolist():
                try:
                    out[i] = torch.linalg.eigvalsh(gram[i])[-1]
                except torch.linalg.LinAlgError:
                    pass
    return out
