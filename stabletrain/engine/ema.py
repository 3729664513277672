"""Exponential moving average of the weights, evaluated beside the live model (``ema.decay``).

The averaging is timm's ``ModelEmaV3`` (foreach lerp over the parameters); what is ours:

- ``ema.every = k`` updates every k-th step with ``decay ** k``: the same averaging horizon for
  1/k of the memory traffic (one read of the weights and a read-modify-write of the average).
- Buffers are copied, not averaged (``exclude_buffers``): sigmaReparam's ``u, v`` are unit
  vectors, and an average of unit vectors is not one.
- **Decision:** before each evaluation the average's sigmaReparam vectors get
  ``EVAL_POWER_ITERS`` power iterations on the averaged weights, so the EMA model divides by
  ``sigma1`` of its own ``W`` rather than by ``u^T W_ema v`` for the live model's vectors.
"""

from __future__ import annotations

import torch
from torch import nn

EVAL_POWER_ITERS = 10


class WeightEma:
    def __init__(self, model: nn.Module, decay: float, every: int = 1, warmup: bool = False):
        from timm.utils import ModelEmaV3

        self.every = int(every)
        self.updates = 0  # averaging steps taken, the clock of timm's decay warmup
        self.ema = ModelEmaV3(model, decay=decay**self.every, use_warmup=warmup, exclude_buffers=True)
        self.module = self.ema.module
        self._reps = None

    @torch.no_grad()
    def after_step(self, model: nn.Module, step: int) -> None:
        """Called after optimizer step ``step`` (0-based)."""
        if (step + 1) % self.every:
            return
        self.updates += 1
        # timm's step-based decay is 0 (a copy) for the first two calls; without warmup we
        # start the average from the initial weights like the live model, decay from the start
        self.ema.update(model, step=self.updates if self.ema.use_warmup else None)

    @torch.no_grad()
    def for_eval(self) -> nn.Module:
        """The averaged model, its sigmaReparam vectors fitted to its own weights."""
        from stabletrain.layers.reparam import reparam_step, sigma_reparams

        if self._reps is None:
            self._reps = sigma_reparams(self.module)
        if self._reps:
            for _ in range(EVAL_POWER_ITERS):
                reparam_step(self.module, self._reps)
        return self.module

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict | None, model: nn.Module) -> None:
        """Restore the average; ``None`` (a checkpoint without one) starts it from ``model``."""
        if state is None:
            self.ema.set(model)
            return
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
