"""Largest singular values, the one implementation shared by AdamW², sigmaReparam and monitors.

Power iteration (docs/methods.md §1): alternate ``v <- normalize(W^T u)``, ``u <- normalize(W v)``,
then ``sigma = ||W v||``. Matrices of equal shape are stacked and iterated together, so a
model's worth of weights costs a handful of batched matmuls instead of one tiny kernel per
tensor; matrices whose rows are split across ranks (FSDP) are iterated with a process group.
Small spectra of products ``A^T B`` of thin ``d_h x d`` slices come from a ``d_h x d_h``
matrix, never from a ``d x d`` SVD: after thin QR (:func:`product_singular_values`), or, for a
whole model at once, from batched Gram matrices (:func:`gram_product_core` on the device, then
:func:`symmetric_spectra` on the CPU). sigma1 of a product ``A^T B`` of full-width factors comes
from :func:`pair_power_iteration`, which never forms the product.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from typing import Any

import torch
import torch.distributed
from torch import Tensor

_EPS = 1e-12


def matrix_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape :func:`as_matrix` gives a tensor of ``shape`` (no tensor needed)."""
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) > 2:
        shape = (shape[0], math.prod(shape[1:]))
    return shape


def as_matrix(t: Tensor) -> Tensor:
    """View a parameter as the matrix whose spectral norm bounds it.

    Leading size-1 dims are dropped (timm ``pos_embed (1, N, d)`` -> ``(N, d)``, ``cls_token``
    -> vector); tensors with more than two dims are flattened to ``(shape[0], -1)`` (conv
    kernels). A 1-D result stays 1-D: its sigma1 is its L2 norm.
    """
    return t.reshape(matrix_shape(t.shape))


def normalize(x: Tensor, dim: int = -1) -> Tensor:
    return x / x.norm(dim=dim, keepdim=True).clamp_min(_EPS)


def normalize_or(x: Tensor, keep: Tensor, norm: Tensor | None = None) -> Tensor:
    """``x`` normalised along its last dim, or ``keep`` (a unit vector) where ``x`` is zero.

    A power iteration's vectors must stay unit vectors: one that became zero (the matrix was
    zero at that step, as a zero-initialised layer is, or the vector was orthogonal to it) would
    be kept by a warm start and give sigma1 = 0 at every later step. ``norm``: ``x``'s norms
    when already known (a sum over ranks)."""
    norm = x.norm(dim=-1, keepdim=True) if norm is None else norm.unsqueeze(-1)
    # no clamp: where a norm is 0 the quotient is not taken (one kernel fewer in the optimizer step)
    return torch.where(norm > _EPS, x / norm, keep)


def random_unit(*shape: int, device=None, dtype=torch.float32, generator=None) -> Tensor:
    return normalize(torch.randn(*shape, device=device, dtype=dtype, generator=generator))


@torch.no_grad()
def power_iteration(
    w: Tensor, u: Tensor, v: Tensor, iters: int, group: Any = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Batched power iteration on ``w`` of shape ``(B, m, n)`` (or ``(m, n)``).

    ``u`` is ``(B, m)``, ``v`` is ``(B, n)``. Returns ``(sigma, u, v)`` with ``sigma = ||W v||``
    for the final ``v``; ``u, v`` are the updated unit vectors (new tensors). ``iters >= 1``.

    With a process ``group``, each rank holds a block of rows of every matrix (FSDP's dim-0
    shards; a rank may hold none) and the matching rows of ``u``; ``v`` is the same on every
    rank. ``W^T u`` is then a sum over ranks and ``||W v||^2`` too: two all-reduces per
    iteration, of ``B * n`` and ``B`` numbers, and the result is the whole matrices' sigma1.
    """
    squeeze = w.dim() == 2
    if squeeze:
        w, u, v = w[None], u[None], v[None]
    # W^T u and W v as row vectors (B, 1, .) times a matrix: the same numbers, but the CPU's
    # batched gemm runs this form 4-20x faster than a matrix times a column; and the vectors stay
    # in that shape throughout: on a GPU each op is the host's time, not only the device's
    u, v, wt = u.unsqueeze(1), v.unsqueeze(1), w.transpose(1, 2)
    for _ in range(iters):
        wtu = torch.bmm(u, w)
        if group is not None:
            torch.distributed.all_reduce(wtu, group=group)
        v = normalize_or(wtu, v)
        wv = torch.bmm(v, wt)
        if group is None:
            u = normalize_or(wv, u)
        else:
            sigma = row_norms(wv, group)
            u = normalize_or(wv, u, sigma)
    if group is None:
        sigma = wv.norm(dim=-1)
    if squeeze:
        return sigma[0, 0], u[0, 0], v[0, 0]
    return sigma.squeeze(1), u.squeeze(1), v.squeeze(1)


def row_norms(x: Tensor, group: Any = None) -> Tensor:
    """L2 norms along the last dim; with a process ``group``, of rows split across its ranks."""
    if group is None:
        return x.norm(dim=-1)
    sq = (x * x).sum(-1)
    torch.distributed.all_reduce(sq, group=group)
    return sq.sqrt()


@torch.no_grad()
def batched_sigma1(
    mats: Sequence[Tensor],
    vectors: Sequence[tuple[Tensor, Tensor] | None] | None = None,
    iters: int = 3,
) -> tuple[list[Tensor], list[tuple[Tensor, Tensor] | None]]:
    """sigma1 of many matrices, iterated in groups of equal shape and device (in fp32).

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
        for i, si, ui, vi in zip(idx, s.unbind(0), u.unbind(0), v.unbind(0)):  # 3 ops, not 3 per matrix
            sigmas[i] = si
            out_vecs[i] = (ui, vi)
    return sigmas, out_vecs  # type: ignore[return-value]


def sigma1_exact(w: Tensor) -> Tensor:
    """Exact largest singular value in float64 (the monitors' small per-head products; tests)."""
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


@torch.no_grad()
def pair_power_iteration(
    a: Tensor, b: Tensor, state: tuple[Tensor, Tensor, Tensor], iters: int
) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """sigma1 of ``A``, of ``B`` and of ``M = A^T B`` (never formed), batched, in one loop.

    ``a`` and ``b`` are ``(N, k, d)`` (any strides: slices of one stacked tensor do);
    ``state = (u_a, v_b, v_ab)`` are unit start vectors of shapes ``(N, k)``, ``(N, d)``,
    ``(N, d)``. Each iteration is the power iteration of all three: ``v_a = n(A^T u_a)``,
    ``u_a = n(A v_a)``; ``u_b = n(B v_b)``, ``v_b = n(B^T u_b)``; ``u = n(A^T (B v_ab))``,
    ``v_ab = n(B^T (A u))``; ``n`` normalises. The matvecs that touch the same factor the same
    way run as one ``bmm`` with two columns, so an iteration reads ``A`` and ``B`` twice
    each (four ``bmm``), what the product alone would cost. Estimates are
    ``||A v_a||``, ``||B^T u_b||`` and ``||M^T u||`` from the last iteration, lower bounds of
    sigma1 (each at least the ``||W v||`` of :func:`power_iteration`). ``iters >= 1``.

    Used on stacked blocks for ``(W_q, W_k, W_q^T W_k)``, ``(W_o^T, W_v, W_o W_v)`` and
    ``(W_2^T, W_1, W_2 W_1)``. Returns ``(sigma_a, sigma_b, sigma_ab, new_state)``.
    """
    u_a, v_b, v_ab = state
    for _ in range(iters):
        # W x as bmm(W, columns), W^T y as bmm(rows, W): no transposed operand (the CPU's
        # batched gemm is several times slower on one; cuBLAS does not mind either way)
        y = torch.bmm(b, torch.stack((v_ab, v_b), -1))  # (N, k, 2): B v_ab, B v_b
        u_b = normalize(y[..., 1])
        x = normalize(torch.bmm(torch.stack((y[..., 0], u_a), 1), a))  # (N, 2, d): u, v_a
        z = torch.bmm(a, x.transpose(1, 2))  # (N, k, 2): A u, A v_a
        sigma_a = z[..., 1].norm(dim=-1)
        u_a = normalize_or(z[..., 1], u_a, sigma_a)
        w = torch.bmm(torch.stack((z[..., 0], u_b), 1), b)  # (N, 2, d): M^T u, B^T u_b
        sigma = w.norm(dim=-1)  # (N, 2): sigma_ab, sigma_b
        v = normalize_or(w, torch.stack((v_ab, v_b), 1), sigma)
        v_ab, v_b = v[:, 0], v[:, 1]
    return sigma_a, sigma[:, 1], sigma[:, 0], (u_a, v_b, v_ab)


def gram_product_core(ga: Tensor, gb: Tensor, jitter: float = 1e-11) -> Tensor:
    """A symmetric ``C`` whose eigenvalues are the squared singular values of ``A^T B``.

    ``ga = A A^T`` and ``gb = B B^T`` are ``(..., k, k)`` Gram matrices of thin ``k x d``
    factors. The nonzero singular values of ``A^T B`` satisfy ``sigma^2 = eig(G_A G_B)``; with
    ``G_A = L L^T`` (Cholesky) that is ``eig(L^T G_B L)``, symmetric positive semi-definite.
    ``G_A`` gets ``jitter * mean(diag G_A)`` on its diagonal (plus a tiny absolute floor) so
    that a rank-deficient or zero factor still factorises; the eigenvalues move by at most
    that times ``||G_B||``. A zero ``A`` (``diag G_A = 0``) gives ``C = 0``, as ``A^T B = 0``: the
    floor alone would leave ``1e-300 G_B``, whose relative spectrum (an SEC curve) is ``B``'s.
    Computed in float64; batched (one Cholesky call, no host sync: ``cholesky_ex`` does not
    check ``info``). Pair with :func:`symmetric_spectra`.
    """
    ga, gb = ga.double(), gb.double()
    k = ga.shape[-1]
    scale = ga.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(0.0)
    eye = torch.eye(k, dtype=ga.dtype, device=ga.device)
    shift = (jitter * scale + 1e-300)[..., None, None] * eye
    lower = torch.linalg.cholesky_ex(ga + shift)[0]
    core = lower.transpose(-2, -1) @ gb @ lower
    return torch.where((scale == 0)[..., None, None], torch.zeros((), dtype=core.dtype, device=core.device), core)


def symmetric_spectra(c: Tensor) -> Tensor:
    """Eigenvalues of symmetric PSD matrices ``(..., k, k)``, descending, clamped at 0, float64.

    Meant for the CPU (small matrices in a batch: LAPACK per matrix, no GPU solver launch
    per matrix). Matrices with non-finite entries give NaN rows instead of an error.
    """
    c = c.double()
    ok = torch.isfinite(c).flatten(-2).all(-1)
    safe = torch.where(ok[..., None, None], c, torch.zeros((), dtype=c.dtype, device=c.device))
    ev = torch.linalg.eigvalsh(safe).flip(-1).clamp_min(0.0)
    return torch.where(ok[..., None], ev, torch.full((), float("nan"), dtype=ev.dtype, device=ev.device))


def _normalised_power(c: Tensor, squarings: int) -> tuple[Tensor, Tensor]:
    """``P = C^m / tr(C^m)`` with ``m = 2^squarings`` (each step ``P <- P^2 / tr(P^2)``) and
    ``log tr(C^m) / m``, float64. With ``t_i`` the trace divided out at step ``i`` (``t_0 = tr C``),
    ``tr(C^m) = prod_i t_i^(2^(squarings - i))``, so ``log tr(C^m) / m = sum_i 2^-i log t_i``: the
    power itself, which over- or underflows for any useful ``m``, is never formed.

    The trace is divided out every ``_RENORM_EVERY`` squarings and at the last (``t_i = 1`` at
    the others): from ``tr P = 1``, ``r`` squarings leave ``tr P^(2^r) >= k^(1 - 2^r)``, for
    ``r = 4`` far above float64's smallest normal number at any width, and ``P`` never grows.
    So a step is one ``bmm``, and four ops more every fourth; the logs are taken once at the
    end: the host's launches, not the device's arithmetic, set its time on a GPU for the
    monitors' small batches. Only ``t_0`` needs a floor (later traces are at least ``k^-15``)."""
    c = c.double()
    shape, k = c.shape[:-2], c.shape[-1]
    p = c.reshape(-1, k, k)
    t = _trace(p).clamp_min(torch.finfo(p.dtype).tiny)
    traces = [t]
    p = p / t.view(-1, 1, 1)
    for i in range(1, squarings + 1):
        p = torch.bmm(p, p)
        if i % _RENORM_EVERY == 0 or i == squarings:
            t = _trace(p)
            traces.append(t)
            p = p / t.view(-1, 1, 1)
    # the steps divided at, made on the device (a list sent there would wait for its queue)
    steps = torch.arange(0, squarings + 1, _RENORM_EVERY, dtype=p.dtype, device=p.device)
    if squarings % _RENORM_EVERY:
        steps = torch.cat([steps, torch.full((1,), float(squarings), dtype=p.dtype, device=p.device)])
    weights = torch.exp2(-steps)
    log_root = (torch.stack(traces, -1).log() * weights).sum(-1)
    return p.view(*shape, k, k), log_root.view(shape)


_RENORM_EVERY = 4  # squarings between two divisions by the trace (_normalised_power)


def _trace(m: Tensor) -> Tensor:
    return m.diagonal(dim1=-2, dim2=-1).sum(-1)


def top_eigenvalue(c: Tensor, squarings: int = 24) -> Tensor:
    """Largest eigenvalue of symmetric PSD matrices ``(..., k, k)`` by repeated squaring, float64.

    With ``P = C^m / tr(C^m)``, ``m = 2^squarings`` (:func:`_normalised_power`),
    ``lambda = tr(C P) = sum_i lambda_i^(m+1) / sum_i lambda_i^m``: a lower bound whose
    relative error is at most ``(k - 1) / (e m)`` (1.4e-6 at ``k = 64``, ``m = 2^24``; half that
    on its square root, a singular value) and far less unless many eigenvalues sit just below
    the top. Batched matmuls only, so it stays on
    the device (no eigensolver launch per matrix, no sync); a zero matrix gives 0.
    """
    c = c.double()
    p, _ = _normalised_power(c, squarings)
    top = (c * p).sum((-2, -1))  # tr(C P) with P symmetric, tr P = 1
    return torch.where(_trace(c) == 0, torch.zeros((), dtype=c.dtype, device=c.device), top)  # 0/0 for C = 0; NaN stays


def top_eigenvalue_upper(c: Tensor, squarings: int = 24) -> Tensor:
    """An upper bound of the largest eigenvalue of symmetric PSD matrices ``(..., k, k)``, float64:
    ``tr(C^m)^(1/m) = (sum_i lambda_i^m)^(1/m)``, ``m = 2^squarings``, which lies in
    ``[lambda_1, k^(1/m) lambda_1]`` (``k^(1/m) - 1`` is 4e-7 at ``k = 768``, ``m = 2^24``), up to
    rounding of about ``|ln lambda_1|`` machine epsilons (it is taken from logs).

    For a bound that must not be overstated by an underestimated norm (Theorem 3.1's entropy
    bound): on a GPU it is batched matmuls, where the eigensolver runs matrix by matrix with a
    host sync each. A zero matrix gives 0; a non-finite one NaN.
    """
    c = c.double()
    _, log_root = _normalised_power(c, squarings)
    top = torch.where(_trace(c) > 0, log_root.exp(), torch.zeros((), dtype=c.dtype, device=c.device))
    finite = torch.isfinite(c).flatten(-2).all(-1)
    return torch.where(finite, top, torch.full((), float("nan"), dtype=c.dtype, device=c.device))


def product_singular_values_gram(a: Tensor, b: Tensor, jitter: float = 1e-11) -> Tensor:
    """Like :func:`product_singular_values` (``(..., k)``, descending) but without QR or SVD:
    float64 Grams, :func:`gram_product_core` where the inputs are, eigenvalues on the CPU."""
    a, b = a.double(), b.double()
    core = gram_product_core(a @ a.transpose(-1, -2), b @ b.transpose(-1, -2), jitter)
    return symmetric_spectra(core.cpu()).sqrt()
