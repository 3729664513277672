"""Largest singular values, the one implementation shared by AdamW², sigmaReparam and monitors.

Power iteration (SPEC section 1): alternate ``v <- normalize(W^T u)``, ``u <- normalize(W v)``,
then ``sigma = ||W v||``. Matrices of equal shape are stacked and iterated together, so a
model's worth of weights costs a handful of batched matmuls instead of one tiny kernel per
tensor. Small spectra of products ``A^T B`` of thin ``d_h x d`` slices come from a ``d_h x d_h``
matrix after thin QR, never from a ``d x d`` SVD.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

_EPS = 1e-12


def as_matrix(t: Tensor) -> Tensor:
    """View a parameter as the matrix whose spectral norm bounds it.

    Leading size-1 dims are dropped (timm ``pos_embed (1, N, d)`` -> ``(N, d)``, ``cls_token``
    -> vector); tensors with more than two dims are flattened to ``(shape[0], -1)`` (conv
    kernels). A 1-D result stays 1-D: its sigma1 is its L2 norm.
    """
    while t.dim() > 1 and t.shape[0] == 1:
        t = t[0]
    if t.dim() > 2:
        t = t.reshape(t.shape[0], -1)
    return t


def normalize(x: Tensor, dim: int = -1) -> Tensor:
    return x / x.norm(dim=dim, keepdim=True).clamp_min(_EPS)


def random_unit(*shape: int, device=None, dtype=torch.float32, generator=None) -> Tensor:
    return normalize(torch.randn(*shape, device=device, dtype=dtype, generator=generator))


@torch.no_grad()
def power_iteration(w: Tensor, u: Tensor, v: Tensor, iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """Batched power iteration on ``w`` of shape ``(B, m, n)`` (or ``(m, n)``).

    ``u`` is ``(B, m)``, ``v`` is ``(B, n)``. Returns ``(sigma, u, v)`` with ``sigma = ||W v||``
    for the final ``v``; ``u, v`` are the updated unit vectors (new tensors). ``iters >= 1``.
    """
    squeeze = w.dim() == 2
    if squeeze:
        w, u, v = w[None], u[None], v[None]
    for _ in range(iters):
        v = normalize(torch.bmm(w.transpose(1, 2), u.unsqueeze(-1)).squeeze(-1))
        wv = torch.bmm(w, v.unsqueeze(-1)).squeeze(-1)
        u = normalize(wv)
    sigma = wv.norm(dim=-1)
    if squeeze:
        return sigma[0], u[0], v[0]
    return sigma, u, v


@torch.no_grad()
def batched_sigma1(
    mats: Sequence[Tensor],
    vectors: Sequence[tuple[Tensor, Tensor] | None] | None = None,
    iters: int = 3,
) -> tuple[list[Tensor], list[tuple[Tensor, Tensor] | None]]:
    """sigma1 of many matrices, iterated in groups of equal shape, dtype and device.

    ``mats`` are already matrices or vectors (see :func:`as_matrix`); computation is fp32.
    ``vectors[i]`` is a warm start ``(u, v)`` for ``mats[i]`` or ``None`` for fresh random
    unit vectors. Returns the sigmas (0-dim fp32 tensors) and the final ``(u, v)`` per
    matrix (``None`` for vectors, whose sigma1 is the exact L2 norm).
    """
    n = len(mats)
    vectors = list(vectors) if vectors is not None else [None] * n
    sigmas: list[Tensor | None] = [None] * n
    out_vecs: list[tuple[Tensor, Tensor] | None] = [None] * n
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, m in enumerate(mats):
        if m.dim() == 1:
            sigmas[i] = m.float().norm()
        else:
            groups[(tuple(m.shape), m.device)].append(i)
    for (shape, device), idx in groups.items():
        w = torch.stack([mats[i] for i in idx]).float()
        rows, cols = shape
        u = torch.stack(
            [vectors[i][0] if vectors[i] is not None else random_unit(rows, device=device) for i in idx]
        ).float()
        v = torch.stack(
            [vectors[i][1] if vectors[i] is not None else random_unit(cols, device=device) for i in idx]
        ).float()
        s, u, v = power_iteration(w, u, v, iters)
        for j, i in enumerate(idx):
            sigmas[i] = s[j]
            out_vecs[i] = (u[j], v[j])
    return sigmas, out_vecs  # type: ignore[return-value]


def sigma1_exact(w: Tensor) -> Tensor:
    """Exact largest singular value in float64 (for tests and small monitors)."""
    m = as_matrix(w).double()
    if m.dim() == 1:
        return m.norm()
    return torch.linalg.matrix_norm(m, ord=2)


def product_singular_values(a: Tensor, b: Tensor) -> Tensor:
    """Nonzero singular values of ``A^T B`` for thin ``A, B`` of shape ``(..., k, d)``, k <= d.

    With thin QR ``A^T = Q_A R_A`` and ``B^T = Q_B R_B``, ``A^T B = Q_A (R_A R_B^T) Q_B^T`` and
    the orthonormal factors do not change singular values, so a ``k x k`` SVD suffices.
    Used for ``W_q^h^T W_k^h`` (A = W_q^h, B = W_k^h) and ``W_o^h W_v^h`` (A = (W_o^h)^T).
    Returned in descending order along the last dim, fp32.
    """
    ra = torch.linalg.qr(a.float().transpose(-1, -2), mode="r")[1]
    rb = torch.linalg.qr(b.float().transpose(-1, -2), mode="r")[1]
    return torch.linalg.svdvals(ra @ rb.transpose(-1, -2))
