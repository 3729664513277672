"""Learning-rate schedules as pure functions of the optimizer step (no scheduler state).

Resuming needs no scheduler state dict: the trainer recomputes ``lr(step)`` from the step it
restored and calls :func:`set_lr` every step. Conventions (ours, docs/methods.md §8.2/8.3):

- Steps count optimizer steps from 0. ``warmup = W > 0``: step ``s < W`` runs at
  ``base_lr * (s + 1) / W``, so step ``W - 1`` already reaches ``base_lr``; ``W = 0`` gives
  ``base_lr`` at step 0 (the AdamW² recipes).
- cosine: from ``base_lr`` at step ``W`` to ``min_lr`` at step ``horizon`` (the run's total steps
  unless ``schedule.horizon`` says otherwise, e.g. GPT-L's 600K horizon stopped at 100K),
  ``min_lr + (base_lr - min_lr) * (1 + cos(pi * (s - W) / (horizon - W))) / 2``, and ``min_lr``
  after the horizon.
- step: ``base_lr * gamma ** k`` with ``k`` the number of milestones ``<= s`` (milestones are
  absolute steps from the start of the run, warmup included).
- constant: ``base_lr``.

Warmup, milestones and horizon are given in ``schedule.unit``; :func:`to_steps` converts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch.optim import Optimizer

from stabletrain.errors import ConfigError
from stabletrain.registry import Registry, option_value

# name -> ``(schedule, step) -> lr`` for steps after the warmup
SCHEDULES = Registry("schedule", __name__, declares=("keys",), call="(schedule, step)")


def to_steps(value: float, unit: Any, steps_per_epoch: int | None = None) -> int:
    """A length in ``unit`` (``steps`` or ``epochs``) as a whole number of optimizer steps."""
    unit = option_value(unit)
    if unit == "steps":
        return round(value)
    if unit == "epochs":
        if not steps_per_epoch:
            raise ValueError("to_steps: a length in epochs needs steps_per_epoch")
        return round(value * steps_per_epoch)
    raise ValueError(f"schedule.unit={unit!r}: use steps or epochs")


@dataclass(frozen=True)
class LRSchedule:
    """``lr(step) -> float``; all lengths in optimizer steps (see the module docstring)."""

    name: str
    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr: float = 0.0
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    horizon_steps: int | None = None
    kwargs: dict = field(default_factory=dict)  # schedule.kwargs: for a schedule of the user's own

    def __post_init__(self):
        object.__setattr__(self, "_after_warmup", SCHEDULES.get(self.name))
        if self.warmup_steps < 0:
            raise ValueError(f"warmup={self.warmup_steps} steps must be >= 0")

    def warnings(self) -> list[str]:
        """What this schedule will not do in a run of ``total_steps``: a warmup that never ends,
        milestones the run never reaches. Warned, not refused: a shortened recipe is a common test."""
        out = []
        if self.warmup_steps >= self.total_steps:
            when = "never reaches" if self.warmup_steps > self.total_steps else "reaches only at the last step"
            out.append(f"warning: the warmup ({self.warmup_steps} steps) is as long as the run ({self.total_steps} "
                       f"steps) or longer: the learning rate {when} its peak; shorten warmup or train longer")
        h = self.horizon_steps
        if self.name == "cosine" and h is not None and h < self.total_steps and self.min_lr == 0:
            # a run lengthened past its horizon (resume=auto steps=...) trains on at lr 0: steps that change nothing
            out.append(f"warning: the cosine reaches lr 0 at step {h} (schedule.horizon) and stays there: the "
                       f"run's last {self.total_steps - h} of {self.total_steps} steps train at lr 0, leaving the "
                       f"weights as they are; raise schedule.horizon, set schedule.min_lr, or stop at steps={h}")
        if self.name == "step" and not self.milestones:
            out.append("note: schedule=step without schedule.milestones keeps the lr constant; set them, e.g. "
                       f"schedule.milestones=[{self.total_steps // 2},{3 * self.total_steps // 4}] with "
                       "schedule.unit=steps")
        late = [m for m in self.milestones if m >= self.total_steps]
        if self.name == "step" and late:
            out.append(f"warning: schedule.milestones at step(s) {', '.join(map(str, late))} are past the run's "
                       f"{self.total_steps} steps: the learning rate never decays there; check schedule.unit and "
                       f"the milestones")
        return out

    def describe(self) -> str:
        """The schedule in steps, as the start lines give it: ``schedule: warmup 30 steps to lr
        0.001, then cosine to 0 at step 600`` (warmup and milestones may have been given in epochs)."""
        lr = f"{self.base_lr:.4g}"
        head = "schedule: " + (f"warmup {self.warmup_steps} steps to lr {lr}, then " if self.warmup_steps
                               else f"lr {lr}, ")
        if self.name == "cosine":
            horizon = self.horizon_steps if self.horizon_steps is not None else self.total_steps
            past = f" (the run stops at step {self.total_steps})" if horizon != self.total_steps else ""
            return head + f"cosine to {self.min_lr:.4g} at step {horizon}{past}"
        if self.name == "step" and self.milestones:
            return head + (f"x{self.gamma:g} at step(s) {', '.join(map(str, self.milestones))}")
        if self.name in ("constant", "step"):
            return head + "constant"
        own = f" ({', '.join(f'{k}={v}' for k, v in self.kwargs.items())})" if self.kwargs else ""
        return head + f"schedule={self.name}{own}"

    def __call__(self, step: int) -> float:
        w = self.warmup_steps
        if step < w:
            return self.base_lr * (step + 1) / w
        return self._after_warmup(self, step)


@SCHEDULES.register("constant")
def constant(s: LRSchedule, step: int) -> float:
    return s.base_lr


@SCHEDULES.register("step")
def step_decay(s: LRSchedule, step: int) -> float:
    passed = sum(1 for m in s.milestones if step >= m)
    return s.base_lr * s.gamma**passed


@SCHEDULES.register("cosine")
def cosine(s: LRSchedule, step: int) -> float:
    horizon = s.horizon_steps if s.horizon_steps is not None else s.total_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, horizon - s.warmup_steps))
    return s.min_lr + (s.base_lr - s.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_schedule(
    schedule_cfg: Any,
    base_lr: float,
    total_steps: int,
    *,
    warmup: float = 0.0,
    steps_per_epoch: int | None = None,
) -> LRSchedule:
    """The schedule of ``schedule_cfg`` (config.ScheduleConfig) for a run of ``total_steps``.

    ``warmup`` is the trainer's ``warmup`` key and, like ``milestones`` and ``horizon``, is in
    ``schedule_cfg.unit``. ``base_lr`` is the peak rate after any batch scaling
    (:func:`stabletrain.optim.scaled_lr`); ``min_lr`` is absolute.
    """
    unit = schedule_cfg.unit
    horizon = schedule_cfg.horizon

    def steps(key: str, value: float) -> int:
        # a length is in schedule.unit, not a fraction of the run: warmup=0.1 was 0 steps, silently
        n = to_steps(value, unit, steps_per_epoch)
        if value > 0 and n == 0:
            tenth = max(1, round(total_steps / 10))
            per = f" at {steps_per_epoch} steps per epoch" if option_value(unit) == "epochs" else ""
            example = f"[{tenth}]" if key == "schedule.milestones" else tenth
            raise ConfigError(f"{key}={value:g} is 0 steps{per}: it is a length in schedule.unit={option_value(unit)}, "
                              f"not a fraction of the run; e.g. {key}={example} with schedule.unit=steps for a tenth "
                              f"of this run's {total_steps} steps")
        return n

    return LRSchedule(
        name=option_value(schedule_cfg.name),
        base_lr=float(base_lr),
        total_steps=int(total_steps),
        warmup_steps=steps("warmup", warmup),
        min_lr=float(schedule_cfg.min_lr),
        milestones=tuple(sorted(steps("schedule.milestones", m) for m in schedule_cfg.milestones)),
        gamma=float(schedule_cfg.gamma),
        horizon_steps=None if horizon is None else steps("schedule.horizon", horizon),
        kwargs=dict(getattr(schedule_cfg, "kwargs", None) or {}),
    )


def set_lr(optimizer: Optimizer, lr: float) -> None:
    """Give every param group ``lr * group['lr_mult']`` (``lr_mult`` 1 where absent)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def weight_decay_at(start: float, end: float | None, step: int, total_steps: int) -> float:
    """Weight decay at ``step``: constant ``start`` when ``end`` is None, else a half cosine
    from ``start`` to ``end`` over the run (001: a cosine schedule 0 -> 1e-5 eases
    sigmaReparam's ViT-L/H)."""
    if end is None:
        return start
    progress = min(1.0, step / max(1, total_steps))
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_weight_decay(optimizer: Optimizer, wd: float) -> None:
    """Give every decayed group ``wd`` (``wd_mult`` is 1 there, 0 on no-decay groups)."""
    for group in optimizer.param_groups:
        group["weight_decay"] = wd * group.get("wd_mult", 1.0)


@dataclass(frozen=True)
class OptimizerSchedule:
    """What the trainer calls at every step: sets each group's rate (and the scheduled weight
    decay, when ``wd_end`` is set) for ``step`` and returns the rate."""

    lr_at: LRSchedule
    wd_start: float = 0.0
    wd_end: float | None = None

    def describe_weight_decay(self) -> str | None:
        """The start line of a scheduled weight decay (the groups' line shows its first value)."""
        if self.wd_end is None:
            return None
        return (f"weight decay: {self.wd_start:g} at step 0, a half cosine to {self.wd_end:g} at step "
                f"{self.lr_at.total_steps} (optim.weight_decay_end), in the groups that decay")

    def __call__(self, optimizer: Optimizer, step: int, scale: float = 1.0) -> float:
        """``scale``: a factor on the scheduled rate (a rollback's ``lr_scale_on_rollback``)."""
        lr = self.lr_at(step) * scale
        set_lr(optimizer, lr)
        if self.wd_end is not None:
            set_weight_decay(optimizer, weight_decay_at(self.wd_start, self.wd_end, step, self.lr_at.total_steps))
        return lr
