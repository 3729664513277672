"""Divergence is a result: a non-finite loss, or a loss far above its running level for a
window of steps, ends the run cleanly with status ``diverged`` and the reason, unless
``divergence.action=rollback`` restores a ring checkpoint from before it (engine/loop.py).

With ``divergence.skip_nonfinite`` a step whose gradients are non-finite was skipped (its
update never applied, see engine/guard.py); such a step feeds nothing to the running level,
and ``max_skips`` consecutive skipped steps count as a divergence."""

from __future__ import annotations

import math
import statistics

from stabletrain.config import DivergenceConfig

SEED_LOSSES = 5  # the running mean starts as the median of this many healthy losses, not as the first one


class DivergenceWatch:
    def __init__(self, cfg: DivergenceConfig | None = None):
        cfg = cfg or DivergenceConfig()
        self.enabled, self.factor, self.window = cfg.enabled, cfg.spike_factor, cfg.window
        self.warmup, self.decay = cfg.warmup_steps, cfg.ema
        self.skip_nonfinite, self.max_skips = bool(cfg.skip_nonfinite), int(cfg.max_skips)
        self.action, self.skip_window = str(cfg.action), int(cfg.skip_window)
        self.max_rollbacks, self.lr_scale_on_rollback = int(cfg.max_rollbacks), float(cfg.lr_scale_on_rollback)
        self.ema: float | None = None
        self.first: list[float] = []  # the first SEED_LOSSES healthy losses, while the mean is seeded
        self.seen = 0
        self.over = 0
        self.above = False  # the last loss was above factor x the running mean, in the warmup too
        self.skips = 0  # consecutive skipped steps
        self.onset: int | None = None  # the first step of the trouble the last reason names
        # skipped steps may fall inside a spike: its steps are not counted back from the last one
        self.spike_from: int | None = None  # the first step of the spike under watch (while over > 0)
        # (step, running mean) of the last such loss the warmup did not count: for the progress line of
        # its interval, whatever the steps after it were
        self.uncounted: tuple[int, float] | None = None

    def update(self, step: int, loss: float, skipped: bool = False) -> str | None:
        """Feed one step's loss (``skipped``: its update was not applied); returns the reason
        the run diverged, or None. ``onset`` is then the first step of the trouble."""
        if skipped:
            self.skips += 1
            if self.skips >= self.max_skips:
                self.onset = step - self.skips + 1
                after = f" and the {self.skips - 1} step(s) after it" if self.skips > 1 else ""
                return (f"non-finite gradients at step {self.onset}{after}, skipped "
                        f"(divergence.max_skips={self.max_skips})")
            return None
        self.skips = 0
        if not math.isfinite(loss):
            self.onset = step
            return f"non-finite loss ({loss}) at step {step}"
        if not self.enabled:
            return None
        self.above = self.ema is not None and loss > self.factor * self.ema
        spiking = self.above and self.seen >= self.warmup
        if self.above and not spiking:
            self.uncounted = (step, self.ema)
        if spiking and not self.over:
            self.spike_from = step
        self.over = self.over + 1 if spiking else 0
        if self.over >= self.window:
            self.onset = self.spike_start(step)
            return (f"loss {loss:.4g} stayed above {self.factor:g}x its running mean {self.ema:.4g} "
                    f"for {self.window} steps, from step {self.onset} to step {step}")
        if not spiking:  # the running level tracks healthy steps only
            # in the warmup a spike is not counted, but it must not poison the level it is counted
            # against later either (one loss of 1e5 would hide every spike for hundreds of steps):
            # the level starts as the median of the first losses, so a first batch far off cannot set
            # it, and after them a loss enters at most at factor x the level, which still lets a
            # genuine rise lift it
            if self.seen < SEED_LOSSES:
                self.first.append(loss)
                self.ema = statistics.median_low(self.first)
            else:
                self.ema = self.decay * self.ema + (1 - self.decay) * min(loss, self.factor * self.ema)
                self.first = []
            self.seen += 1
        return None

    def unresolved_at_end(self, step: int) -> str | None:
        """At the run's last step, ``step``: a loss spike followed by skipped (non-finite) steps is
        a divergence the run ended too soon to confirm. Its weights are those the spike left, so
        they are no final state to save. A lone skipped step, without a spike, is not."""
        if not (self.skips and self.over):
            return None
        self.onset = self.spike_start(step - self.skips)
        return (f"the run ended inside a loss spike: the loss rose above {self.factor:g}x its running mean at "
                f"step {self.onset} and the last {self.skips} step(s) had non-finite gradients")

    def spike_start(self, last: int) -> int:
        """The first step of the spike under watch, whose last spiking step is ``last`` (a
        checkpoint from before ``spike_from`` was kept: counted back from ``last``)."""
        return self.spike_from if self.spike_from is not None else last - self.over + 1

    def state_dict(self) -> dict:
        return {"ema": self.ema, "seen": self.seen, "over": self.over, "skips": self.skips, "above": self.above,
                "spike_from": self.spike_from, "first": list(self.first)}

    def load_state_dict(self, s: dict, step: int | None = None) -> None:
        """``step``: the step the state was saved at. A checkpoint written before ``spike_from`` was
        kept, inside a spike, gets it back from it: the watch had seen every step to ``step``, the
        last ``skips`` of them skipped, so the last loss it measured was step ``step - skips`` and the
        spike's ``over`` steps end there (as that code counted them). Left unset, a non-finite step
        skipped after the resume would move the spike's start (and the ring checkpoint a rollback
        restores, the data it skips) one step later. Keys older code kept and this reads no more
        (``level``, ``above_at``) are passed over."""
        self.ema, self.seen, self.over = s["ema"], s["seen"], s["over"]
        # older code's state has no seed losses: its mean stands for those it had seen
        self.first = list(s.get("first", [self.ema] * min(self.seen, SEED_LOSSES) if self.ema is not None else []))
        self.skips = s.get("skips", 0)
        self.above = bool(s.get("above", self.over))
        self.spike_from = s.get("spike_from")
        self.uncounted = None  # of the history left behind, on no line from here
        if step is not None and "spike_from" not in s:
            last = step - self.skips
            self.spike_from = last - self.over + 1 if self.over else None


def record_spikes(spikes: list[dict], warmup: list[int], passed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Add an interval's loss spikes to ``spikes`` (summary.json's: ``{step, steps}``): the
    ``warmup`` steps whose loss spiked in the divergence warmup, marked ``warmup`` (not counted;
    consecutive steps are one spike, one that goes on from the last recorded grows), then the
    ``(first step, length)`` of the counted spikes that passed. A spike that began in the warmup's
    last steps and went on past it is one entry from its first step, counted: not marked.
    Returns the counted spikes as recorded, ``(first step, length)``."""
    for at in warmup:
        last = spikes[-1] if spikes else {}
        if last.get("warmup") and last["step"] + last["steps"] == at:
            last["steps"] += 1
        else:
            spikes.append({"step": at, "steps": 1, "warmup": True})
    out = []
    for first, length in passed:
        began = spike_began(spikes, first)
        if began != first:
            del spikes[-1]
        spikes.append({"step": began, "steps": first + length - began})
        out.append((began, first + length - began))
    return out


def spike_began(spikes: list[dict], first: int) -> int:
    """The first step of the spike counted from step ``first``: that of the warmup spike recorded
    last in ``spikes`` when the counted one goes on from it, ``first`` otherwise."""
    last = spikes[-1] if spikes else {}
    return last["step"] if last.get("warmup") and last["step"] + last["steps"] == first else first


def with_open_spike(spikes: list[dict], watch: DivergenceWatch, step: int) -> list[dict]:
    """summary.json's ``spikes`` for a run that stopped at ``step`` (completed, interrupted) while a
    spike was under watch: those on record, then that one, marked ``"open": true`` (it neither
    passed nor lasted the window; its updates were applied all the same). The run's own record is
    left as it is, for a resume goes on watching the spike."""
    if not watch.over:
        return spikes
    first = watch.spike_start(step - watch.skips)
    began = spike_began(spikes, first)
    kept = spikes[:-1] if began != first else spikes
    return [*kept, {"step": began, "steps": first + watch.over - began, "open": True}]
