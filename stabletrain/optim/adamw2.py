"""AdamW² — AdamW whose step on each bounded tensor obeys Weyl's inequality (docs/methods.md §1).

Algorithm 1 of 000, for every bounded tensor ``W`` at step ``t`` with rate ``lr``:

    m, v        Adam moments of the gradient (betas), bias-corrected to m_hat, v_hat
    U           m_hat / (sqrt(v_hat) + eps)        (eps_inside_sqrt=False, PyTorch's form)
                m_hat / sqrt(v_hat + eps)          (eps_inside_sqrt=True, Alg. 1 line 5)
    s_w, s_u    sigma1(W_{t-1}), sigma1(U) by power iteration (spectral.power_iteration)
    lr_eff      tau * s_w / s_u   if lr * s_u / s_w > tau and s_w > 0,   else lr
    W_t         W_{t-1} - lr_eff * U - lr_eff * weight_decay * W_{t-1}

By Weyl, ``sigma1(W_t) <= (1 - lr_eff*wd) s_w + lr_eff s_u <= (1 + tau) s_w``: with exact norms
no step can grow a bounded tensor's spectral norm by more than the ratio ``tau``. Power
iteration estimates both from below, so the bound holds up to its error (docs/methods.md §1). Unbounded tensors take the
plain AdamW step, identical to ``torch.optim.AdamW``.

How a step is laid out (all on the device, no host sync):

- Bounded tensors of one param group are bucketed by matrix shape (``spectral.as_matrix``).
  Each bucket owns one buffer ``(2B, rows, cols)``: the first half is a copy of the B weights,
  the second half receives their Adam directions, scaled to ``-U / wd``; one batched power
  iteration then gives all ``sigma1(W)`` and ``sigma1(U)`` of that shape at once.
- The direction comes from torch's fused Adam kernel run on the zeroed half of that buffer
  with ``lr = 1 / wd`` (one pass over g, m, v instead of eight elementwise ops);
  ``eps_inside_sqrt``, non-fp32 parameters and tensors laid out otherwise than contiguously
  (a transposed or channels_last weight: the kernel walks flat memory, the buffer is
  contiguous) take an equivalent ``torch._foreach`` path.
- The update ``W - lr_eff * U - lr_eff * wd * W`` is ``lerp(W, -U / wd, lr_eff * wd)``: one
  read-modify-write of each weight, with ``lr_eff`` a device tensor.
- Power iteration is ``spectral.power_iteration`` (the code ``spectral.batched_sigma1`` runs)
  applied to that buffer directly, which ``batched_sigma1`` would stack a second time. It runs
  in ``promote(param dtype, float32)``; 1-D bounded tensors (norm gains) use their exact L2
  norm, as ``batched_sigma1`` does.

Decisions (docs/methods.md §1): ``eps`` 1e-8 outside the root by default; ``warm_start`` keeps the
power-iteration vectors of W and of U (``w_u, w_v, upd_u, upd_v``) in ``self.state[p]`` and so
in the state dict, ``warm_start=False`` draws fresh random unit vectors every step (from the
global RNG); ``s_w == 0`` takes ``lr`` so zero-initialised tensors learn. Param group key
``bound``: ``None`` (standalone default) bounds tensors with >= 2 dims after ``as_matrix``,
``True``/``False`` force it (the trainer's grouping sets it, bounding norm gains too). Optional
group key ``names`` (or torch's ``param_names``) labels telemetry.

``overlap_sigma_w=True`` moves ``sigma1(W_{t-1})``'s half of the power iteration off step
``t``'s critical path without changing a number: ``W_{t-1}`` is final once step ``t-1`` has
written it, so right after that write the optimizer stacks each bucket's weights and iterates
them, on a side CUDA stream that runs beside step ``t``'s forward and backward (on other
devices, at once). Step ``t`` uses the result only if every tensor of the bucket still has the
version it had then (``Tensor._version``: any in-place write to a parameter, such as
``load_state_dict``, invalidates it, and the bucket is iterated inline as usual). Writes
through ``p.data`` bypass that counter, so with this option weights must be changed between
steps in place under ``torch.no_grad()``, not through ``.data``. The iteration's start vectors
and result are those of the inline path and reach ``self.state`` only when step ``t`` runs,
so checkpoints and resumes are unchanged. Needs ``warm_start`` (fresh vectors would draw from
the RNG at another time). The stack of weights, spent once iterated, is zeroed on the side
stream too and serves step ``t`` as its direction buffer: one stacked copy of the bounded
weights is held while step ``t`` runs, in place of the buffer step ``t`` would allocate.

Skipping a step (``found_inf``, set by ``engine/guard.py`` or ``GradScaler``): a nonzero flag
makes the step change nothing, bit-exactly, on the device and with no copy of the weights or
the state. torch's fused kernels take the flag (they leave weights, moments and the direction
buffer untouched) and the step counts get their increment taken back, as in torch's own
``_fused_adam``; the bounded update runs with ``lr_eff = 0`` (a lerp of weight 0 returns ``W``
exactly), and the warm-start vectors keep their start values (``torch.where`` on those small
vectors). The non-fused path (``eps_inside_sqrt``, low-precision parameters) computes the
moments and the free update out of place and keeps them with ``torch.where`` (transient
copies). A skipped step's :attr:`last_bound` shows ``lr_eff = 0``, ``sigma_u = 0`` and no bound
hit. With ``overlap_sigma_w`` the weights of a skipped step are unchanged, so the sigma1(W)
iterated after it, from the kept vectors, is that of the step before. ``warm_start=False``
still draws its random start vectors in a skipped step. Under FSDP the flag is the same on
every rank (it comes from all-reduced gradients) and every rank runs the same collectives.

Sharded parameters: under FSDP2 or HSDP (``fully_shard``; DTensor parameters split on dim 0)
each rank steps its own rows, and the power iteration reassembles the whole matrices' sigma1
with two all-reduces per iteration over the shard group (``spectral.power_iteration``). Fresh
start vectors are drawn at full length on every rank and cut to its rows, and ``v`` is
broadcast once, so the steps are those of the unsharded optimizer up to summation order
(tests/distributed/fsdp_adamw2.py). The warm-start ``u`` holds each rank's own rows, kept as a DTensor laid out
like the parameter's dim 0 (``v`` is the same on every rank), so both per-rank state dicts and
torch.distributed.checkpoint resume exactly. Sharded buckets are iterated in line even with
``overlap_sigma_w``. Other shardings (tensor parallelism's ``Shard(1)``) are refused at
construction.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from stabletrain.spectral import matrix_shape, power_iteration, random_unit, row_norms

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed
    _DTensor = None

_TINY = 1e-30  # keeps tau*s_w/s_u finite where s_u == 0; torch.where discards that branch then


@dataclass
class BoundRecord:
    """What one bucket of bounded tensors did in the last step (device tensors, no sync)."""

    names: list[str]
    lr: float | Tensor
    lr_eff: Tensor  # (B,)
    hit: Tensor  # (B,) bool: the bound was active
    sigma_w: Tensor  # (B,) sigma1(W_{t-1})
    sigma_u: Tensor  # (B,) sigma1(U)


@dataclass
class _SigmaAhead:
    """sigma1(W) of one bucket, iterated right after the step that wrote W (overlap_sigma_w)."""

    params: list[Tensor]
    versions: list[int]  # each tensor's _version when its weights were read
    iters: int
    sigma: Tensor
    u: Tensor
    v: Tensor
    u0: Tensor  # the start vectors (the kept ones): what a skipped step keeps
    v0: Tensor
    direction: Tensor  # the stacked weights' buffer, zeroed after the iteration: the next step's U
    ready: Any = None  # torch.cuda.Event recorded on the side stream, or None (computed in line)

    def wait(self) -> None:
        if self.ready is not None:
            torch.cuda.current_stream(self.sigma.device).wait_event(self.ready)

    def still_valid(self, params: list[Tensor], iters: int) -> bool:
        return (
            iters == self.iters
            and len(params) == len(self.params)
            and all(p is q and p._version == ver for p, q, ver in zip(params, self.params, self.versions))
        )


# below this weight decay the direction is not stored as -U/wd, whose entries (and their squares,
# in the power iteration) would overflow float32
_MIN_LERP_DECAY = 1e-6
W_KEYS = ("w_u", "w_v")  # warm-start vectors of sigma1(W) in self.state[p]
U_KEYS = ("upd_u", "upd_v")  # and of sigma1(U)


class AdamW2(Optimizer):
    """AdamW with the Weyl learning-rate bound of AdamW² (000, Alg. 1; docs/methods.md §1).

    ``lr``, ``betas``, ``eps``, ``weight_decay`` mean what they mean for ``torch.optim.AdamW``
    (and are checked in each param group too), plus:
        tau: largest allowed ``lr * sigma1(U) / sigma1(W)`` per step (000 Table 2: 0.004
            vision, 0.01 GPT).
        power_iters: power-iteration steps per sigma1 estimate (000: 3).
        warm_start: keep the power-iteration vectors across steps (docs/methods.md decision).
        eps_inside_sqrt: ``sqrt(v_hat + eps)`` as in Alg. 1 line 5 instead of PyTorch's
            ``sqrt(v_hat) + eps`` (docs/methods.md decision: default False).
        fused: compute the Adam direction with torch's fused Adam kernel. ``None`` uses it
            where it applies (eps outside the root, fp32/fp64 parameters on CPU or CUDA).
        overlap_sigma_w: iterate ``sigma1(W)`` for the next step as soon as this step has
            written ``W``, on a side CUDA stream (module docstring). Same numbers; needs
            ``warm_start``.

    After :meth:`step`, :meth:`bound_stats` (nested) and :meth:`telemetry` (flat metric keys)
    report the bound per tensor, with one host sync only when called; :attr:`last_bound`
    holds the same as device tensors.

    Skipping a step (the contract of torch's fused optimizers, ``_step_supports_amp_scaling``):
    set :attr:`found_inf` to a 0-dim device tensor before :meth:`step` (nonzero: skip; ``None``:
    step) and the step changes nothing, bit-exactly and without a host sync (module docstring).
    ``grad_scale`` must be ``None``: unscale the gradients first (``GradScaler.unscale_``).
    """

    _step_supports_amp_scaling = True
    found_inf: Tensor | None = None
    # no ``grad_scale`` attribute until GradScaler sets one: it multiplies ours, default 1

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        tau: float = 0.004,
        power_iters: int = 3,
        warm_start: bool = True,
        eps_inside_sqrt: bool = False,
        *,
        fused: bool | None = None,
        overlap_sigma_w: bool = False,
    ):
        if fused not in (None, True, False):
            raise ValueError(f"AdamW2: fused={fused!r} must be None (where it applies), True or False")
        if overlap_sigma_w and not warm_start:
            raise ValueError("AdamW2: overlap_sigma_w=True needs warm_start=True (set one of them differently)")
        defaults = {
            "lr": lr,
            "betas": tuple(betas) if isinstance(betas, (tuple, list)) else betas,  # checked below
            "eps": eps,
            "weight_decay": weight_decay,
            "tau": tau,
            "power_iters": power_iters,
            "warm_start": warm_start,
            "eps_inside_sqrt": eps_inside_sqrt,
            "bound": None,
        }
        _check_hyperparameters(defaults, "")
        super().__init__(params, defaults)
        for p in (p for g in self.param_groups for p in g["params"]):
            _shard_group(p)  # refuses shardings whose matrices it cannot reassemble
        self.fused = fused
        self.last_bound: list[BoundRecord] = []
        # CPU bucket buffers kept between steps: without a caching allocator a fresh one is
        # page-faulted in every step (a third of a CPU step on GPT-2 S). CUDA's allocator
        # reuses freed blocks and lends them to activations between steps, so it allocates.
        self._cpu_buffers: dict[tuple, Tensor] = {}
        self.overlap_sigma_w = overlap_sigma_w
        self._ahead: dict[tuple, _SigmaAhead] = {}  # bucket key -> sigma1(W) iterated after the last step
        self._side_streams: dict[torch.device, Any] = {}

    # --- the step -----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = self._skip_flag()
        for ahead in self._ahead.values():
            ahead.wait()  # the side stream's reads of W precede this step's writes
        records: list[BoundRecord] = []
        buckets: list[tuple[dict, tuple, list[Tensor]]] = []
        for gi, group in enumerate(self.param_groups):
            bounded: dict[tuple, list[tuple[str, Tensor]]] = defaultdict(list)
            free: list[Tensor] = []
            for name, p in zip(_group_names(group, gi), group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW2 does not support sparse gradients")
                self._init_state(p)
                if _is_bounded(group["bound"], p):
                    shape = _bounded_shape(p)  # of the whole tensor, also when p is a DTensor
                    shards = _shard_group(p)
                    # a sharded (1, N, d) table sits whole on one rank: its rows split otherwise
                    split = None if shards is None else (shards, p.shape[0] == 1)
                    bounded[(gi, shape, split, p.device, _compute_dtype(p))].append((name, p))
                else:
                    free.append(p)
            if free:
                self._step_free(group, free, skip)
            for key, members in bounded.items():
                records.append(self._step_bucket(group, key, members, skip))
                buckets.append((group, key, [p for _, p in members]))
        self.last_bound = records
        self._ahead = self._iterate_ahead(buckets) if self.overlap_sigma_w else {}
        return loss

    def _skip_flag(self) -> Tensor | None:
        """``found_inf`` (GradScaler's and StepGuard's contract) as a 0-dim bool device tensor, or None."""
        if getattr(self, "grad_scale", None) is not None:
            del self.grad_scale  # GradScaler deletes it after a step, not after one that raised
            raise RuntimeError(
                "AdamW2 does not unscale gradients: grad_scale must be None "
                "(call GradScaler.unscale_(optimizer) before GradScaler.step)"
            )
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return None
        if _is_dtensor(found_inf):
            found_inf = found_inf.full_tensor()
        return found_inf.reshape(()) > 0

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        index = len(self.param_groups)
        for key, value in param_group.items():
            # a misspelt key ("tua") would leave the group at the default; other keys (a scheduler's,
            # one's own bookkeeping: tag, layer_decay, no_decay) are the group's, as torch.optim keeps them
            if (near := _misspelt(str(key), value, self.defaults)) is not None:
                raise ValueError(f"AdamW2: param group {index}: unknown key {key!r}: did you mean {near!r}?")
            # torch AdamW's switches: a group asking for what AdamW2 does not do would be ignored (a group
            # copied from torch.optim.AdamW carries them off, which is what AdamW2 does)
            if key in _NOT_TAKEN and value is not None and (value is not False or key == "foreach"):
                raise ValueError(f"AdamW2: param group {index}: {key}={value!r}: {_NOT_TAKEN[key]}")
        for key in ("names", "param_names"):
            names = param_group.get(key)
            if names is not None and not isinstance(names, (list, tuple)):
                if isinstance(names, str) or not isinstance(names, Iterable):
                    raise ValueError(f"AdamW2: param group {index}: {key} must be a list of strings, one per "
                                     f"param, not {type(names).__name__}")
                param_group = {**param_group, key: list(names)}  # a generator, read once
        super().add_param_group(param_group)  # fills the group's missing keys from the defaults
        _check_hyperparameters(self.param_groups[-1], f"param group {index}: ")
        if param_group.get("names") or param_group.get("param_names"):  # telemetry keys: one per tensor
            taken = {n for i, g in enumerate(self.param_groups[:-1]) for n in _group_names(g, i)}
            again = []
            for n in _group_names(self.param_groups[-1], index):
                if n in taken:
                    again.append(n)
                taken.add(n)
            if again:
                raise ValueError(f"AdamW2: param group {index}: name {again[0]!r} is given twice; "
                                 f"names label the telemetry, one tensor each")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict.get("param_groups", [])
        if any("tau" not in g for g in groups):
            raise ValueError("AdamW2.load_state_dict: this state dict has no tau in its param groups, so another "
                             "optimizer (torch.optim.AdamW?) saved it; load it into that optimizer, or start "
                             "AdamW2 from fresh state")
        self._ahead = {}  # iterated from vectors the loaded state replaces
        # torch casts every loaded state tensor to its parameter's dtype: the warm-start vectors
        # are kept in the compute dtype (fp32 for bf16 weights), and a bf16 copy of one changed
        # the resumed run's sigma1 and so its steps
        saved = [i for g in groups for i in g.get("params", [])]
        current = [p for g in self.param_groups for p in g["params"]]
        vectors = {current[j]: {k: v for k, v in state_dict.get("state", {}).get(i, {}).items()
                                if k in W_KEYS + U_KEYS and isinstance(v, Tensor)}
                   for j, i in enumerate(saved) if j < len(current)}
        super().load_state_dict(state_dict)
        for p, kept in vectors.items():
            for k, v in kept.items():
                if self.state[p][k].dtype != v.dtype:
                    self.state[p][k] = v.to(device=self.state[p][k].device)
        for state in self.state.values():
            # a zero warm-start vector (saved before normalize_or kept them unit) would give
            # sigma1 = 0 for good: drawn afresh instead. v is the same on every rank: all agree.
            for ku, kv in (W_KEYS, U_KEYS):
                if kv in state and not _local(state[kv]).any():
                    del state[ku], state[kv]

    def _init_state(self, p: Tensor) -> None:
        state = self.state[p]
        if len(state) == 0:
            # the step count lives on the parameter's device: bias corrections never sync
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device:  # loaded from a checkpoint on another device
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    def _use_fused(self, group: dict, params: list[Tensor]) -> bool:
        if self.fused is False or group["eps_inside_sqrt"]:
            return False
        p0 = params[0]
        ok = (
            p0.device.type in ("cuda", "cpu")
            and p0.dtype in (torch.float32, torch.float64)
            and all(p.device == p0.device and p.dtype == p0.dtype for p in params)
        )
        if self.fused and not ok:
            raise RuntimeError("AdamW2(fused=True) needs eps_inside_sqrt=False and fp32/fp64 parameters on CPU or CUDA")
        return ok

    def _adam_direction(
        self, group: dict, params: list[Tensor], out: list[Tensor], scale: float = 1.0, skip: Tensor | None = None
    ) -> None:
        """Advance step counts and moments of ``params``; add ``scale * U`` to ``out`` (zeros).

        ``skip`` (a 0-dim bool device tensor): when true the counts and moments are left as they
        were, bit-exactly; ``out`` then stays zero (fused kernel) or gets the direction of the
        kept moments (finite), and the caller must not apply it."""
        beta1, beta2 = group["betas"]
        eps = group["eps"]
        states = [self.state[p] for p in params]
        grads = [_local(p.grad) for p in params]
        exp_avgs = [_local(s["exp_avg"]) for s in states]
        exp_avg_sqs = [_local(s["exp_avg_sq"]) for s in states]
        steps = steps_state = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        # the fused kernel walks flat memory: ``out`` is contiguous, so the others must be too (a
        # transposed or channels_last weight's moments and gradient are not)
        if self._use_fused(group, params) and all(t.is_contiguous() for t in (*grads, *exp_avgs, *exp_avg_sqs)):
            # Adam's update "out -= lr * m_hat / (sqrt(v_hat) + eps)" with lr = -scale and out = 0
            # leaves scale * U in out, in the same single pass that updates m and v.
            torch._fused_adam_(
                out,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                lr=-scale,
                beta1=beta1,
                beta2=beta2,
                weight_decay=0.0,
                eps=eps,
                amsgrad=False,
                maximize=False,
                grad_scale=None,
                found_inf=None if skip is None else skip.float(),
            )
            _unstep(steps, skip)
            return
        if skip is None:
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
        else:  # the same numbers out of place, kept where not skipped (transient copies: this path only)
            new_avgs = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
            new_sqs = torch._foreach_mul(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(new_sqs, grads, grads, 1.0 - beta2)
            _commit(exp_avgs, new_avgs, skip)
            _commit(exp_avg_sqs, new_sqs, skip)
        # bias corrections in the update's precision (a no-op cast for fp32 parameters)
        steps = [s.to(u.dtype) for s, u in zip(steps, out)]
        bias1 = _one_minus_pow(beta1, steps)
        bias2 = _one_minus_pow(beta2, steps)
        if group["eps_inside_sqrt"]:
            denom = torch._foreach_div(exp_avg_sqs, bias2)
            torch._foreach_add_(denom, eps)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, torch._foreach_sqrt(bias2))
            torch._foreach_add_(denom, eps)
        torch._foreach_mul_(denom, bias1)
        torch._foreach_addcdiv_(out, exp_avgs, denom, value=scale)
        _unstep(steps_state, skip)  # after the direction: its bias corrections never divide by zero

    def _step_free(self, group: dict, params: list[Tensor], skip: Tensor | None = None) -> None:
        """Plain AdamW (what torch.optim.AdamW does) for tensors outside the bound."""
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        if self._use_fused(group, params):
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1.0)
            torch._fused_adamw_(
                [_local(p) for p in params],
                [_local(p.grad) for p in params],
                [_local(self.state[p]["exp_avg"]) for p in params],
                [_local(self.state[p]["exp_avg_sq"]) for p in params],
                [],
                steps,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=wd,
                eps=group["eps"],
                amsgrad=False,
                maximize=False,
                grad_scale=None,
                found_inf=None if skip is None else skip.float(),
            )
            _unstep(steps, skip)
            return
        updates = [torch.zeros_like(_local(p), dtype=_compute_dtype(p)) for p in params]
        self._adam_direction(group, params, updates, skip=skip)
        local = [_local(p) for p in params]
        if skip is None:
            if wd != 0:
                torch._foreach_mul_(local, 1.0 - lr * wd)
            torch._foreach_add_(local, updates, alpha=-lr)
        else:  # the same numbers out of place, kept where not skipped
            new = torch._foreach_mul(local, 1.0 - lr * wd) if wd != 0 else [p.clone() for p in local]
            torch._foreach_add_(new, updates, alpha=-lr)
            _commit(local, new, skip)

    def _step_bucket(
        self, group: dict, key: tuple, members: list[tuple[str, Tensor]], skip: Tensor | None = None
    ) -> BoundRecord:
        """Bounded step for B tensors whose matrices share a shape (see module docstring)."""
        _, _, split, _, dtype = key
        shards = split[0] if split else None
        names = [n for n, _ in members]
        params = [p for _, p in members]
        local = [_local(p) for p in params]  # the tensors themselves unless sharded
        shape = tuple(_local_matrix(params[0]).shape)
        n = len(params)
        lr, tau, wd = group["lr"], group["tau"], group["weight_decay"]
        # The step W - lr_eff*U - lr_eff*wd*W (Alg. 1 line 11: the bounded rate scales the
        # decay too) is lerp(W, -U/wd, lr_eff*wd): one pass over W and the direction. So the
        # direction holds -U/wd (or -U without decay), and its sigma1 is rescaled below.
        lerp = wd >= _MIN_LERP_DECAY
        scale = -1.0 / wd if lerp else -1.0
        ahead = self._ahead.get(key)
        if ahead is not None and not ahead.still_valid(params, group["power_iters"]):
            ahead = None
        if ahead is None:
            buf = self._bucket_buffer(key, (2 * n, *shape))
            _stack_matrices(params, out=buf[:n])
            direction = buf[n:]
            direction.zero_()
        else:
            direction = ahead.direction  # zeroed on the side stream
        steps = [d if d.shape == t.shape else d.view(t.shape) for d, t in zip(direction.unbind(0), local)]
        self._adam_direction(group, params, steps, scale, skip)

        if len(shape) == 1:
            sigma = row_norms(buf, shards)
            sigma_w, sigma_u = sigma[:n], sigma[n:]
        elif ahead is not None:
            sigma_u = self._sigma1_matrices(group, params, direction, (U_KEYS,), shards, skip)
            self._keep_vectors(group, params, (W_KEYS,), *_unless(skip, (ahead.u, ahead.v), (ahead.u0, ahead.v0)))
            sigma_w = ahead.sigma
        else:
            sigma = self._sigma1_matrices(group, params, buf, (W_KEYS, U_KEYS), shards, skip)
            sigma_w, sigma_u = sigma[:n], sigma[n:]
        sigma_u = sigma_u * abs(1.0 / scale)

        hit = (sigma_w > 0) & (sigma_u * lr > sigma_w * tau)
        lr_eff = torch.where(hit, tau * sigma_w / sigma_u.clamp_min(_TINY), lr)
        if skip is not None:  # a skipped step moves nothing: rate 0 (what its record shows), no bound hit
            lr_eff = torch.where(skip, 0.0, lr_eff)
            hit = hit & ~skip
            sigma_u = torch.where(skip, 0.0, sigma_u)  # U of a skipped step is zero (fused) or never applied

        if lerp:
            rates = list((lr_eff * wd).unbind(0))
            if all(p.dtype == dtype for p in params):
                torch._foreach_lerp_(local, steps, rates)
            else:  # low-precision parameters: step in the compute dtype, round once
                for p, d, a in zip(local, steps, rates):
                    p.copy_(torch.lerp(p.to(dtype), d, a))
        else:
            if wd != 0:  # a decay too small for -U/wd to stay finite: W(1 - lr_eff*wd) - lr_eff*U
                torch._foreach_mul_(local, list((1.0 - lr_eff * wd).unbind(0)))
            torch._foreach_addcmul_(local, steps, list(lr_eff.unbind(0)))
        return BoundRecord(names, lr, lr_eff, hit, sigma_w, sigma_u)

    def _bucket_buffer(self, key: tuple, size: tuple) -> Tensor:
        device, dtype = key[-2:]
        if device.type != "cpu":
            return torch.empty(size, dtype=dtype, device=device)
        buf = self._cpu_buffers.get(key)
        if buf is None or buf.shape != size:
            buf = self._cpu_buffers[key] = torch.empty(size, dtype=dtype, device=device)
        return buf

    def _sigma1_matrices(
        self, group: dict, params: list[Tensor], mats: Tensor, blocks: tuple, shards: Any = None,
        skip: Tensor | None = None,
    ) -> Tensor:
        """sigma1 of ``mats`` = one block of B matrices per ``blocks`` entry (``W_KEYS``:
        the weights, ``U_KEYS``: the directions), in one batched iteration; keeps the vectors
        (the start vectors instead when ``skip`` is true: a kept vector is then unchanged).
        ``shards``: the process group over which the matrices' rows are split, or None."""
        sigma, u, v, u0, v0 = self._iterate(group, params, mats, blocks, shards)
        self._keep_vectors(group, params, blocks, *_unless(skip, (u, v), (u0, v0)))
        return sigma

    def _iterate(
        self, group: dict, params: list[Tensor], mats: Tensor, blocks: tuple, shards: Any = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(sigma, u, v)`` of the power iteration and its start vectors ``u0, v0``."""
        _, rows, cols = mats.shape
        # Fresh u's are drawn for all rows of the whole matrix and cut to this rank's rows: the
        # start vectors, and so every number, are those of the unsharded optimizer with the same
        # RNG state, and every rank draws as many numbers (its RNG stream stays in step).
        total, first = _bounded_shape(params[0])[0], _first_row(params[0], shards)
        states = [self.state[p] for p in params]
        if group["warm_start"]:
            u0 = torch.stack([_vector(s, ku, rows, mats, total, first) for ku, _ in blocks for s in states])
            v0 = torch.stack([_vector(s, kv, cols, mats) for _, kv in blocks for s in states])
        else:
            u0 = random_unit(len(mats), total, device=mats.device, dtype=mats.dtype)[:, first:first + rows]
            v0 = random_unit(len(mats), cols, device=mats.device, dtype=mats.dtype)
        # v is one vector on every rank (a kept one already is: it comes from all-reduced sums);
        # u's rows are each rank's own, so its start needs no agreement
        if shards is not None and (
            not group["warm_start"] or any(_stale(s, kv, cols) for _, kv in blocks for s in states)
        ):
            torch.distributed.broadcast(v0, group_src=0, group=shards)
        return (*power_iteration(mats, u0, v0, group["power_iters"], shards), u0, v0)

    def _keep_vectors(self, group: dict, params: list[Tensor], blocks: tuple, u: Tensor, v: Tensor) -> None:
        if not group["warm_start"]:
            return
        n = len(params)
        us, vs = u.unbind(0), v.unbind(0)  # one op each, not one per tensor: the host's work counts
        for block, (ku, kv) in enumerate(blocks):
            for i, p in enumerate(params):
                uu = us[block * n + i]
                self.state[p][ku] = _sharded_rows(uu, p) if _is_dtensor(p) else uu
                self.state[p][kv] = vs[block * n + i]

    def _iterate_ahead(self, buckets: list[tuple[dict, tuple, list[Tensor]]]) -> dict[tuple, _SigmaAhead]:
        """sigma1 of the weights this step wrote, for the next step (``overlap_sigma_w``)."""
        ahead: dict[tuple, _SigmaAhead] = {}
        waited: set[torch.device] = set()
        for group, key, params in buckets:
            _, shape, split, device, dtype = key
            if len(shape) < 2 or not group["warm_start"] or split is not None:
                continue  # sharded matrices are iterated in line (collectives stay on one stream)
            stream = self._side_stream(device)
            main = torch.cuda.current_stream(device) if stream is not None else None
            if stream is not None and device not in waited:
                stream.wait_stream(main)  # start after this step's writes to W and the vectors
                waited.add(device)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                mats = self._bucket_buffer(("ahead", *key), (len(params), *_local_matrix(params[0]).shape))
                _stack_matrices(params, out=mats)
                sigma, u, v, u0, v0 = self._iterate(group, params, mats, (W_KEYS,))
                mats.zero_()  # the stack is spent: it becomes the next step's direction buffer
            ready = None
            if stream is not None:
                for t in (sigma, u, v, u0, v0, mats):  # allocated on the side stream, used on the main one
                    t.record_stream(main)
                ready = torch.cuda.Event()
                ready.record(stream)
            versions = [p._version for p in params]
            ahead[key] = _SigmaAhead(params, versions, group["power_iters"], sigma, u, v, u0, v0, mats, ready)
        return ahead

    def _side_stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device=device)
        return self._side_streams[device]

    # --- telemetry ----------------------------------------------------------------------

    def bound_stats(self) -> dict[str, Any]:
        """The bound in the last step, as host floats (one device sync, here and only here).

        ``bound_fraction``: share of bounded tensors whose rate was cut (nan before the first
        step or with nothing bounded); per tensor name: ``lr_eff`` (App. M's "actual lr"),
        ``lr_ratio = lr_eff / lr``, ``sigma_w = sigma1(W_{t-1})``, ``sigma_u = sigma1(U)``.
        """
        if not self.last_bound:
            return {
                "bound_fraction": math.nan,
                "lr_eff": {},
                "lr_ratio": {},
                "sigma_w": {},
                "sigma_u": {},
            }
        names = [name for r in self.last_bound for name in r.names]
        rows = torch.cat(
            [
                torch.stack([r.lr_eff, r.lr_eff / r.lr if r.lr else torch.ones_like(r.lr_eff), r.sigma_w,
                             r.sigma_u, r.hit.to(r.lr_eff.dtype)])
                for r in self.last_bound
            ],
            dim=1,
        ).double().cpu()  # one device-to-host copy
        lr_eff, ratio, sigma_w, sigma_u, hit = rows.tolist()
        return {
            "bound_fraction": sum(hit) / len(hit),
            "lr_eff": dict(zip(names, lr_eff)),
            "lr_ratio": dict(zip(names, ratio)),
            "sigma_w": dict(zip(names, sigma_w)),
            "sigma_u": dict(zip(names, sigma_u)),
        }

    def telemetry(self, prefix: str = "adamw2/", per_tensor: bool = True) -> dict[str, float]:
        """:meth:`bound_stats` flattened for a metrics sink: ``adamw2/frac_bounded``,
        ``adamw2/lr_eff/<name>``, ``adamw2/lr_ratio/<name>``, ``adamw2/sigma_w/<name>``,
        ``adamw2/sigma_u/<name>`` (one host sync; call it at the logging cadence).
        ``per_tensor=False``: ``adamw2/frac_bounded`` only."""
        if not per_tensor:
            hits = [r.hit for r in self.last_bound]
            frac = torch.cat(hits).float().mean().item() if hits else math.nan
            return {f"{prefix}frac_bounded": frac}
        stats = self.bound_stats()
        flat = {f"{prefix}frac_bounded": stats.pop("bound_fraction")}
        for key, values in stats.items():
            flat.update({f"{prefix}{key}/{name}": value for name, value in values.items()})
        return flat


# --- helpers ----------------------------------------------------------------------------


def _check_hyperparameters(group: dict, where: str) -> None:
    """The constructor's arguments and each param group's own values, in one line naming the key."""
    def number(key: str, ok, need: str) -> None:
        value = group[key]
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
            value = group[key] = float(value)  # a NumPy scalar, as torch.optim.AdamW takes it
        if isinstance(value, Tensor):
            raise ValueError(f"AdamW2: {where}{key}={value!r} must be a Python number, not a tensor "
                             f"(pass {key}=float(...))")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            hint = " (a YAML 1e-3 is a string: write 1.0e-3)" if isinstance(value, str) else ""
            raise ValueError(f"AdamW2: {where}{key}={value!r} must be {need}{hint}")

    number("lr", lambda x: x >= 0, "a finite number >= 0")
    number("eps", lambda x: x > 0, "a finite number > 0 (at 0, an entry whose gradients were all 0 divides 0 by 0)")
    number("weight_decay", lambda x: x >= 0, "a finite number >= 0")
    number("tau", lambda x: x > 0, "a finite number > 0")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"AdamW2: {where}betas={betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.999)")
    for key in ("warm_start", "eps_inside_sqrt"):
        if not isinstance(group[key], bool):  # "false" would read as true
            raise ValueError(f"AdamW2: {where}{key}={group[key]!r} must be True or False")
    iters = group["power_iters"]
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"AdamW2: {where}power_iters={iters!r} must be an integer >= 1")
    if group["bound"] not in (None, True, False):
        raise ValueError(f"AdamW2: {where}bound={group['bound']!r} must be True, False or None (by shape)")


# torch.optim.AdamW's group switches that AdamW2 does not take, and why
_NOT_TAKEN = {
    "amsgrad": "AdamW2 keeps no max of the second moments (set it False or drop it)",
    "maximize": "AdamW2 minimises: negate the loss instead",
    "capturable": "AdamW2 takes no capturable mode",
    "differentiable": "AdamW2's step is not differentiable",
    "fused": "fused is the optimizer's, not a group's: AdamW2(..., fused=...)",
    "foreach": "AdamW2 always steps through torch's foreach (or fused) kernels: drop it",
}


def _misspelt(key: str, value: Any, defaults: dict) -> str | None:
    """The hyperparameter ``key`` is a misspelling of: one or two letters off it (one for a short
    name), with a value of its kind; None for a key of the group's own."""
    if key in defaults or key in ("params", "names", "param_names"):
        return None
    for known, default in defaults.items():
        if _edits(key, known) > (1 if len(known) <= 5 else 2):
            continue
        if known == "betas":
            kind = isinstance(value, (tuple, list))
        elif known == "bound" or isinstance(default, bool):
            kind = value is None or isinstance(value, bool) if known == "bound" else isinstance(value, bool)
        else:
            kind = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if kind:
            return known
    return None


def _edits(a: str, b: str) -> int:
    """Letters added, dropped, changed or swapped with a neighbour to turn ``a`` into ``b``."""
    d = [[i + j if not i * j else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def _group_names(group: dict, index: int) -> list[str]:
    names = group.get("names") or group.get("param_names")
    if names is None:
        return [f"group{index}.{i}" for i in range(len(group["params"]))]
    if len(names) != len(group["params"]):
        raise ValueError(f"AdamW2: param group {index}: {len(names)} names for {len(group['params'])} params")
    return list(names)


def _is_dtensor(t: Tensor) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


def _local(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (its FSDP shard), else ``t`` itself."""
    return t._local_tensor if _is_dtensor(t) else t


def _shard_group(p: Tensor) -> Any:
    """The process group across which ``p``'s matrix rows are split, or None.

    FSDP2 (and HSDP) shard a parameter on dim 0, so each rank holds a block of rows of
    ``as_matrix(p)`` (when dim 0 has size 1, ``as_matrix`` drops it and one rank holds all
    rows, the others none): the power iteration sums over that group. Other shardings
    (tensor parallelism) are refused."""
    if not _is_dtensor(p):
        return None
    placements = tuple(p.placements)
    sharded = [i for i, pl in enumerate(placements) if not pl.is_replicate()]
    if len(sharded) != 1 or not placements[sharded[0]].is_shard(dim=0):
        raise TypeError(
            f"AdamW2 bounds whole matrices and can reassemble them only from dim-0 shards (FSDP2, HSDP); "
            f"got a DTensor parameter placed {placements}: shard it with fully_shard or replicate it (DDP)"
        )
    return p.device_mesh.get_group(sharded[0])


def _is_bounded(flag: bool | None, p: Tensor) -> bool:
    if flag is None:
        return len(matrix_shape(p.shape)) >= 2
    return bool(flag)


def _stack_matrices(params: list[Tensor], out: Tensor) -> Tensor:
    """Copy the parameters' (local) bounded matrices into ``out`` (B, ...), casting if needed."""
    mats = [_local_matrix(p) for p in params]
    if all(m.dtype == out.dtype for m in mats):
        return torch.stack(mats, out=out)
    return out.copy_(torch.stack(mats))


def _bounded_shape(p: Tensor) -> tuple[int, ...]:
    """``matrix_shape``, with a scalar seen as a 1-vector so that its sigma1 is |x|."""
    return matrix_shape(p.shape) or (1,)


def _local_matrix(p: Tensor) -> Tensor:
    """This rank's rows of ``p``'s bounded matrix (all of it unless ``p`` is sharded)."""
    shape = _bounded_shape(p)
    return _local(p).reshape(-1, *shape[1:])


_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)


def _compute_dtype(p: Tensor) -> torch.dtype:
    """``p``'s dtype promoted with fp32: fp32 for the low-precision floats, fp64 kept, complex kept
    complex. The usual cases without torch.promote_types, which dispatches an op per tensor."""
    if p.dtype in _TO_FP32:
        return torch.float32
    return p.dtype if p.dtype == torch.float64 else torch.promote_types(p.dtype, torch.float32)


def _unstep(steps: list[Tensor], skip: Tensor | None) -> None:
    """Take back the step count's increment where ``skip`` (torch's ``_fused_adam`` does the same)."""
    if skip is not None:
        torch._foreach_sub_(steps, [skip.to(steps[0].dtype)] * len(steps))


def _commit(tensors: list[Tensor], new: list[Tensor], skip: Tensor) -> None:
    """``tensors[i] = new[i]`` unless ``skip``, without a host sync (``new`` is reused)."""
    for t, n in zip(tensors, new):
        torch.where(skip, t, n, out=n)
    torch._foreach_copy_(tensors, new)


def _unless(skip: Tensor | None, new: tuple[Tensor, ...], old: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``new``, or ``old`` where ``skip`` is true (small vectors: a fresh tensor each)."""
    if skip is None:
        return new
    return tuple(torch.where(skip, o, n) for n, o in zip(new, old))


def _one_minus_pow(beta: float, steps: list[Tensor]) -> list[Tensor]:
    powers = torch._foreach_pow(beta, steps)
    torch._foreach_neg_(powers)
    torch._foreach_add_(powers, 1.0)
    return powers


def _stale(state: dict, key: str, size: int) -> bool:
    vec = state.get(key)
    return vec is None or _local(vec).numel() != size


def _vector(state: dict, key: str, size: int, like: Tensor, draw: int | None = None, first: int = 0) -> Tensor:
    """A warm-start vector from ``state`` (cast to the compute dtype), or a fresh one: entries
    ``first:first + size`` of a random unit vector of ``draw`` (default ``size``) entries."""
    vec = state.get(key)
    if _stale(state, key, size):
        return random_unit(draw or size, device=like.device, dtype=like.dtype)[first:first + size]
    vec = _local(vec)
    if vec.dim() != 1 or vec.dtype != like.dtype or vec.device != like.device:  # kept ones are: no op
        vec = vec.reshape(size).to(device=like.device, dtype=like.dtype)
    return vec


def _first_row(p: Tensor, shards: Any) -> int:
    """Where this rank's rows start in ``p``'s bounded matrix: FSDP splits dim 0 as
    ``torch.chunk`` does (ceil-sized pieces; the last ranks may hold fewer or none)."""
    if shards is None:
        return 0
    dim0 = p.shape[0]
    piece = -(-dim0 // torch.distributed.get_world_size(shards))
    start = min(torch.distributed.get_rank(shards) * piece, dim0)
    return start * (_bounded_shape(p)[0] // dim0)


def _sharded_rows(u: Tensor, p: Tensor) -> Tensor:
    """This rank's rows ``u`` of a sharded matrix's left vector, as a DTensor laid out like
    ``p``'s dim 0, so that torch.distributed.checkpoint saves and reloads every rank's part.

    Its global shape is ``(p.shape[0], rows / p.shape[0])``: ``(rows, 1)`` for a matrix split
    by rows, ``(1, N)`` for a ``(1, N, d)`` table that one rank holds whole."""
    rows = _bounded_shape(p)[0]
    width = rows // p.shape[0]
    return _DTensor.from_local(
        u.reshape(-1, width).clone(),  # its own storage: a view into the batch does not deep-copy
        device_mesh=p.device_mesh,
        placements=p.placements,
        run_check=False,
        shape=torch.Size((p.shape[0], width)),
        stride=(width, 1),
    )
