"""The lines a run prints as it trains: one per log interval (the loss, skipped steps, a spike
under watch or passed, the lr, validation, speed, MFU and the time left) and the status line
it ends with. The trainer decides what happened; these say it."""

from __future__ import annotations

import collections
import statistics

from stabletrain.engine.divergence import DivergenceWatch, spike_began
from stabletrain.metrics import duration, milliseconds, si
from stabletrain.monitor import names as N


class Pace:
    """Seconds per step for the time left: the median of the last five log intervals, so that an
    interval slowed by something else on the machine does not multiply it. The first interval of
    a process carries the warm-up (torch.compile, the allocator, kernel autotuning): the second
    replaces it, or a compiled run's ETA would stay minutes too long."""

    def __init__(self):
        self.recent: collections.deque = collections.deque(maxlen=5)
        self.intervals = 0

    def add(self, seconds_per_step: float) -> float:
        """Count one interval's seconds per step; returns the pace from here."""
        if self.intervals == 1:
            self.recent.clear()
        self.recent.append(seconds_per_step)
        self.intervals += 1
        return statistics.median(self.recent)


def interval_fields(rec: dict, steps: list[int], skipped: list[bool], passed: list[tuple[int, int]],
                    reason: str | None, last_vals: dict, *, watch: DivergenceWatch, step: int, total_steps: int,
                    text: bool, step_time: float, spikes: list[dict] = ()) -> dict:
    """The progress line of the interval of ``steps`` (0-based) that ends at ``step``, from its
    metrics record ``rec``: which of them were ``skipped``, the spikes that ``passed`` ((first
    step, length)), the ``reason`` to stop if any, this step's evaluation ``last_vals`` (empty
    when it had none), the divergence ``watch``, the ``step_time`` the ETA counts with and the
    ``spikes`` on record (a spike under watch that began in the warmup is said from there)."""
    # validation only on the line of the step that evaluated it
    shown = {key: v for key, v in last_vals.items() if key.startswith((N.VAL + "/", N.VAL_EMA + "/"))}
    speed = {"tok/s" if text else "img/s": si(rec[N.throughput("tokens" if text else "samples")]),
             "ms/step": milliseconds(rec[N.STEP_TIME]),
             **({"mfu": f"{rec[N.MFU]:.1%}"} if N.MFU in rec else {}),
             "eta": duration((total_steps - step) * step_time)}
    # the loss is what is minimised; with loss terms it reads as task + penalty, for the task part
    # is what val/loss and a run without the terms compare with. Skipped steps are named.
    loss: float | str = rec[N.LOSS]
    if N.LOSS_PENALTY in rec:
        pen = rec[N.LOSS_PENALTY]
        loss = f"{loss:.4g} (task {loss - pen:.4g} + penalty {pen:.4g})"
    which = [s + 1 for s, skip in zip(steps, skipped) if skip]
    extra = {"skipped": f"{len(which)} non-finite step(s) (step {', '.join(map(str, which[:3]))}"
                        f"{', ...' if len(which) > 3 else ''})"} if which else {}
    # what the divergence watch sees: a spike is a divergence only once it lasts divergence.window steps
    w = watch
    if w.over and reason is None:
        since = spike_began(spikes, w.spike_start(step))
        extra["spike"] = (f"since step {since}, the loss above {w.factor:g}x its running "
                          f"mean {w.ema:.4g} ({w.over} of {w.window} steps to a divergence)")
    elif w.uncounted is not None and reason is None and w.uncounted[0] > step - len(steps):
        # the warmup's: no window yet, the ring alone holds back. Said in the interval of its step,
        # healthy or skipped steps after it or not; on no later line
        at, level = w.uncounted
        extra["spike"] = (f"at step {at}, above {w.factor:g}x the running mean {level:.4g}; not "
                          f"counted in the first divergence.warmup_steps={w.warmup} steps")
    elif passed:
        first, length = passed[-1]
        extra["spike"] = f"of step {first} passed after {length} step(s)"
    return {N.LOSS: loss, **extra, N.LR: rec[N.LR], **shown, **speed}


def end_line(summary: dict, *, alerts: list[dict], last_vals: dict, eval_step: int | None) -> str:
    """The status line a run ends with, from its ``summary`` (summary.json's): how and where it
    stopped, the steps skipped, the spikes passed, the rollbacks, the health ``alerts`` and the
    last evaluation ``last_vals`` (made at ``eval_step``)."""
    status, step, reason = summary["status"], summary["step"], summary["reason"]
    at = summary.get("diverged_at", step)
    # the losses are read once per logging interval (no host sync per step): the steps up to its
    # end ran, and their skips count
    where = f"at step {at}" + (f" (stopped at step {step}, where the logging interval that "
                               f"saw it ended)" if at != step else "")
    line = f"{status} {where}" + (f": {reason}" if reason else "")
    if summary.get("skipped_steps"):
        line += f" | {summary['skipped_steps']} non-finite step(s) skipped"
    spikes = [sp for sp in summary.get("spikes") or [] if not sp.get("open")]
    if spikes:  # their updates were applied: a final loss may carry them
        early = sum(1 for sp in spikes if sp.get("warmup"))
        line += (f" | {len(spikes)} loss spike(s) passed"
                 + (f" ({early} in the divergence warmup, not counted)" if early else "")
                 + f", the last at step {spikes[-1]['step']} ({spikes[-1]['steps']} step(s))")
    if summary.get("spikes") and summary["spikes"][-1].get("open"):  # so may the final loss, more so
        sp = summary["spikes"][-1]
        line += f" | a loss spike since step {sp['step']} ({sp['steps']} step(s)) had not passed"
    rollbacks = summary.get("rollbacks")
    if rollbacks:
        last, lr_scale = rollbacks[-1], summary.get("lr_scale", 1.0)
        scaled = f", lr x{lr_scale:.4g} from then on" if lr_scale != 1.0 else ""
        line += (f" | {len(rollbacks)} rollback(s), the last from step {last['trigger_step']} to "
                 f"{last['restored_step']}{scaled}")
    if alerts:  # a completed run may have collapsed on the way: said where it ends
        kept = [a for a in alerts if not a.get("rolled_back")]
        gone = len(alerts) - len(kept)
        line += f" | {len(alerts)} health alert(s)"
        if kept:
            line += f", the first at {kept[0].get('layer')} step {kept[0].get('step')}"
        if gone:
            line += f"{' and' if kept else ','} {gone} in the histories rollbacks abandoned"
    line += "".join(f" | {k} {v:.4g}" for k, v in last_vals.items())
    if last_vals and eval_step != step:
        line += f" (evaluated at step {eval_step})"
    return line
