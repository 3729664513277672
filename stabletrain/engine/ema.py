"""Exponential moving average of the weights, evaluated beside the live model (``ema.decay``).

The averaging is timm's ``ModelEmaV3`` (foreach lerp over the parameters); what is ours:

- ``ema.every = k`` updates every k-th step with ``decay ** k``: the same averaging horizon for
  1/k of the memory traffic (one read of the weights and a read-modify-write of the average).
- Buffers are copied, not averaged (``exclude_buffers``): sigmaReparam's ``u, v`` are unit
  vectors, and an average of unit vectors is not one.
- A step can be skipped without a copy of the average (``found_inf``, set by engine/guard.py
  around a step that AdamW² or a fused torch optimizer skips): the update then lerps with a
  device-tensor weight, ``1 - decay`` or 0 for a skipped step (a lerp of weight 0 returns the
  average bit-exactly; of weight ``1 - decay`` the numbers of timm's update), and keeps the
  buffers with ``torch.where``. Only for averages of fp32/fp64 weights of the model's dtype
  (``skips_exactly``); timm's stochastic rounding of bf16 averages is not conditional.
- Under ``parallel=fsdp`` the average is an FSDP2 model sharded like the live one: each rank
  averages its own shards, the evaluation gathers them block by block, and DCP checkpoints it.
- **Decision:** before each evaluation the average's sigmaReparam vectors get
  ``EVAL_POWER_ITERS`` power iterations on the averaged weights, so the EMA model divides by
  ``sigma1`` of its own ``W`` rather than by ``u^T W_ema v`` for the live model's vectors.
"""

from __future__ import annotations

import torch
from torch import nn

from stabletrain.engine.sharding import local

EVAL_POWER_ITERS = 10


class WeightEma:
    def __init__(self, model: nn.Module, decay: float, every: int = 1, warmup: bool = False):
        from timm.utils import ModelEmaV3

        self.every = int(every)
        self.updates = 0  # averaging steps taken, the clock of timm's decay warmup
        self.ema = ModelEmaV3(model, decay=decay**self.every, use_warmup=warmup, exclude_buffers=True)
        self.module = self.ema.module
        self._reps = None
        self.found_inf: torch.Tensor | None = None  # nonzero 0-dim device tensor: the step was skipped
        self.sharded = False  # set by :meth:`shard`
        pairs = list(zip(self.module.parameters(), model.parameters()))
        self.skips_exactly = all(e.dtype == m.dtype and e.dtype in (torch.float32, torch.float64)
                                 and e.device == m.device for e, m in pairs)

    @torch.no_grad()
    def after_step(self, model: nn.Module, step: int) -> None:
        """Called after optimizer step ``step`` (0-based)."""
        if (step + 1) % self.every:
            return
        self.updates += 1
        # timm's step-based decay is 0 (a copy) for the first two calls; without warmup we
        # start the average from the initial weights like the live model, decay from the start
        step_ = self.updates if self.ema.use_warmup else None
        if self.found_inf is None and not self.sharded:
            self.ema.update(model, step=step_)
        else:
            skip = self.found_inf.reshape(()) > 0 if self.found_inf is not None else None
            self._update_unless(model, self.ema.get_decay(step_), skip)

    def _update_unless(self, model: nn.Module, decay: float, skip: torch.Tensor | None) -> None:
        """timm's ``apply_update_no_buffers_`` with the weight ``1 - decay`` on the device, 0 where
        ``skip``; on this rank's shards when the model is FSDP2-sharded (the average is sharded alike)."""
        if skip is not None and not self.skips_exactly:
            raise RuntimeError("WeightEma: found_inf needs an fp32/fp64 average of the model's dtype and device")
        if self.sharded:  # an evaluation leaves the root's parameters gathered (FSDP2 keeps them for a backward)
            self.module.reshard()
        by_dtype: dict[torch.dtype, tuple[list, list]] = {}
        for e, m in zip(self.module.parameters(), model.parameters()):
            es, ms = by_dtype.setdefault(e.dtype, ([], []))
            es.append(local(e))
            ms.append(local(m))
        for dtype, (es, ms) in by_dtype.items():
            if skip is None:
                torch._foreach_lerp_(es, ms, 1.0 - decay)
                continue
            weight = torch.full((), 1.0 - decay, dtype=dtype, device=skip.device).masked_fill_(skip, 0.0)
            torch._foreach_lerp_(es, ms, weight)
        for e, m in zip(self.module.buffers(), model.buffers()):
            if skip is None:
                e.copy_(m)
            else:
                torch.where(skip, e, m.to(e.device, e.dtype), out=e)

    def shard(self, shard_fn) -> None:
        """Shard the average as the live model is sharded: ``shard_fn(module)`` applies FSDP2
        to it in place (each rank then averages and stores only its shards)."""
        shard_fn(self.module)
        self.sharded = True

    @torch.no_grad()
    def for_eval(self) -> nn.Module:
        """The averaged model, its sigmaReparam vectors fitted to its own weights."""
        from stabletrain.layers.reparam import reparam_step, sigma_reparams

        if self.sharded:  # the shards are what the power iteration reads (and what it finds once)
            self.module.reshard()
        if self._reps is None:
            self._reps = sigma_reparams(self.module)
        if self._reps:
            for _ in range(EVAL_POWER_ITERS):
                reparam_step(self.module, self._reps)
        return self.module

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), **self.counters()}

    def counters(self) -> dict:
        """The state besides the averaged model (which a sharded checkpoint saves through DCP)."""
        return {"updates": self.updates}

    def load_state_dict(self, state: dict | None, model: nn.Module) -> None:
        """Restore the average; ``None`` (a checkpoint without one) starts it from ``model``.
        Without ``"module"`` (a sharded checkpoint) the averaged model was loaded through DCP."""
        if state is None:
            self.ema.set(model)
            return
        if "module" in state:
            self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
