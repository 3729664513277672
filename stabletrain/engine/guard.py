"""Skip a non-finite step without a host sync (``divergence.skip_nonfinite``).

One ``finite`` flag per step is computed on the device from the total gradient norm (after
DDP's all-reduce, so every rank holds the same flag). The step's update is then made
conditional on it, bit-exactly, for every optimizer:

- **torch's fused Adam/AdamW** (``_step_supports_amp_scaling``): the flag goes in as
  ``optimizer.found_inf``; the fused kernel then writes nothing and the step counters are
  put back (what ``GradScaler`` uses). No copy of the weights or the moments.
- **every other optimizer** (AdamW², LARS, SGD, non-fused AdamW): the weights and every
  tensor of the optimizer state are copied before the step and written back with
  ``torch.where(finite, new, old)`` after it. Cost: one extra copy of the weights and the
  optimizer state in memory (AdamW: 3x the weights), and three extra memory passes over them
  per step. While some parameter has no optimizer state yet (the first step), the step reads
  the flag on the host once and does not step at all when it is false.

In both cases the model's buffers (sigmaReparam's power-iteration vectors, updated by the step
hooks) and the weight average (EMA) are guarded the same way, so the hooks and the EMA update
of a skipped step leave no trace. Two things are not undone: the EMA's step counter (only
``ema.warmup=true`` reads it) and AdamW²'s last bound telemetry (it shows the skipped step's
nan at the next log line). AdamW²'s ``overlap_sigma_w`` loses its overlap under the guard (the
written-back weights are a new version, so sigma1(W) is iterated in line, with the same numbers).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class StepGuard:
    def __init__(self, model: nn.Module, optimizer, ema=None):
        self.model, self.optimizer, self.ema = model, optimizer, ema
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.found_inf = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
            g.get("fused") for g in optimizer.param_groups)
        self._snap: list[torch.Tensor] = []
        self._keys: list = []
        self._complete = False

    def _entries(self) -> list:
        """``(container, key)`` of every tensor a step may change: read again after the step,
        since an optimizer may put a new tensor in its state."""
        out = [(b, None) for b in self.model.buffers()]
        if self.ema is not None:
            out += [(t, None) for t in self.ema.module.state_dict().values() if torch.is_tensor(t)]
        if not self.found_inf:
            out += [(p, None) for p in self.params]
            for p in self.params:
                st = self.optimizer.state.get(p, {})
                out += [(st, k) for k, v in st.items() if torch.is_tensor(v)]
        return out

    @staticmethod
    def _get(entry) -> torch.Tensor:
        """The tensor of ``entry``; of a DTensor (FSDP2), this rank's shard, which shares its storage."""
        c, k = entry
        t = c if k is None else c[k]
        return t.to_local() if isinstance(t, DTensor) else t

    @torch.no_grad()
    def begin(self) -> None:
        """Before the forward pass: copy what the step may change."""
        self._complete = self.found_inf or all(self.optimizer.state.get(p) for p in self.params)
        self._keys = self._entries()
        tensors = [self._get(e) for e in self._keys]
        if len(self._snap) != len(tensors) or any(s.shape != t.shape or s.dtype != t.dtype
                                                  for s, t in zip(self._snap, tensors)):
            self._snap = [torch.empty_like(t) for t in tensors]
        if tensors:
            torch._foreach_copy_(self._snap, tensors)

    @torch.no_grad()
    def step(self, finite: torch.Tensor, update) -> None:
        """Run ``update()`` (the optimizer step, the hooks, the EMA) as if it never happened
        when ``finite`` is false."""
        if self.found_inf:
            self.optimizer.found_inf = (~finite).float()
            try:
                update()
            finally:
                self.optimizer.found_inf = None
        elif self._complete:
            update()
        elif bool(finite):  # the first step: some state does not exist yet (one host sync)
            update()
        for entry, old in zip(self._keys, self._snap):
            t = self._get(entry)
            if t.shape == old.shape:
                t.copy_(torch.where(finite, t, old))
