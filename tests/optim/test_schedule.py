import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from stabletrain.config import ScheduleConfig
from stabletrain.optim import LRSchedule, make_schedule, set_lr, to_steps


def test_cosine_start_middle_end():
    lr = LRSchedule("cosine", base_lr=1e-3, total_steps=100, min_lr=1e-5)
    assert lr(0) == pytest.approx(1e-3)
    assert lr(50) == pytest.approx(1e-5 + (1e-3 - 1e-5) / 2)
    assert lr(25) == pytest.approx(1e-5 + (1e-3 - 1e-5) * (1 + math.cos(math.pi / 4)) / 2)
    assert lr(100) == pytest.approx(1e-5)
    assert lr(150) == pytest.approx(1e-5)


def test_cosine_after_warmup_and_own_horizon():
    lr = LRSchedule("cosine", base_lr=1.0, total_steps=100, warmup_steps=10, horizon_steps=210)
    assert lr(10) == pytest.approx(1.0)
    assert lr(110) == pytest.approx(0.5)  # halfway between the warmup's end and the horizon
    assert lr(99) > 0.5  # the run stops before the horizon


def test_warmup_ramp():
    lr = LRSchedule("cosine", base_lr=2.0, total_steps=100, warmup_steps=4)
    assert [lr(s) for s in range(4)] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert lr(4) == pytest.approx(2.0)


@pytest.mark.parametrize("name", ["cosine", "step", "constant"])
def test_no_warmup_starts_at_peak(name):
    assert LRSchedule(name, base_lr=0.3, total_steps=10, milestones=(5,))(0) == pytest.approx(0.3)


def test_step_at_milestones():
    lr = LRSchedule("step", base_lr=0.1, total_steps=300, milestones=(100, 200), gamma=0.5)
    assert lr(99) == pytest.approx(0.1)
    assert lr(100) == pytest.approx(0.05)
    assert lr(199) == pytest.approx(0.05)
    assert lr(200) == pytest.approx(0.025)


def test_warnings_name_what_the_run_never_reaches():
    """The last step is total_steps - 1: a milestone at total_steps never applies."""
    lr = LRSchedule("step", base_lr=0.1, total_steps=300, milestones=(100, 300, 400))
    assert lr(299) == pytest.approx(0.01)  # only the first milestone was passed
    (w,) = lr.warnings()
    assert "milestones at step(s) 300, 400 are past the run's 300 steps" in w
    assert LRSchedule("step", base_lr=0.1, total_steps=301, milestones=(100, 300)).warnings() == []
    assert "never reaches its peak" in LRSchedule("cosine", base_lr=1.0, total_steps=10, warmup_steps=11).warnings()[0]
    equal = LRSchedule("cosine", base_lr=1.0, total_steps=10, warmup_steps=10)
    assert equal(9) == 1.0 and "reaches only at the last step its peak" in equal.warnings()[0]
    assert LRSchedule("cosine", base_lr=1.0, total_steps=10, warmup_steps=9).warnings() == []


def test_a_cosine_whose_horizon_ends_before_the_run_at_lr_0_is_warned():
    """A run lengthened past its cosine's own horizon (resume=auto steps=...) trained its extra
    steps at lr 0 without a word; a floor above 0, or a horizon past the run, is a recipe's choice."""
    lr = LRSchedule("cosine", base_lr=1.0, total_steps=80, horizon_steps=40)
    assert lr(40) == lr(79) == 0.0
    (w,) = lr.warnings()
    assert w.startswith("warning: the cosine reaches lr 0 at step 40 (schedule.horizon) and stays there: the run's "
                        "last 40 of 80 steps train at lr 0") and w.endswith("or stop at steps=40"), w
    assert LRSchedule("cosine", base_lr=1.0, total_steps=80, horizon_steps=40, min_lr=0.1).warnings() == []
    assert LRSchedule("cosine", base_lr=1.0, total_steps=80, horizon_steps=600).warnings() == []


def test_the_lr_0_warning_counts_the_steps_the_run_trains_at_lr_0():
    """A horizon at the run's end trains no step at lr 0 (step ``steps`` is never trained): no
    warning; one step short, the last step is at lr 0 and is warned; a step or constant schedule
    does not read schedule.horizon, so a horizon there warns of nothing."""
    assert LRSchedule("cosine", base_lr=1.0, total_steps=40, horizon_steps=40).warnings() == []
    (w,) = LRSchedule("cosine", base_lr=1.0, total_steps=40, horizon_steps=39).warnings()
    assert "the run's last 1 of 40 steps train at lr 0" in w
    for name in ("step", "constant"):
        assert LRSchedule(name, base_lr=1.0, total_steps=40, horizon_steps=20, milestones=(10,)).warnings() == []


def test_constant_with_warmup():
    lr = LRSchedule("constant", base_lr=1.0, total_steps=50, warmup_steps=2)
    assert [lr(0), lr(1), lr(2), lr(49)] == pytest.approx([0.5, 1.0, 1.0, 1.0])


def test_from_config_in_epochs():
    cfg = OmegaConf.structured(ScheduleConfig(name="step", unit="epochs", milestones=[210], gamma=0.1))
    lr = make_schedule(cfg, base_lr=0.1, total_steps=250 * 10, warmup=1.5, steps_per_epoch=10)
    assert lr.warmup_steps == 15 and lr.milestones == (2100,)
    assert lr(14) == pytest.approx(0.1)
    assert lr(2099) == pytest.approx(0.1) and lr(2100) == pytest.approx(0.01)
    assert to_steps(3, "steps") == 3
    with pytest.raises(ValueError):
        to_steps(1.0, "epochs")
    # said in steps, though given in epochs
    assert lr.describe() == "schedule: warmup 15 steps to lr 0.1, then x0.1 at step(s) 2100"


@pytest.mark.parametrize("key,kw,unit,spe,says", [
    ("warmup", dict(warmup=0.1), "steps", None,
     "warmup=0.1 is 0 steps: it is a length in schedule.unit=steps, not a fraction of the run; e.g. warmup=60 with "
     "schedule.unit=steps for a tenth of this run's 600 steps"),
    ("warmup", dict(warmup=0.01), "epochs", 20, "warmup=0.01 is 0 steps at 20 steps per epoch: it is a length in "
                                                "schedule.unit=epochs"),
    ("schedule.milestones", dict(milestones=[0.2]), "steps", None,
     "schedule.milestones=0.2 is 0 steps: it is a length in schedule.unit=steps, not a fraction of the run; e.g. "
     "schedule.milestones=[60] with schedule.unit=steps"),
    ("schedule.horizon", dict(name="cosine", horizon=0.3), "steps", None, "schedule.horizon=0.3 is 0 steps"),
])
def test_a_length_that_rounds_to_no_step_is_refused(key, kw, unit, spe, says):
    """warmup=0.1 (a fraction, as warmup_ratio is elsewhere) was silently 0 steps; milestones=[0.2]
    decayed the lr from step 0; horizon=0.3 ended the cosine at step 0."""
    from stabletrain.errors import ConfigError

    warmup = kw.pop("warmup", 0.0)
    cfg = OmegaConf.structured(ScheduleConfig(**{"name": "step", "unit": unit, **kw}))
    with pytest.raises(ConfigError, match="^" + re.escape(says)):
        make_schedule(cfg, base_lr=0.1, total_steps=600, warmup=warmup, steps_per_epoch=spe)


def test_a_step_schedule_without_milestones_says_it_is_constant_and_milestones_are_sorted():
    cfg = OmegaConf.structured(ScheduleConfig(name="step", milestones=[]))
    assert make_schedule(cfg, base_lr=0.1, total_steps=400).warnings() == [
        "note: schedule=step without schedule.milestones keeps the lr constant; set them, e.g. "
        "schedule.milestones=[200,300] with schedule.unit=steps"]
    lr = make_schedule(OmegaConf.structured(ScheduleConfig(name="step", milestones=[300, 100])), 0.1, 400)
    assert lr.describe() == "schedule: lr 0.1, x0.1 at step(s) 100, 300" and lr(150) == pytest.approx(0.01)


def test_describe_says_each_schedule_in_steps():
    cos = LRSchedule("cosine", base_lr=6e-4, total_steps=100_000, warmup_steps=2000, min_lr=6e-5,
                     horizon_steps=600_000)
    assert cos.describe() == ("schedule: warmup 2000 steps to lr 0.0006, then cosine to 6e-05 at step 600000 "
                              "(the run stops at step 100000)")
    assert LRSchedule("cosine", 1e-3, 600).describe() == "schedule: lr 0.001, cosine to 0 at step 600"
    assert LRSchedule("constant", 1.0, 50, warmup_steps=2).describe() == (
        "schedule: warmup 2 steps to lr 1, then constant")


def test_set_lr_applies_group_multiplier():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr_mult": 2.0}], lr=1.0)
    set_lr(opt, 0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.5]
