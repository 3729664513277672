"""A run started by older code and resumed by this one (an upgrade in the middle of a run).

An "old" checkpoint is a new one with the state key added since deleted: the divergence
watch's ``spike_from``; an "old" run directory has ``train/skipped_steps``
interval records and no ``train/skipped_step`` records before its resume."""

from __future__ import annotations

import math

import numpy as np
import torch

from tests.helpers import losses, train

NEW_WATCH_KEYS = ("spike_from",)


def _as_written_by_old_code(run_dir):
    path = run_dir / "checkpoints" / "last.pt"
    ck = torch.load(path, map_location="cpu", weights_only=True)
    for key in NEW_WATCH_KEYS:
        del ck["divergence"][key]
    torch.save(ck, path)
    return ck


def _watch(**kw):
    from omegaconf import OmegaConf

    from stabletrain.config import DivergenceConfig
    from stabletrain.engine.divergence import DivergenceWatch

    return DivergenceWatch(OmegaConf.structured(DivergenceConfig(**kw)))


def test_an_old_state_saved_inside_a_spike_gets_the_spikes_first_step_back():
    """Saved at step 14 after a spike from step 10 (steps 10-12) and two skipped steps (13, 14):
    the spike began at step 10."""
    w = _watch(window=5, warmup_steps=5, spike_factor=2.0)
    for s in range(10):
        w.update(s, 1.0)
    for s in (10, 11, 12):
        w.update(s, 5.0)
    w.update(13, math.nan, skipped=True)
    w.update(14, math.nan, skipped=True)
    old = {k: v for k, v in w.state_dict().items() if k not in NEW_WATCH_KEYS}
    again = _watch(window=5, warmup_steps=5, spike_factor=2.0)
    again.load_state_dict(old, step=14)
    assert again.spike_from == w.spike_from == 10
    # a skipped step after the resume, then the spike goes on: it still began at step 10
    again.update(15, 5.0)
    again.update(16, math.nan, skipped=True)
    assert "from step 10 to step 17" in again.update(17, 5.0)


def test_an_old_state_outside_a_spike_and_a_new_state_load_as_they_were():
    w = _watch(window=5, warmup_steps=5, spike_factor=2.0)
    for s in range(12):
        w.update(s, 1.0)
    old = {k: v for k, v in w.state_dict().items() if k not in NEW_WATCH_KEYS}
    again = _watch()
    again.load_state_dict(old, step=12)
    assert (again.over, again.spike_from) == (0, None)
    w.spike_from = 3  # a new state's own value is kept, whatever the step
    again.load_state_dict(w.state_dict(), step=12)
    assert again.spike_from == 3


SPIKE = ["model=vit_test", "optim=sgd", "ckpt_every=2", "ckpt.keep=20", "eval_every=100", "logger.log_every=1",
         "divergence.warmup_steps=5", "divergence.window=8", "debug.spike_at_step=22"]


def test_an_old_last_pt_written_inside_a_spike_resumes_as_a_new_one(tmp_path):
    """last.pt at step 24, inside the spike of step 22; a non-finite step (26) is skipped after the
    resume. Resumed from the old checkpoint, the run names the same first step of the spike (22,
    not 23) and rolls back over the same data as from the new one."""
    summaries = {}
    for kind in ("new", "old"):
        run_dir = tmp_path / kind
        train(run_dir, *SPIKE, "steps=24")
        ck = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
        assert ck["step"] == 24 and ck["divergence"]["over"] > 0  # inside the spike
        if kind == "old":
            _as_written_by_old_code(run_dir)
        summaries[kind] = train(run_dir, *SPIKE, "steps=40", "debug.nan_at_step=26", "resume=auto",
                                "divergence.action=rollback")
    new, old = summaries["new"], summaries["old"]
    assert new["status"] == old["status"] == "completed"
    assert new["rollbacks"][0]["reason"] == old["rollbacks"][0]["reason"]
    assert "from step 22 to step 30" in old["rollbacks"][0]["reason"]
    assert losses(tmp_path / "old") == losses(tmp_path / "new")


def test_a_run_resumed_by_newer_code_marks_the_skipped_steps_recorded_before(tmp_path):
    """Steps 5 and 12 skipped before the resume (interval records at log steps 10 and 20 only),
    step 33 after it (its own record and its interval's): all three are marked, step 5's and 12's
    at the log step of their interval, the best the older records say."""
    from stabletrain.analysis import plots as P
    from stabletrain.monitor import names as N

    intervals = (np.array([10.0, 20.0, 30.0, 40.0]), np.array([1.0, 1.0, 0.0, 1.0]))
    own = (np.array([33.0]), np.array([1.0]))
    run = P.Run("r", tmp_path, {N.SKIPPED_STEPS: intervals, N.SKIPPED_STEP: own}, {"status": "completed"})
    assert run.skipped_at == [10.0, 20.0, 33.0]
