"""sigmaReparam: ``W_hat = (gamma / sigma(W)) * W`` on linear layers (001 Sec. 3.2; docs/methods.md §2).

``reparam=sigma`` reparametrises every ``nn.Linear`` and every ``nn.Conv2d`` (the patch
embedding, as its ``(out, in*kh*kw)`` flattening); ``reparam.apply_to=qk`` (``reparam=sigma_qk``) only the query and key
rows of each fused ``qkv`` and keeps the LayerNorms (only the all-layer form lets them go,
001). It is installed with ``torch.nn.utils.parametrize``, so ``module.weight`` *is*
the effective weight everywhere (forward, monitors, exports) while the optimizer trains the
raw ``module.parametrizations.weight.original`` and the gains.

Per reparametrised matrix (or ``qkv`` slice) there is a learned ``gamma`` and two persistent
unit buffers ``u`` (rows) and ``v`` (columns); ``sigma = u^T W v`` is computed in fp32 with
autocast off, with the gradient flowing through ``W`` (001 Alg. 1).

Decisions (docs/methods.md §2):

- ``u, v`` change only in :func:`reparam_step`, called once per optimizer step by the
  trainer (``power_iters`` iterations, default 1, "more steps made no difference"),
  batched by shape over the whole model through :mod:`stabletrain.spectral`. Every
  micro-batch and DDP rank therefore uses the same ``sigma``; forward and eval never touch
  the buffers (the paper's sketch iterates at every training forward).
  :func:`apply_reparam` makes the first call, so ``sigma`` is meaningful from step 0.
- ``gamma_init``: ``one`` (default) or ``svd``: ``gamma = sigma1(W_init)`` and ``u, v``
  the top singular vectors, so the initial effective weight equals the initial weight
  (the vision recipe). **Warning:** outside vision this kernel-derived init diverged; keep
  ``one`` for language and speech.
- ``qkv_split`` for the fused ``qkv``: ``joint`` (default, the official
  code: one sigma/gamma for the ``3d x d`` matrix), ``qk_v`` (queries+keys together, values
  apart; App. I's wording) or ``q_k_v`` (each slice its own). Under ``apply_to: qk`` the value
  rows stay raw; ``joint`` and ``qk_v`` then both mean one sigma for ``[W_q; W_k]``.
- ``gamma`` is a 1-element parameter whose name ends in ``.gamma``; the optimizer builder
  finds them with :func:`gamma_parameters` for ``gamma_lr_mult`` and no weight decay.
- GPT's ``lm_head`` is tied to the token embedding: it is the embedding, not a linear layer
  of the network, and reparametrising it would untie it, so it is skipped (any ``nn.Linear``
  whose weight is an ``nn.Embedding``'s).
- ``attn_fp32`` is applied by the attention layers (``stabletrain.layers.attention``).
- An all-zero weight is refused at apply time: ``sigma = 0`` leaves ``gamma / sigma``
  undefined (no family here zero-initialises a linear layer or the patch conv).
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from stabletrain.errors import ConfigError, ReachedNothing
from stabletrain.registry import Registry, option_value
from stabletrain.spectral import batched_sigma1, normalize_or, random_unit

QKV_LAYOUTS = {
    # (apply_to, qkv_split) -> one entry per slice of (q, k, v): index of the sigma that
    # scales it, None for raw rows. Equal indices share one sigma and gamma.
    ("all", "joint"): (0, 0, 0),
    ("all", "qk_v"): (0, 0, 1),
    ("all", "q_k_v"): (0, 1, 2),
    ("qk", "joint"): (0, 0, None),
    ("qk", "qk_v"): (0, 0, None),
    ("qk", "q_k_v"): (0, 1, None),
}


class SigmaPart(nn.Module):
    """The state of one spectrally normalised row block: ``gamma`` and the vectors ``u, v``."""

    def __init__(self, rows: int, cols: int, gamma: float = 1.0, u: Tensor | None = None, v: Tensor | None = None,
                 device=None):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((1,), float(gamma), device=device))
        self.register_buffer("u", random_unit(rows, device=device) if u is None else u.float().clone())
        self.register_buffer("v", random_unit(cols, device=device) if v is None else v.float().clone())

    def sigma(self, w: Tensor) -> Tensor:
        """``u^T W v`` in ``w``'s dtype (fp32 or wider); differentiable in ``w``, not in ``u, v``.
        The vectors follow a cast of the model (``.double()``, ``.bfloat16()``) and are brought
        to ``w``'s dtype here, so a cast model computes as before."""
        return self.u.to(w.dtype) @ (w @ self.v.to(w.dtype))


class SigmaReparam(nn.Module):
    """Parametrization ``W -> W_hat``: row ranges scaled by their ``gamma / sigma`` or left raw.

    ``layout`` splits the rows into equal slices (q, k, v for a fused ``qkv``; one slice
    otherwise) and names the sigma of each (``None``: raw). Slices sharing a sigma must be
    adjacent; they are normalised as one matrix (``qk_v``: ``[W_q; W_k]``).
    """

    def __init__(self, weight: Tensor, layout: tuple[int | None, ...] = (0,), gamma_init: str = "one",
                 power_iters: int = 1):
        super().__init__()
        if gamma_init not in ("one", "svd"):
            raise ConfigError(f"reparam.gamma_init={gamma_init!r} must be 'one' or 'svd'")
        if isinstance(power_iters, bool) or not isinstance(power_iters, int) or power_iters < 1:
            raise ConfigError(f"reparam.power_iters={power_iters!r} must be an integer >= 1")
        self.power_iters = power_iters
        m = weight.detach().reshape(weight.shape[0], -1)
        if m.shape[0] % len(layout):
            raise ConfigError(f"cannot split {m.shape[0]} rows into {len(layout)} equal slices")
        rows = m.shape[0] // len(layout)
        ranges: list[list] = []  # [start, stop, part]: adjacent slices of one sigma merged
        for i, p in enumerate(layout):
            if ranges and ranges[-1][2] == p:
                ranges[-1][1] += rows
            else:
                ranges.append([i * rows, (i + 1) * rows, p])
        parts = [p for *_, p in ranges if p is not None]
        if parts != list(range(len(parts))):
            raise ConfigError(f"qkv layout {layout}: slices sharing a sigma must be adjacent")
        self.ranges = [tuple(r) for r in ranges]
        self.parts = nn.ModuleList()
        for lo, hi, p in self.ranges:
            if p is None:
                continue
            sub = m[lo:hi]
            if gamma_init == "svd":
                u_, s_, vh_ = torch.linalg.svd(sub.double(), full_matrices=False)
                self.parts.append(SigmaPart(*sub.shape, s_[0].item(), u_[:, 0], vh_[0], device=sub.device))
            else:
                self.parts.append(SigmaPart(*sub.shape, device=sub.device))

    def part_matrices(self, w: Tensor) -> list[Tensor]:
        """The matrix each part normalises: its rows of ``w`` viewed as a matrix."""
        m = w.reshape(w.shape[0], -1)
        return [m[lo:hi] for lo, hi, p in self.ranges if p is not None]

    def forward(self, w: Tensor) -> Tensor:
        with torch.autocast(w.device.type, enabled=False):
            wf = w.to(torch.promote_types(w.dtype, torch.float32))  # fp32 at least, float64 kept
            mats = self.part_matrices(wf)
            scales = [part.gamma / part.sigma(mat) for part, mat in zip(self.parts, mats)]
            if len(self.ranges) == 1:
                out = wf * scales[0]
            else:
                m = wf.reshape(wf.shape[0], -1)
                out = torch.cat([m[lo:hi] if p is None else m[lo:hi] * scales[p] for lo, hi, p in self.ranges])
                out = out.reshape(w.shape)
        return out.to(w.dtype)

    def extra_repr(self) -> str:
        spans = ", ".join(f"{lo}:{hi}->{'raw' if p is None else p}" for lo, hi, p in self.ranges)
        return f"rows=[{spans}], power_iters={self.power_iters}"


def _tied_to_embedding(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def fused_qkv_layers(model: nn.Module) -> set[int]:
    """ids of the fused ``qkv`` linears (attention modules with ``qkv`` and ``num_heads``)."""
    return {id(m.qkv) for m in model.modules()
            if isinstance(getattr(m, "qkv", None), nn.Linear) and hasattr(m, "num_heads")}


def raw_weight(mod: nn.Module) -> Tensor:
    """The trained tensor behind ``mod.weight`` (the original if parametrised)."""
    if parametrize.is_parametrized(mod, "weight"):
        return mod.parametrizations.weight.original
    return mod.weight


def apply_reparam(model: nn.Module, cfg) -> nn.Module:
    """Install sigmaReparam per ``cfg`` (``reparam`` group) in place; returns ``model``.

    ``cfg.name`` is ``sigma``; ``cfg.apply_to``: ``all`` (every linear layer and conv) or ``qk``
    (query/key rows only; the ``reparam=sigma_qk`` preset). Then one :func:`reparam_step`.
    """
    if REPARAMS.get(cfg.name) is not sigma_reparam:
        raise ConfigError(f"reparam={option_value(cfg.name)}: apply_reparam needs reparam.name=sigma")
    apply_to = option_value(cfg.apply_to)
    if apply_to not in ("all", "qk"):
        raise ConfigError(f"reparam.apply_to={apply_to!r} must be all or qk")
    split = option_value(cfg.qkv_split)
    if (apply_to, split) not in QKV_LAYOUTS:
        raise ConfigError(f"reparam.qkv_split={split!r} must be joint, qk_v or q_k_v")
    gamma_init = option_value(cfg.gamma_init)
    tied, fused = _tied_to_embedding(model), fused_qkv_layers(model)
    targets = []
    for mod in model.modules():
        if not isinstance(mod, (nn.Linear, nn.Conv2d)) or parametrize.is_parametrized(mod, "weight"):
            continue
        if id(mod.weight) in tied:
            continue
        if id(mod) in fused:
            targets.append((mod, QKV_LAYOUTS[(apply_to, split)]))
        elif apply_to == "all":
            targets.append((mod, (0,)))
    if not targets and not any(parametrize.is_parametrized(m, "weight") for m in model.modules()):
        warnings.warn(f"apply_reparam: {type(model).__name__} has " + (
            "no nn.Linear or nn.Conv2d to reparametrise" if apply_to == "all" else
            "no fused qkv nn.Linear in a module with num_heads, whose query/key rows reparam.apply_to=qk "
            "reparametrises") + ": the model is unchanged", ReachedNothing, stacklevel=2)
    for mod, _ in targets:  # checked before any change, so a refusal leaves the model intact
        if mod.weight.device.type != "meta" and not mod.weight.detach().any():
            raise ConfigError(f"sigmaReparam of the all-zero weight of {mod}: sigma(W) = 0 leaves gamma / sigma "
                              "undefined; initialise it non-zero (e.g. init=stable)")
    for mod, layout in targets:
        parametrize.register_parametrization(
            mod, "weight", SigmaReparam(mod.weight, layout, gamma_init, cfg.power_iters))
    reparam_step(model)
    return model


# name -> ``(model, cfg) -> step hook | None``: installs the reparametrisation in place and
# returns what the trainer calls after every optimizer step
REPARAMS = Registry("reparam", __name__, declares=("keys",), call="(model, cfg)", returns=(
    lambda hook: hook is None or (callable(hook) and not isinstance(hook, (type, nn.Module))),
    "the hook to run after each optimizer step (a function, not the model or a class), or None"))


@REPARAMS.register("none")
def no_reparam(model: nn.Module, cfg) -> None:
    return None


@REPARAMS.register("sigma")
def sigma_reparam(model: nn.Module, cfg):
    """sigmaReparam per ``cfg``; its hook advances every ``u, v`` once per optimizer step."""
    apply_reparam(model, cfg)
    return PowerStep(model)


class PowerStep:
    """The trainer's step hook: :func:`reparam_step` on the reparametrisations of ``model``,
    found at the first call, so after FSDP2 has replaced the weights by sharded ones."""

    def __init__(self, model: nn.Module):
        self.model, self.reps = model, None

    def __call__(self) -> None:
        if self.reps is None:
            self.reps = sigma_reparams(self.model)
        reparam_step(self.model, self.reps)


def sigma_reparams(model: nn.Module) -> list[tuple[Tensor, SigmaReparam]]:
    """``(raw weight, parametrization)`` for every sigmaReparam in ``model``."""
    out = []
    for mod in model.modules():
        if parametrize.is_parametrized(mod, "weight"):
            plist = mod.parametrizations.weight
            out += [(plist.original, p) for p in plist if isinstance(p, SigmaReparam)]
    return out


@torch.no_grad()
def reparam_step(model: nn.Module, reps: list[tuple[Tensor, SigmaReparam]] | None = None) -> None:
    """Advance every ``u, v`` by ``power_iters`` power iterations, batched by shape.

    The trainer calls this once after each optimizer step (docs/methods.md §2 decision), passing
    ``reps = sigma_reparams(model)`` found once, so the hot path does not walk the modules.
    """
    reps = reps if reps is not None else sigma_reparams(model)
    if reps and _is_dtensor(reps[0][0]):
        _sharded_reparam_step(reps)
        return
    by_iters: dict[int, list[tuple[Tensor, SigmaPart]]] = defaultdict(list)
    for w, rep in reps:
        for part, mat in zip(rep.parts, rep.part_matrices(w.detach())):
            by_iters[rep.power_iters].append((mat, part))
    for iters, items in by_iters.items():
        # 001's Alg. 1 updates u = normalize(W v) first, then v = normalize(W^T u): the shared
        # iteration (v first) run on W^T with the roles of u and v swapped is exactly that
        _, vecs = batched_sigma1([m.mT for m, _ in items], [(p.v, p.u) for _, p in items], iters=iters)
        # one copy for all the vectors, not two per matrix: on a GPU each op is the host's time too
        torch._foreach_copy_([p.u for _, p in items] + [p.v for _, p in items],
                             [u for _, u in vecs] + [v for v, _ in vecs])


def _is_dtensor(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local_rows(w: Tensor) -> tuple[Tensor, int]:
    """This rank's rows of an FSDP2-sharded weight (a dim-0 DTensor shard) as a matrix, and
    the global index of its first row."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(w.placements)
    if len(placements) != 1 or not placements[0].is_shard(dim=0):
        raise TypeError(f"sigmaReparam iterates sharded weights only as FSDP2's dim-0 shards; got {placements}")
    _, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, placements)
    loc = w.to_local()
    return loc.reshape(loc.shape[0], -1), int(offset[0])


@torch.no_grad()
def _sharded_reparam_step(reps: list[tuple[Tensor, SigmaReparam]]) -> None:
    """:func:`reparam_step` on FSDP2-sharded weights, without gathering them.

    Each rank holds a block of rows of every weight and all of ``u, v`` (buffers are not
    sharded). Per iteration ``u = normalize(W v)`` needs ``||W v||^2``, a sum over the ranks'
    rows, and ``v = normalize(W^T u)`` a sum of each rank's ``W_r^T u_r``: one all-reduce each
    for all matrices together, then one more to assemble the full ``u`` from the ranks' rows;
    ``2 * power_iters + 1`` all-reduces of ``#matrices``, ``sum(cols)`` and ``sum(rows)`` numbers.
    Not :func:`stabletrain.spectral.power_iteration` with its ``group``: that one reduces once per
    shape group and iteration, this one once per iteration for every shape together.
    """
    import torch.distributed as dist

    group = reps[0][0].device_mesh.get_group(0)
    by_iters: dict[int, list[tuple[Tensor, int, SigmaPart]]] = defaultdict(list)  # (local rows, lo, part)
    for w, rep in reps:
        rows, first = _local_rows(w.detach())
        for lo, hi, p in rep.ranges:
            if p is None:
                continue
            a, b = min(max(lo, first), hi), min(max(lo, first + rows.shape[0]), hi)  # this rank's part rows
            by_iters[rep.power_iters].append((rows[a - first:b - first].float(), a - lo, rep.parts[p]))
    for iters, items in sorted(by_iters.items()):
        vs = [part.v.float() for _, _, part in items]
        for _ in range(iters):
            wv = [m @ v for (m, _, _), v in zip(items, vs)]
            norms = torch.stack([(y * y).sum() for y in wv])
            dist.all_reduce(norms, group=group)
            norms = norms.sqrt().clamp_min(1e-12)
            us = [y / n for y, n in zip(wv, norms)]
            wtu = torch.cat([u @ m for (m, _, _), u in zip(items, us)])
            dist.all_reduce(wtu, group=group)
            vs = [normalize_or(z, v) for z, v in zip(wtu.split([m.shape[1] for m, _, _ in items]), vs)]
        full_u = torch.cat([torch.zeros_like(part.u, dtype=torch.float32) for _, _, part in items])
        start = 0
        for (m, at, part), u in zip(items, us):
            full_u[start + at:start + at + m.shape[0]] = u
            start += part.u.numel()
        dist.all_reduce(full_u, group=group)
        for (_, _, part), u, v in zip(items, full_u.split([part.u.numel() for _, _, part in items]), vs):
            part.u.copy_(u)
            part.v.copy_(v)


def gamma_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, gamma)`` of every sigmaReparam gain, for ``gamma_lr_mult`` and no decay."""
    return [(f"{n}.gamma" if n else "gamma", m.gamma) for n, m in model.named_modules() if isinstance(m, SigmaPart)]
