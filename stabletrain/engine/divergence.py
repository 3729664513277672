"""Divergence is a result: a non-finite loss, or a loss far above its running level for a
window of steps, ends the run cleanly with status ``diverged`` and the reason."""

from __future__ import annotations

import math

from stabletrain.config import DivergenceConfig


class DivergenceWatch:
    def __init__(self, cfg: DivergenceConfig | None = None):
        cfg = cfg or DivergenceConfig()
        self.enabled, self.factor, self.window = cfg.enabled, cfg.spike_factor, cfg.window
        self.warmup, self.decay = cfg.warmup_steps, cfg.ema
        self.ema: float | None = None
        self.seen = 0
        self.over = 0

    def update(self, step: int, loss: float) -> str | None:
        """Feed one step's loss; returns the reason the run diverged, or None."""
        if not math.isfinite(loss):
            return f"non-finite loss ({loss}) at step {step}"
        if not self.enabled:
            return None
        spiking = self.seen >= self.warmup and self.ema is not None and loss > self.factor * self.ema
        self.over = self.over + 1 if spiking else 0
        if self.over >= self.window:
            return (f"loss {loss:.4g} stayed above {self.factor:g}x its running mean {self.ema:.4g} "
                    f"for {self.window} steps (step {step})")
        if not spiking:  # the running level tracks healthy steps only
            self.ema = loss if self.ema is None else self.decay * self.ema + (1 - self.decay) * loss
            self.seen += 1
        return None

    def state_dict(self) -> dict:
        return {"ema": self.ema, "seen": self.seen, "over": self.over}

    def load_state_dict(self, s: dict) -> None:
        self.ema, self.seen, self.over = s["ema"], s["seen"], s["over"]
