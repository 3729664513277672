"""Fault injection on the run directory's files: each fault as a crash or a full disk leaves it,
then what the next run or resume must make of it."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stabletrain.errors import ConfigError
from tests.helpers import GPT_LOGGED, QUIET, ROOT, train



def _steps(run_dir) -> list[int]:
    from stabletrain.metrics import read_records

    return [r["step"] for r in read_records(run_dir / "metrics.jsonl") if "loss" in r]


def test_summary_is_written_atomically(tmp_path, monkeypatch):
    """A kill mid-write leaves the previous summary.json whole (a temp file is what is torn)."""
    from stabletrain import metrics

    path = tmp_path / "summary.json"
    metrics.write_json(path, {"status": "interrupted"})

    def torn_replace(src, dst):
        raise KeyboardInterrupt  # killed after the temp file was written, before the rename

    monkeypatch.setattr(metrics.os, "replace", torn_replace)
    with pytest.raises(KeyboardInterrupt):
        metrics.write_json(path, {"status": "completed"})
    assert json.loads(path.read_text()) == {"status": "interrupted"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_checkpoint_is_synced_before_and_after_its_rename(tmp_path, monkeypatch):
    """The file's bytes reach the disk before the rename, and the rename itself (the directory's
    entry) after it: otherwise a power loss can leave last.pt empty or the old one."""
    import stat

    from stabletrain.engine import checkpoint as C

    synced = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(C.os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)),
                                                   real_fsync(fd))[1])
    monkeypatch.setattr(C.os, "replace", lambda a, b: (synced.append("rename"), real_replace(a, b))[1])
    C.save_checkpoint(tmp_path / "last.pt", {"step": 3})
    assert synced == [False, "rename", True]  # the file, the rename, the directory
    assert torch.load(tmp_path / "last.pt", weights_only=True) == {"step": 3}


def test_a_torn_summary_is_no_completed_run(tmp_path):
    train(tmp_path, *GPT_LOGGED, "steps=2")
    (tmp_path / "summary.json").write_text('{"status": "compl')  # torn by a kill (pre-atomic writes)
    s = train(tmp_path, *GPT_LOGGED, "steps=2", "resume=auto")
    assert s["status"] == "completed" and json.loads((tmp_path / "summary.json").read_text())["step"] == 2


@pytest.mark.parametrize("tail", [b'{"step": 4, "loss": 1.2', b'{"step": 4, "loss": \xff\xfe}\n', b"\x00\x00\x00"])
def test_a_torn_or_non_utf8_metrics_line_is_dropped_on_resume(tmp_path, tail):
    from stabletrain.build import build_trainer
    from tests.engine.test_loop import _run_until
    from tests.helpers import make_cfg

    _run_until(build_trainer(make_cfg(*QUIET, *GPT_LOGGED, "steps=4", "ckpt_every=2"), tmp_path), 2)
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(tail)
    s = train(tmp_path, *GPT_LOGGED, "steps=4", "resume=auto")
    assert s["status"] == "completed"
    assert _steps(tmp_path) == [1, 2, 3, 4]
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line)


def test_metrics_history_is_kept_when_the_checkpoint_is_unreadable(tmp_path):
    train(tmp_path, *GPT_LOGGED, "steps=4", "ckpt_every=2")
    before = (tmp_path / "metrics.jsonl").read_bytes()
    ck = tmp_path / "checkpoints/last.pt"
    ck.write_bytes(ck.read_bytes()[:1000])  # a corrupt checkpoint
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        train(tmp_path, *GPT_LOGGED, "steps=4", "resume=auto")
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert (tmp_path / "config.yaml").is_file()


def test_an_unreadable_last_checkpoint_names_the_ring_checkpoint_to_resume(tmp_path):
    """A torn last.pt under resume=auto: the advice was 'pass a last.pt written by a run, or
    resume=auto', which is what failed; the ring's newest checkpoint is named instead."""
    train(tmp_path, *GPT_LOGGED, "steps=6", "ckpt_every=2", "ckpt.keep=2")
    ck = tmp_path / "checkpoints"
    (ck / "last.pt").write_bytes((ck / "last.pt").read_bytes()[:1000])
    with pytest.raises(ConfigError, match=rf"; resume={ck / 'step_000006.pt'} \(the newest ring checkpoint beside "
                                          r"it\)$"):
        train(tmp_path, *GPT_LOGGED, "steps=6", "resume=auto")
    (ck / "step_000006.pt").write_bytes(b"torn")
    with pytest.raises(ConfigError, match=rf"; resume={ck / 'step_000004.pt'} \(the newest ring"):
        train(tmp_path, *GPT_LOGGED, "steps=6", f"resume={ck / 'step_000006.pt'}")


def test_stale_checkpoint_temp_files_are_removed_on_start(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir(parents=True)
    stale = tmp_path / "checkpoints/.last.pt.tmp99999"
    stale.write_bytes(b"half a checkpoint")
    half_sharded = tmp_path / "checkpoints/.last_dcp.tmp"  # a sharded save cut short: a directory
    half_sharded.mkdir()
    (half_sharded / "__0_0.distcp").write_bytes(b"shards")
    train(tmp_path, *GPT_LOGGED, "steps=1")
    assert not stale.exists() and "removed .last.pt.tmp99999" in capsys.readouterr().err
    assert not half_sharded.exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.pt", "step_000001.pt"]


def test_the_ring_keeps_a_sharded_checkpoints_directory_by_hard_links(tmp_path):
    """A ring entry of a sharded run is step_N.pt with step_N_dcp/: links to last_dcp/'s files,
    which survive the next save replacing last_dcp/; dropped entries take their directory along."""
    from stabletrain.engine.checkpoint import dcp_dir, drop_ring_after, ring_checkpoints, save_to_ring

    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (ckpts / "last_dcp").mkdir(parents=True)
        (ckpts / "last_dcp" / "__0_0.distcp").write_text(f"shards of {step}")
        (ckpts / "last.pt").write_text(f"rest of {step}")
        save_to_ring(tmp_path, step, keep=2, sharded=True)
        shutil.rmtree(ckpts / "last_dcp")  # the next save's swap removes the previous directory
    assert [s for s, _ in ring_checkpoints(tmp_path)] == [4, 6]
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.pt", "step_000004.pt", "step_000004_dcp",
                                                         "step_000006.pt", "step_000006_dcp"]
    assert (dcp_dir(ckpts / "step_000004.pt") / "__0_0.distcp").read_text() == "shards of 4"
    drop_ring_after(tmp_path, 4)
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.pt", "step_000004.pt", "step_000004_dcp"]


def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from stabletrain.engine import checkpoint
    from stabletrain.engine.checkpoint import CheckpointWriteError

    train(tmp_path, *GPT_LOGGED, "steps=2")
    before = torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)["step"]
    real_save = torch.save

    def full(obj, f, *a, **k):
        real_save(obj, f, *a, **k)  # part of it was written ...
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointWriteError) as e:
        train(tmp_path, *GPT_LOGGED, "steps=4", "resume=auto")
    msg = str(e.value)
    assert "\n" not in msg and "disk is full" in msg and "still holds the previous checkpoint" in msg
    monkeypatch.undo()
    assert torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)["step"] == before
    # no temp file left; the ring holds the checkpoints written before the disk filled
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.pt", f"step_{before:06d}.pt"]


def test_a_full_disk_exits_with_one_line(tmp_path, monkeypatch, capsys):
    from stabletrain.engine import checkpoint
    from stabletrain.run import main_guarded
    from tests.helpers import make_cfg

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(SystemExit) as e:
        main_guarded(make_cfg(*QUIET, *GPT_LOGGED, "steps=1"), tmp_path)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: cannot write last.pt: the disk is full; no checkpoint was kept; free space and run it "
                       "again (no checkpoint was written)") and "Traceback" not in "".join(err)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_full_disk_under_metrics_jsonl_is_one_line_naming_what_goes_on(tmp_path, monkeypatch, capsys, checkpointed):
    """metrics.jsonl is written at every log step, so a disk filled by another job meets it
    before a checkpoint: that ended in a traceback, where a checkpoint's write says one line."""
    from stabletrain import metrics
    from stabletrain.run import main_guarded
    from tests.helpers import make_cfg

    real = metrics.Metrics.log

    def full(self, step, values):
        if step >= 3 and "loss" in values:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, step, values)

    monkeypatch.setattr(metrics.Metrics, "log", full)
    args = [*GPT_LOGGED, "steps=6", "logger.wandb=disabled", "monitor=off", f"ckpt_every={2 if checkpointed else 100}"]
    with pytest.raises(SystemExit) as e:
        main_guarded(make_cfg(*args), tmp_path)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "".join(err)
    then = ("free space, then continue it with: " if checkpointed else
            "free space and run it again (no checkpoint was written)")
    assert err[-1].startswith(f"error: cannot write into {tmp_path}: the disk is full; {then}"), err[-1]


def test_a_used_up_quota_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """EDQUOT is a full disk of one's own quota: the same one line, which says so and names the
    file that could not be written; another OSError (a permission) is not taken for a full disk."""
    from stabletrain import run as R

    where = str(tmp_path / "metrics.jsonl")

    def quota(cfg, run_dir):
        raise OSError(errno.EDQUOT, "Disk quota exceeded", where)

    monkeypatch.setattr(R, "run", quota)
    with pytest.raises(SystemExit) as e:
        R.main_guarded(SimpleNamespace(), tmp_path)
    assert e.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"error: cannot write into {tmp_path}: the disk quota is used up ({where}); free space and run "
                    f"it again (no checkpoint was written)"), last

    # a run directory made read-only mid-run: summary.json could not be written, which was a traceback
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints/last.pt").write_bytes(b"")
    monkeypatch.setattr(R, "task_overrides", lambda: ["model=gpt_test"])
    for err, what, then in ((errno.EACCES, "permission denied", "make it writable, then continue it with: "),
                            (errno.EROFS, "the file system is read-only", "copy it to a writable disk, then continue "
                                                                          "it there with: ")):
        def denied(cfg, run_dir, err=err):
            raise OSError(err, "refused", str(tmp_path / ".summary.json.tmp1"))

        monkeypatch.setattr(R, "run", denied)
        with pytest.raises(SystemExit) as e:
            R.main_guarded(SimpleNamespace(), tmp_path)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        where = "NEW_PLACE" if err == errno.EROFS else tmp_path  # not back into the read-only disk
        assert e.value.code == 1 and last.startswith(
            f"error: cannot write into {tmp_path}: {what} ({tmp_path}/.summary.json.tmp1); {then}") and \
            last.endswith(f"train.py model=gpt_test resume=auto hydra.run.dir={where}"), last

    def elsewhere(cfg, run_dir):  # not the run's own file: not said to be
        raise PermissionError(errno.EACCES, "Permission denied", "/etc/shadow")

    monkeypatch.setattr(R, "run", elsewhere)
    with pytest.raises(PermissionError):
        R.main_guarded(SimpleNamespace(), Path(tmp_path))


def test_a_full_disk_while_copying_into_the_ring_is_one_line(tmp_path, monkeypatch, capsys):
    """Where hard links are impossible the ring gets a copy, which a full disk can stop: the
    same one line as for last.pt, and last.pt (the step itself) is kept."""
    import shutil

    from stabletrain.engine import checkpoint
    from stabletrain.run import main_guarded
    from tests.helpers import make_cfg

    def no_link(*a, **k):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    def full(src, dst, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "link", no_link)
    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(SystemExit) as e:
        main_guarded(make_cfg(*QUIET, *GPT_LOGGED, "steps=1", "ckpt.keep=2"), tmp_path)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: cannot write step_000001.pt: the disk is full; {tmp_path / 'checkpoints/last.pt'} "
                       f"holds step 1; free space, then continue it with: the run's command plus resume=auto "
                       f"hydra.run.dir={tmp_path}"), err[-1]
    monkeypatch.undo()
    assert torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)["step"] == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.pt"]  # no temp file left


def test_a_second_run_in_a_locked_directory_is_refused_naming_the_pid(tmp_path):
    from stabletrain.engine.rundir import RunDirLock

    lock = RunDirLock(tmp_path).acquire()  # as another run holding it would
    try:
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} holds"):
            train(tmp_path, *GPT_LOGGED, "steps=1")
        assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "metrics.jsonl").exists()
    finally:
        lock.release()
    assert (tmp_path / ".lock").read_text() == ""  # names no process once released
    assert train(tmp_path, *GPT_LOGGED, "steps=1")["status"] == "completed"  # released: the next run may
    assert (tmp_path / ".lock").read_text() == ""


@pytest.mark.parametrize("given", ["literal", "interpolated"])
def test_the_lock_of_another_process_refuses_train_py(tmp_path, given):
    """Held by a live process, refused with its pid; a dead holder's lock is gone with it. A
    directory the command line cannot check (an interpolation, as the default timestamped one)
    is claimed by the run before Hydra writes its record into it."""
    code = ("import sys, time; from stabletrain.engine.rundir import RunDirLock; "
            "RunDirLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)")
    run_dir = tmp_path / "gpt_test"
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        from tests.helpers import cli

        r = cli(*QUIET, *GPT_LOGGED, "steps=1",
                f"hydra.run.dir={run_dir if given == 'literal' else str(tmp_path) + '/${name}'}")
        assert r.returncode == 2
        assert r.stderr.strip().splitlines()[-1].startswith(f"error: {run_dir} is in use by another run "
                                                            f"(pid {holder.pid} holds"), r.stderr
        assert not (run_dir / ".hydra").exists()  # refused before Hydra writes over the running run's
    finally:
        holder.kill()
        holder.wait()
    assert train(run_dir, *GPT_LOGGED, "steps=1")["status"] == "completed"  # the kernel released the dead one's lock


def test_a_run_refused_after_it_claimed_its_new_directory_leaves_none(tmp_path):
    """The directory's lock is claimed before Hydra writes .hydra/; a refusal before the run takes
    it over (no such device on any machine) removes the directory it made, lock and record."""
    from tests.helpers import cli

    r = cli(*QUIET, *GPT_LOGGED, "steps=1", "device=cuda:99", f"hydra.run.dir={tmp_path / 'new'}")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: device=cuda:99 but "), r.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("where", ["command line", "config file"])
def test_a_working_directory_change_is_refused_before_hydra_makes_it(tmp_path, where):
    """hydra.job.chdir=true (given, or set by an option of one's own) sent relative paths to the
    run directory after the checks had read them from the starting one."""
    from tests.helpers import cli

    (tmp_path / "own" / "experiment").mkdir(parents=True)
    (tmp_path / "own" / "experiment" / "cd.yaml").write_text("# @package _global_\nhydra:\n  job:\n    chdir: true\n")
    given = (["hydra.job.chdir=true"] if where == "command line" else
             [f"hydra.searchpath=[file://{tmp_path / 'own'}]", "experiment=cd"])
    r = cli(*QUIET, *GPT_LOGGED, "steps=1", *given, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: hydra.job.chdir=true: stabletrain reads the paths you give (data, resume, imports) from the directory "
        "you start in and writes into the run directory itself; drop it (or hydra.job.chdir=false)"), r.stderr
    assert not (tmp_path / "run").exists()


def test_a_crash_leaves_a_summary_saying_where_and_why(tmp_path):
    """An exception in the loop (here an out-of-memory error at step 3) ends the run with its
    traceback, and summary.json records status failed, the steps done and the error's first line."""
    from stabletrain.build import build_trainer
    from tests.helpers import make_cfg

    t = build_trainer(make_cfg(*QUIET, *GPT_LOGGED, "steps=10"), tmp_path)
    orig = t.train_step

    def step(*a, **k):
        if t.step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return orig(*a, **k)

    t.train_step = step
    with pytest.raises(torch.OutOfMemoryError):
        t.fit()
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "failed" and s["step"] == 2
    assert s["reason"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert _steps(tmp_path) == [1, 2] and t.metrics.file.closed



def test_out_of_gpu_memory_is_one_line_naming_the_step_and_the_fixes(tmp_path, monkeypatch, capsys):
    import stabletrain.run as R

    def run(cfg, run_dir):  # what the loop leaves behind: summary.json, then the error
        (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "step": 2,
                                                           "reason": "OutOfMemoryError: CUDA out of memory."}))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.2 GiB free.\nmore")

    monkeypatch.setattr(R, "run", run)
    with pytest.raises(SystemExit) as stop:
        R.main_guarded(None, tmp_path)
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1
    assert err.startswith("error: out of GPU memory at step 2 (CUDA out of memory. Tried to allocate 2.00 GiB); "
                          "lower batch_size, set micro_batch_size")


def test_a_timeout_in_a_single_process_is_not_called_a_collective_timeout(tmp_path, monkeypatch):
    """Only a job of several ranks has collectives: one process's 'timed out' is its own error."""
    from stabletrain import build as build_module
    from stabletrain import run as run_module
    from tests.helpers import make_cfg

    def build(*a, **k):
        raise RuntimeError("DataLoader timed out after 5 seconds")

    monkeypatch.setattr(build_module, "build_trainer", build)
    with pytest.raises(RuntimeError, match="DataLoader timed out"):
        run_module.main_guarded(make_cfg(*QUIET, *GPT_LOGGED, "steps=1"), tmp_path)


@pytest.mark.parametrize("at,first,reason,then", [
    (3, "SIGINT", "a second Ctrl-C at step 3, without a checkpoint (last.pt holds step 2)",
     "continue it with: the run's command plus resume=auto"),
    (1, "SIGINT", "a second Ctrl-C at step 1, without a checkpoint", "no checkpoint was written: run it again"),
    # a Ctrl-C after a scheduler's SIGTERM was ignored, even twice, until the step and checkpoint were done
    (3, "SIGTERM", "a Ctrl-C after SIGTERM at step 3, without a checkpoint (last.pt holds step 2)",
     "continue it with: the run's command plus resume=auto"),
])
def test_a_second_ctrl_c_stops_at_once_and_says_where(tmp_path, capsys, monkeypatch, at, first, reason, then):
    """The first Ctrl-C asks for a checkpoint at the end of the step; a second one, say while a
    step hangs, stops at once: summary.json and the last line say so and name last.pt's step,
    and suggest resuming only when there is a checkpoint to resume."""
    import signal

    from stabletrain import build as build_module
    from stabletrain import run as run_module
    from tests.helpers import make_cfg

    real_build = build_module.build_trainer

    def build(*a, **k):
        t = real_build(*a, **k)
        orig = t.train_step

        def step(*a, **k):
            if t.step == at:
                signal.raise_signal(getattr(signal, first))
                signal.raise_signal(signal.SIGINT)
            return orig(*a, **k)

        t.train_step = step
        return t

    monkeypatch.setattr(build_module, "build_trainer", build)
    # Python's own handler, or SIG_IGN where the shell started the tests in the background
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        cfg = make_cfg(*QUIET, *GPT_LOGGED, "steps=10", "ckpt_every=2", "logger.log_every=2")
        run_module.main_guarded(cfg, tmp_path)
    assert stopped.value.code == 128 + signal.SIGINT
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["step"] == at and s["reason"] == reason
    # a final loss only once an interval was logged, never a made-up nan
    assert ("loss" in s["final"]) == (at > 2) and all(v != "nan" for v in s["final"].values())
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: interrupted: {reason}; {then}"), line
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are given back


def test_a_run_stopped_between_evaluations_says_when_its_val_was_measured(tmp_path, capsys):
    """Stopped at step 3 with evaluations every 2 steps: the last line and summary.json give
    step 2's val/loss as step 2's, not as the stopped step's."""
    import signal

    from stabletrain.build import build_trainer
    from tests.helpers import make_cfg

    t = build_trainer(make_cfg(*GPT_LOGGED, "steps=10", "eval_every=2", "logger=none", "monitor=off"), tmp_path)
    orig = t.train_step

    def step(*a, **k):
        if t.step == 2:
            signal.raise_signal(signal.SIGINT)  # answered after this step, the third
        return orig(*a, **k)

    t.train_step = step
    s = t.fit()
    assert s["status"] == "interrupted" and s["step"] == 3 and s["eval_step"] == 2 and "val/loss" in s["final"]
    line = capsys.readouterr().err.strip().splitlines()[-2]  # the last says how to continue
    assert line.startswith("interrupted at step 3") and line.endswith("(evaluated at step 2)"), line


def test_a_sweep_ends_with_its_points_tally_and_the_commands_that_draw_it(tmp_path, capsys):
    """A refused point's line scrolled away in a long sweep's log, and the sweep's directory was
    only in each point's start line."""
    import json

    import yaml
    from omegaconf import OmegaConf

    from stabletrain.run import SweepReport

    for num, (status, reason) in enumerate((("completed", None), ("refused", "data.path=x.bin holds 10 tokens"),
                                            ("completed", None), ("diverged", "non-finite loss (nan) at step 3"))):
        (tmp_path / str(num) / ".hydra").mkdir(parents=True)
        (tmp_path / str(num) / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"optim.tau=0.0{num + 1}"]))
        (tmp_path / str(num) / "summary.json").write_text(json.dumps({"status": status, "reason": reason}))
    (tmp_path / "4" / ".hydra").mkdir(parents=True)  # killed: no summary.json
    (tmp_path / "4" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["optim.tau=0.05"]))
    SweepReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    from stabletrain.engine.rundir import figures_command

    # the interpreter a single run's figures line names (a venv's path where "python" is another's)
    python = figures_command(tmp_path).split(" scripts/")[0]
    assert capsys.readouterr().err.splitlines() == [
        f"sweep {tmp_path}: 5 points, 2 completed, 1 refused, 1 diverged, 1 unfinished; 1/ refused: data.path=x.bin "
        f"holds 10 tokens",
        f"its table: {python} scripts/summarize_sweep.py {tmp_path}; its curves: {python} scripts/compare_runs.py "
        f"{tmp_path}"]


def test_train_yaml_registers_the_sweep_report():
    import yaml

    from tests.helpers import ROOT

    hydra = yaml.safe_load((ROOT / "configs" / "train.yaml").read_text())["hydra"]
    assert hydra["callbacks"]["sweep_report"]["_target_"] == "stabletrain.run.SweepReport"


def test_a_ctrl_c_while_train_py_starts_is_one_line(tmp_path):
    """Imports and composition take seconds before the run's own handlers: a Ctrl-C there printed
    the traceback of whichever import it landed in. The signal is sent once torch's library is
    mapped (its import is under way, after the hook), whatever the machine's speed. (A library
    that swallows KeyboardInterrupt in an import of its own can lose the signal: such an attempt
    runs on, and is not counted.)"""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import ROOT

    told = 0
    for attempt in range(3):
        p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "model=gpt_test", "steps=1", "dry_run=true",
                              f"hydra.run.dir={tmp_path / str(attempt)}"], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "WANDB_MODE": "disabled"},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not a background job's
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            try:
                if "libtorch" in open(f"/proc/{p.pid}/maps").read():
                    break
            except OSError:
                pass
            time.sleep(0.01)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=300)
        if p.returncode == 0:
            continue
        # (on a fast machine the signal may land in the build, which says so in its own line)
        assert "Traceback" not in err and err.strip() in (
            "error: interrupted while starting, before training; run it again",
            "error: interrupted before training started (nothing trained); run it again"), err[-2000:]
        assert p.returncode in (-signal.SIGINT, 128 + signal.SIGINT)  # by the signal, as a shell expects of a Ctrl-C
        told += 1
    assert told

def test_a_ctrl_c_while_a_resume_loads_names_the_command_that_continues(tmp_path, monkeypatch, capsys):
    """Before the loop answers signals a Ctrl-C ends the start; where the run has a checkpoint the line
    said "nothing was written but the config", not how to go on."""
    import signal

    from stabletrain import run as run_module
    from stabletrain.engine.loop import Trainer
    from tests.helpers import make_cfg

    args = [*QUIET, *GPT_LOGGED, "steps=4", "ckpt_every=2"]
    run_module.main_guarded(make_cfg(*args, "steps=2"), tmp_path)

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "maybe_resume", interrupted)
    monkeypatch.setattr(run_module, "task_overrides", lambda: ["steps=4"])
    with pytest.raises(SystemExit) as e:
        run_module.main_guarded(make_cfg(*args, "resume=auto"), tmp_path)
    assert e.value.code == 128 + signal.SIGINT
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: interrupted before training started (nothing trained); continue it with: ") and \
        last.endswith(f"train.py steps=4 resume=auto hydra.run.dir={tmp_path}"), last
    # a fresh run in that directory (no resume): the earlier run's last.pt is not this run's to continue
    with pytest.raises(SystemExit):
        run_module.main_guarded(make_cfg(*args), tmp_path)
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("error: interrupted before training started (nothing "
                                                                "trained); run it again")


@pytest.mark.parametrize("how", ["moved", "replaced"])
def test_a_run_directory_moved_or_replaced_mid_run_stops_the_run_without_writing(tmp_path, monkeypatch, capsys, how):
    """A run whose directory was deleted trained on into its unlinked metrics.jsonl and wrote its
    checkpoints into a directory it made again, where a second run could have started (with the lock
    gone): the two runs' files mixed. It now stops at its next checkpoint and says so."""
    import shutil

    from stabletrain import run as run_module
    from stabletrain.engine.loop import Trainer
    from tests.helpers import make_cfg

    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    step = Trainer.train_step

    def move_at_step_3(self, *a, **k):
        if self.step == 3:
            shutil.move(run_dir, moved)
            if how == "replaced":
                (run_dir / "checkpoints").mkdir(parents=True)  # another run in its place
        return step(self, *a, **k)

    monkeypatch.setattr(Trainer, "train_step", move_at_step_3)
    monkeypatch.setattr(run_module, "task_overrides", lambda: ["model=gpt_test", "steps=6"])
    with pytest.raises(SystemExit) as e:
        run_module.main_guarded(make_cfg(*QUIET, *GPT_LOGGED, "steps=6", "ckpt_every=2"), run_dir)
    assert e.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: the run directory {run_dir} was deleted or moved while the run trained (or "
                           f"another took its place): stopped at step 4 without writing into it; where it was "
                           f"moved, continue it with: ") and \
        last.endswith("train.py model=gpt_test steps=6 resume=auto hydra.run.dir=NEW_PLACE"), last
    assert sorted(p.name for p in run_dir.rglob("*")) == (["checkpoints"] if how == "replaced" else [])
    assert torch.load(moved / "checkpoints/last.pt", weights_only=True)["step"] == 2
    monkeypatch.undo()
    done = run_module.main_guarded(make_cfg(*QUIET, *GPT_LOGGED, "steps=6", "ckpt_every=2", "resume=auto"), moved)
    assert done["status"] == "completed" and done["step"] == 6  # as the line says
