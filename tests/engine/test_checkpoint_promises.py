"""The promises of checkpoints, run directories and the step guard, each checked directly: atomic
writes, no non-finite state saved, exact resumes, the ring's size, the run directory's lock."""

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from stabletrain.errors import ConfigError
from tests.engine.test_loop import _run_until
from tests.helpers import GPT_LOGGED, QUIET, ROOT, losses, make_cfg, train

GPT = [*GPT_LOGGED, "precision=fp32"]


def _load(path):
    return torch.load(path, weights_only=True)


def _ring(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt"))


# --- atomic writes ------------------------------------------------------------------------


def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one_whole(tmp_path, monkeypatch):
    """A second Ctrl-C in the middle of torch.save leaves last.pt as it was and removes its temp
    file; a kill leaves the torn temp file, which the next run's start removes."""
    from stabletrain.engine import checkpoint as C

    path = tmp_path / "checkpoints" / "last.pt"
    C.save_checkpoint(path, {"step": 1, "w": torch.ones(64)})
    before = path.read_bytes()
    real_save = torch.save

    def killed(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        f.truncate(10)  # half of it reached the file ...
        raise KeyboardInterrupt  # ... when the process was killed

    monkeypatch.setattr(C.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        C.save_checkpoint(path, {"step": 2, "w": torch.zeros(64)})
    monkeypatch.undo()
    assert path.read_bytes() == before and _load(path)["step"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]
    (path.parent / ".last.pt.tmp999").write_bytes(b"torn")  # what a kill -9 mid-write leaves
    assert [p.name for p in C.remove_stale_temps(path.parent)] == [".last.pt.tmp999"]
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]


def test_the_temp_files_of_interrupted_writes_are_removed_and_nothing_else(tmp_path):
    """Stale temps of every kind of write (last.pt's, a ring copy's, a sharded save's directory)
    go; the checkpoints themselves stay."""
    from stabletrain.engine.checkpoint import remove_stale_temps

    d = tmp_path / "checkpoints"
    (d / "last_dcp").mkdir(parents=True)
    for name in ("last.pt", "step_000002.pt", "last_dcp/__0_0.distcp", ".last.pt.tmp123", ".step_000004.pt.tmp9"):
        (d / name).write_bytes(b"x")
    for name in (".last_dcp.tmp", ".step_000004_dcp.tmp"):
        (d / name).mkdir()
        (d / name / "__0_0.distcp").write_bytes(b"shards")
    gone = remove_stale_temps(d)
    assert sorted(p.name for p in gone) == [".last.pt.tmp123", ".last_dcp.tmp", ".step_000004.pt.tmp9",
                                            ".step_000004_dcp.tmp"]
    assert sorted(p.name for p in d.iterdir()) == ["last.pt", "last_dcp", "step_000002.pt"]


# --- never a non-finite checkpoint ------------------------------------------------------------


def test_all_finite_sees_a_single_non_finite_value_among_finite_tensors():
    """One NaN or inf anywhere (any tensor, any dtype, nested) makes the state non-finite; huge
    finite values (whose 2-norm would overflow) do not."""
    from stabletrain.engine.checkpoint import all_finite

    ok = {"a": torch.ones(3), "b": {"c": [torch.ones(2, dtype=torch.float64)]}, "i": torch.arange(3)}
    assert bool(all_finite(ok))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.ones(5)
        x[2] = bad
        assert not bool(all_finite(ok, {"state": {0: {"exp_avg": x}}})), bad
        assert not bool(all_finite({"x": x.to(torch.bfloat16)}, ok)), bad
    huge = torch.full((1000,), 3e38)  # each finite; its 2-norm is inf in fp32
    assert bool(all_finite({"w": huge}))


def test_non_finite_weights_or_optimizer_state_are_never_saved_over_a_good_checkpoint(tmp_path):
    """A save of a state with a NaN in one weight, or in the optimizer state alone, is refused:
    last.pt keeps the previous (finite) checkpoint byte for byte, and the run is marked diverged."""
    from stabletrain.build import build_trainer

    args = [*GPT, "optim=adamw", "steps=4"]
    train(tmp_path, *args, "steps=2")
    last = tmp_path / "checkpoints/last.pt"
    before = last.read_bytes()
    for poison in ("weight", "optimizer"):
        t = build_trainer(make_cfg(*QUIET, *args, "resume=auto"), tmp_path)
        assert t.maybe_resume() == 2
        if poison == "weight":
            p = next(iter(t.model.parameters()))
        else:
            p = next(q for q in t.model.parameters() if q in t.optimizer.state)
            p = t.optimizer.state[p]["exp_avg_sq"]
        with torch.no_grad():
            p.view(-1)[0] = float("nan")
        t.step = 3
        assert t.save() is False, poison
        assert last.read_bytes() == before, poison
        assert t.diverged_at == 3 and "non-finite weights or optimizer state at step 3" in t.nonfinite_reason


# --- exact resume -----------------------------------------------------------------------------


def test_the_rng_state_round_trips_every_global_generator():
    """torch's, Python's and NumPy's generators draw after a restore what they drew after the save
    (Python's and NumPy's Gaussian draws too, which come in pairs), also through a weights_only load."""
    import io

    from stabletrain.engine.checkpoint import rng_state, seed_all, set_rng_state

    seed_all(5)
    torch.rand(3), random.gauss(0, 1), np.random.standard_normal()  # each holds the second of a pair now
    buf = io.BytesIO()
    torch.save(rng_state(), buf)

    def draws():
        return (torch.rand(4).tolist(), [random.gauss(0, 1) for _ in range(3)] + [random.random()],
                np.random.standard_normal(3).tolist() + np.random.rand(1).tolist())

    want = draws()
    seed_all(123)
    draws()
    buf.seek(0)
    set_rng_state(torch.load(buf, weights_only=True))
    assert draws() == want


def test_resume_auto_continues_from_last_pt_when_it_is_newer_than_the_ring(tmp_path):
    """A signal at step 3 writes last.pt (the ring's newest is step 2): resume=auto continues from
    step 3, the latest checkpoint, and gives the uninterrupted run's losses."""
    from stabletrain.build import build_trainer

    args = [*GPT, "optim=adamw", "steps=6", "ckpt_every=2", "ckpt.keep=2"]
    train(tmp_path / "full", *args)
    _run_until(build_trainer(make_cfg(*QUIET, *args), tmp_path / "half"), 3)
    assert _load(tmp_path / "half/checkpoints/last.pt")["step"] == 3 and _ring(tmp_path / "half") == ["step_000002.pt"]
    t = build_trainer(make_cfg(*QUIET, *args, "resume=auto"), tmp_path / "half")
    assert t.ckpt.find("auto") == tmp_path / "half/checkpoints/last.pt"
    s = train(tmp_path / "half", *args, "resume=auto")
    assert s["status"] == "completed"
    assert losses(tmp_path / "half") == losses(tmp_path / "full")


def test_a_resumed_run_keeps_its_count_of_skipped_steps(tmp_path):
    """A non-finite step skipped before the interruption still counts in the resumed run's summary
    (and in its checkpoint), as in the uninterrupted run's."""
    from stabletrain.build import build_trainer

    args = [*GPT, "steps=6", "ckpt_every=2", "debug.nan_at_step=2"]
    full = train(tmp_path / "full", *args)
    assert full["skipped_steps"] == 1
    _run_until(build_trainer(make_cfg(*QUIET, *args), tmp_path / "half"), 4)
    s = train(tmp_path / "half", *args, "resume=auto")
    assert s["status"] == "completed" and s["skipped_steps"] == full["skipped_steps"] == 1
    assert _load(tmp_path / "half/checkpoints/last.pt")["survival"]["skipped_steps"] == 1
    assert losses(tmp_path / "half") == losses(tmp_path / "full")


def test_a_resume_from_an_earlier_checkpoint_rewrites_last_pt_before_the_first_step(tmp_path):
    """resume=<step_000004.pt> of a run at step 12: last.pt holds step 4 once the resume is done,
    so a kill before the next checkpoint resumes (resume=auto) step 4, not the abandoned step 12."""
    from stabletrain.build import build_trainer

    args = [*GPT, "optim=adamw", "steps=12", "ckpt_every=4"]
    train(tmp_path, *args)
    ck = tmp_path / "checkpoints"
    t = build_trainer(make_cfg(*QUIET, *args, f"resume={ck / 'step_000004.pt'}"), tmp_path)
    assert t.maybe_resume() == 4
    last = _load(ck / "last.pt")
    assert last["step"] == 4
    want = _load(ck / "step_000004.pt")["model"]
    assert all(torch.equal(last["model"][k], want[k]) for k in want)


# --- the ring ---------------------------------------------------------------------------------


def test_ckpt_keep_one_keeps_exactly_the_newest_ring_checkpoint(tmp_path):
    """ckpt.keep=1 (the smallest a rollback accepts): one ring checkpoint, the newest."""
    train(tmp_path, *GPT, "steps=6", "ckpt_every=2", "ckpt.keep=1")
    assert _ring(tmp_path) == ["step_000006.pt"]


# --- the step guard ---------------------------------------------------------------------------


@pytest.mark.parametrize("optim", [["optim=adamw", "optim.fused=false"], ["optim=sgd"]])
def test_a_non_finite_first_step_is_skipped_before_the_optimizer_has_state(tmp_path, optim):
    """NaN gradients at step 1, before the optimizer holds any state, on the copy path: the step
    is skipped (no NaN enters the moments), step 2 trains, and the run completes finite."""
    s = train(tmp_path, *GPT, *optim, "steps=2", "debug.nan_at_step=1")
    assert s["status"] == "completed" and s["skipped_steps"] == 1
    state = _load(tmp_path / "checkpoints/last.pt")
    from stabletrain.engine.checkpoint import all_finite

    assert state["step"] == 2 and bool(all_finite(state["model"], state["optimizer"]["state"]))
    steps = {float(st["step"]) for st in state["optimizer"]["state"].values() if "step" in st}
    assert steps <= {1.0}  # AdamW stepped once: step 1 changed nothing


def test_a_skipped_step_leaves_a_weight_average_that_cannot_skip_by_itself_exact():
    """A bf16 average cannot take found_inf (WeightEma.skips_exactly is false): under an optimizer
    that skips natively the guard copies it and writes it back, so a non-finite step leaves the
    average and the weights bit-exact."""
    from stabletrain.engine.ema import WeightEma
    from stabletrain.engine.guard import StepGuard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    ema = WeightEma(model, 0.9)
    guard = StepGuard(model, opt, ema)
    assert guard.found_inf and not ema.skips_exactly

    def step(scale):
        guard.begin()
        (model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum() * scale).backward()
        finite = torch.stack([p.grad.float().norm() for p in model.parameters()]).sum().isfinite()
        guard.step(finite, lambda: (opt.step(), ema.after_step(model, 0)))
        opt.zero_grad()

    step(1.0)
    average = {k: v.clone() for k, v in ema.module.state_dict().items()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    step(float("nan"))
    assert all(torch.equal(average[k], v) for k, v in ema.module.state_dict().items())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


# --- the run directory's lock -----------------------------------------------------------------


def test_checking_the_lock_leaves_it_free(tmp_path):
    """check_free (the command line's check before Hydra writes) takes nothing: the run may then
    acquire the lock in the same process, and after a release another run may."""
    from stabletrain.engine.rundir import RunDirLock

    RunDirLock(tmp_path).acquire().release()
    RunDirLock(tmp_path).check_free()
    lock = RunDirLock(tmp_path).acquire()
    lock.release()
    RunDirLock(tmp_path).acquire().release()


def test_a_claimed_lock_is_taken_over_by_the_run_in_the_same_process(tmp_path):
    """claim (train.py's, before Hydra writes .hydra/) holds the lock against another process's
    acquire, and this process's acquire takes that same lock over instead of refusing itself."""
    from stabletrain.engine.rundir import RunDirLock

    RunDirLock(tmp_path).claim()
    code = "import sys; from stabletrain.engine.rundir import RunDirLock; RunDirLock(sys.argv[1]).acquire()"
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert other.returncode == 1 and f"in use by another run (pid {os.getpid()} holds" in other.stderr
    lock = RunDirLock(tmp_path).acquire()
    lock.release()
    held = RunDirLock(tmp_path).acquire()  # released and taken by a run: a claim now is another run's
    try:
        with pytest.raises(ConfigError, match="in use"):
            RunDirLock(tmp_path).claim()
    finally:
        held.release()
    RunDirLock(tmp_path).acquire().release()


def test_the_lock_names_its_holder_alone_after_a_stale_pid(tmp_path):
    """A killed run leaves its pid in .lock (the kernel drops the lock, not the file): the next
    holder's file names it alone, not its pid followed by the rest of the longer stale one."""
    from stabletrain.engine.rundir import RunDirLock

    (tmp_path / ".lock").write_text("9999999999999\n")
    lock = RunDirLock(tmp_path).acquire()
    try:
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()


# --- the divergence record --------------------------------------------------------------------


def test_a_divergence_after_a_rollback_records_its_own_step(tmp_path):
    """A NaN loss at step 6 is rolled back (max_rollbacks=1); later a refused save (Adam's moments
    overflow under a finite loss) ends the run: summary.json names that save's step, not the
    step 6 of the divergence the rollback already survived."""
    s = train(tmp_path, *GPT, "optim=adamw", "steps=16", "ckpt_every=4", "divergence.skip_nonfinite=false",
              "divergence.action=rollback", "divergence.max_rollbacks=1", "debug.nan_at_step=6",
              "debug.spike_at_step=9", "debug.spike_factor=3e37")
    assert [r["trigger_step"] for r in s["rollbacks"]] == [6]
    assert s["status"] == "diverged" and "non-finite weights or optimizer state at step 8" in s["reason"]
    assert s["diverged_at"] == s["step"] == 8, s


def test_a_second_rollback_to_the_same_checkpoint_skips_the_data_the_first_skipped(tmp_path):
    """ckpt.keep=1: two troubles before the next ring step both restore step 4. The first
    rollback writes its data offset into the ring's step 4 too, so the second goes on past both
    bad batches (offset 2 + 3), never back to data the first rollback skipped."""
    from stabletrain.build import build_trainer

    t = build_trainer(make_cfg(*QUIET, *GPT, "divergence.action=rollback", "divergence.max_skips=1", "ckpt_every=4",
                               "ckpt.keep=1", "steps=10", "debug.nan_at_step=6"), tmp_path)
    orig = t.train_step

    def step(*a, **k):
        if len(t.rollbacks) == 1:
            t.settings.nan_at_step = 9  # the batch of step 7 after the first rollback
        return orig(*a, **k)

    t.train_step = step
    s = t.fit()
    assert s["status"] == "completed"
    assert [(r["trigger_step"], r["restored_step"], r["skipped_steps"]) for r in s["rollbacks"]] == [(6, 4, 2),
                                                                                                     (7, 4, 3)]
    assert _load(tmp_path / "checkpoints/last.pt")["survival"]["data_offset"] == 5
