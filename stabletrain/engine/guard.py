"""Skip a non-finite step without a host sync (``divergence.skip_nonfinite``).

One ``finite`` flag per step is computed on the device from the total gradient norm (after
DDP's all-reduce, so every rank holds the same flag). The step's update is then made
conditional on it, bit-exactly, for every optimizer. What that costs per step:

- **AdamW² and torch's fused Adam/AdamW** (``_step_supports_amp_scaling``; for torch's, only
  with ``fused=True``): the flag goes in as ``optimizer.found_inf`` (GradScaler's contract); the
  optimizer then changes nothing (optim/adamw2.py; torch's fused kernel writes nothing and the
  step counters are put back). No copy of the weights or the optimizer state, no extra pass
  over them.
- **every other optimizer** (LARS, SGD, non-fused AdamW): the weights and every tensor of the
  optimizer state are copied before the step and written back with ``torch.where(finite, new,
  old)`` after it. Cost: one extra copy of the weights and the optimizer state in memory
  (AdamW: 3x the weights), and three extra memory passes over them per step. While some
  parameter has no optimizer state yet (the first step), the step reads the flag on the host
  once and does not step at all when it is false; an optimizer that keeps no state (SGD
  without momentum) is then known as such, and not read again. State kept on the CPU (non-fused
  AdamW's step counters, beside CUDA weights) is written back with a CPU copy of the flag.

Besides the optimizer, only what a step changes is guarded:

- sigmaReparam's power-iteration vectors (the buffers of ``SigmaPart`` modules, advanced by the
  step hooks): copied and written back as above. They are small (two vectors per normalised
  matrix); no other buffer is changed by a step.
- the weight average (EMA): with the ``found_inf`` path its update itself is conditional
  (``WeightEma.found_inf``: a skipped step lerps with weight 0, which returns the average
  bit-exactly, and keeps its buffers with ``torch.where``), so it is not copied. With the copy
  path (the live weights may be non-finite while the EMA reads them) and for an EMA that cannot
  skip exactly (low-precision or cast averages) the whole average is copied and written back.

Two things are not undone: the EMA's step counter (only ``ema.warmup=true`` reads it) and,
with ``warm_start=False``, the random start vectors AdamW² drew in the skipped step. AdamW²'s
bound telemetry of a skipped step shows ``lr_eff = 0``. AdamW²'s ``overlap_sigma_w`` keeps its
overlap under the guard (no weights are written back, so the sigma1(W) iterated ahead stays valid).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def skips_natively(optimizer) -> bool:
    """Whether ``optimizer`` takes ``found_inf`` and then changes nothing: torch's fused
    optimizers and AdamW² (``_step_supports_amp_scaling``; a torch optimizer's groups must be
    ``fused``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        g.get("fused", True) for g in optimizer.param_groups)


class StepGuard:
    def __init__(self, model: nn.Module, optimizer, ema=None):
        from stabletrain.layers.reparam import SigmaPart

        self.model, self.optimizer, self.ema = model, optimizer, ema
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.found_inf = skips_natively(optimizer)
        # the only buffers a step changes: sigmaReparam's u, v (the step hooks' power iteration)
        self.buffers = [b for m in model.modules() if isinstance(m, SigmaPart) for b in m.buffers(recurse=False)]
        self.ema_skips = self.found_inf and ema is not None and getattr(ema, "skips_exactly", False)
        self._snap: list[torch.Tensor] = []
        self._keys: list = []
        self._complete = False
        self._stateless = False  # an optimizer that keeps no state (SGD without momentum): complete at once

    def _entries(self) -> list:
        """``(container, key)`` of every tensor a step may change that must be copied: read again
        after the step, since an optimizer may put a new tensor in its state."""
        out = [(b, None) for b in self.buffers]
        if self.ema is not None and not self.ema_skips:
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

    @property
    def snapshots(self) -> list[torch.Tensor]:
        """The copies :meth:`begin` made (for tests and memory accounting)."""
        return self._snap

    @torch.no_grad()
    def begin(self) -> None:
        """Before the forward pass: copy what the step may change and cannot skip by itself."""
        self._complete = self.found_inf or self._stateless or all(self.optimizer.state.get(p) for p in self.params)
        self._keys = self._entries()
        tensors = [self._get(e) for e in self._keys]
        if len(self._snap) != len(tensors) or any(s.shape != t.shape or s.dtype != t.dtype
                                                  for s, t in zip(self._snap, tensors)):
            self._snap = [torch.empty_like(t) for t in tensors]
        if tensors:
            torch._foreach_copy_(self._snap, tensors)

    @torch.no_grad()
    def step(self, finite: torch.Tensor, update) -> torch.Tensor:
        """Run ``update()`` (the optimizer step, the hooks, the EMA) as if it never happened
        when ``finite`` is false. Returns the skip flag, 1.0 where it did not happen."""
        skip = (~finite).float()
        if self.found_inf:
            self.optimizer.found_inf = skip
            if self.ema_skips:
                self.ema.found_inf = skip
            try:
                update()
            finally:
                self.optimizer.found_inf = None
                if self.ema_skips:
                    self.ema.found_inf = None
        elif self._complete:
            update()
        elif bool(finite):  # the first step: some state does not exist yet (one host sync)
            update()
            self._stateless = not any(self.optimizer.state.get(p) for p in self.params)
        on: dict = {finite.device: finite}
        for entry, old in zip(self._keys, self._snap):
            t = self._get(entry)
            if t.shape == old.shape:
                if t.device not in on:  # non-fused AdamW's step counters are on the CPU: one copy of the flag
                    on[t.device] = finite.to(t.device)
                torch.where(on[t.device], t, old, out=t)
        return skip
