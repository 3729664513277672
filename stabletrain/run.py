"""From a composed config to a finished run directory."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from stabletrain.errors import ConfigError, ReachedNothing, StoppedAtOnce, fail, first_line
from stabletrain.engine import distributed as D
from stabletrain.engine.checkpoint import CheckpointWriteError, RunDirGone, last_checkpoint, remove_stale_temps
from stabletrain.engine.rundir import (KEPT_HYDRA, KEPT_MULTIRUN, REFUSED_NOW, RunDirLock, continue_with,
                                      figures_command, folders_to_make, remove_made, script_command, sweep_dir,
                                      task_overrides)
from stabletrain.metrics import read_json, say, write_json


def run(cfg, run_dir: str | Path) -> dict:
    """Validate, build, train; returns the summary (also in ``run_dir/summary.json``).

    In a DDP job every rank calls this; rank 0's ``run_dir`` is the run's, whatever the
    others were given, and only rank 0 writes into it.
    """
    from stabletrain.build import Everything, build_trainer, validate

    validate(cfg, swept=Everything() if sweep_dir() is not None else ())  # a sweep was checked before launch
    warnings.filterwarnings("ignore", category=ReachedNothing)  # train.py's start notes say it (build.py)
    info = D.detect()
    lock = trainer = None
    try:
        D.init(info, D.pick_device(cfg.device, info), cfg.dist_timeout)
        run_dir = Path(D.broadcast_object(str(Path(run_dir).absolute()), info))
        if cfg.dry_run:  # builds everything, takes no lock and writes nothing into the run directory
            trainer = build_trainer(cfg, run_dir, info)
            found = trainer.resume_source()  # a resume the run would refuse is refused here too
            if info.is_main:
                print(dry_run_report(trainer, found), file=sys.stderr)
                if run_dir.is_dir() and not any(run_dir.iterdir()):  # made for the run it did not start
                    remove_made(_NEW_DIRS.pop() if _NEW_DIRS else [run_dir])
            _DRY_POINTS[0] += sweep_dir() is not None
            return {"status": "dry_run", "params": sum(p.numel() for p in trainer.model.parameters())}
        if info.is_main:
            # one run per directory; its lock also makes the temp files of earlier, killed writes stale
            lock = RunDirLock(run_dir).acquire()
            for tmp in remove_stale_temps(run_dir / "checkpoints"):
                print(f"removed {tmp.name}, left by a checkpoint write that was interrupted", file=sys.stderr)
        # a preemption warning before the loop answers signals (the build, a resume's load, the
        # sink's start) is held for the loop, which checkpoints after its first step and requeues
        with HeldPreemptionWarnings() as held:
            try:
                trainer = build_trainer(cfg, run_dir, info)
            except Exception as e:
                if info.is_main and not isinstance(e, ConfigError):
                    record_build_failure(run_dir, e)
                elif lock is not None and sweep_dir() is None:  # a refused sweep point keeps its summary.json
                    lock.release_and_remove_unused()
                raise
            trainer.held_signal = held.taken

            def write_config() -> None:
                config = run_dir / "config.yaml"
                # Written once the model is built, so it records what the data set (class count,
                # channels), and once a resume has succeeded, so a refused one leaves the file of the
                # run it refused. A requeued attempt keeps the first attempt's file: the loop refuses
                # to resume a checkpoint of another config, and that file must still say which it was.
                requeued = cfg.resume is None and D.may_be_requeued() and last_checkpoint(run_dir) is not None
                if not (requeued and config.is_file()):
                    config.write_text(OmegaConf.to_yaml(cfg, resolve=True))

            if info.is_main:
                trainer.on_start.append(write_config)
            summary = trainer.fit()
    finally:
        if lock is not None:
            lock.release()
        stop_signal = getattr(trainer, "stop_signal", None)
        trainer = None  # freed before the process group: see D.shutdown
        D.shutdown(info)
    if summary["status"] == "interrupted":
        requeue_after(stop_signal, info)
    return summary


class HeldPreemptionWarnings:
    """A preemption warning (SIGUSR1/SIGUSR2) that arrives while the run is being built or its
    loop starts (a resume's load, the sink), before the loop answers signals, is held for the
    loop instead of ending the process (their default action) and losing the requeue. The
    handlers in place before (submitit's) are put back on leaving, so that
    :func:`requeue_after` finds them."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def _hold(self, signum, _frame) -> None:
        self.signum = signum

    def taken(self) -> int | None:
        """The warning held so far (the loop asks when it starts answering signals)."""
        return self.signum

    def __enter__(self) -> HeldPreemptionWarnings:
        for name in ("SIGUSR1", "SIGUSR2"):
            s = getattr(signal, name, None)
            if s is not None:
                try:
                    self._old[s] = signal.signal(s, self._hold)
                except ValueError:  # not the main thread
                    pass
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def record_build_failure(run_dir: Path, err: Exception) -> None:
    """An exception while building (a bug in an option of one's own): the traceback says where,
    and summary.json says the run failed and why, where the directory holds no earlier run's,
    so that a sweep's table shows the point as failed, not as unfinished."""
    done = run_dir / "summary.json"
    if not done.exists():
        write_json(done, {"status": "failed", "step": 0,
                          "reason": f"{type(err).__name__} while building the run: {first_line(err)}"})


def refuse_point(run_dir: Path, reason: str) -> None:
    """A sweep point refused before it trained: said in one line, and in its summary.json where
    the directory holds no run (a refused resume leaves the run it refused as it was)."""
    print(f"error: {reason} (this sweep point is skipped; the sweep goes on)", file=sys.stderr)
    _REFUSED[0] = reason  # for SweepReport.on_job_end, in this process
    if D.detect().rank > 0 or any((run_dir / f).exists() for f in ("summary.json", "metrics.jsonl", "checkpoints")):
        return
    try:
        RunDirLock(run_dir).check_free()  # held: another run trains there
    except ConfigError:
        return
    write_json(run_dir / "summary.json", {"status": "refused", "step": 0, "reason": reason})


_REFUSED: list[str | None] = [None]  # the reason this process's sweep point was refused


_NEW_DIRS: list[list[Path]] = []  # what a single dry run's directory made new (rundir.folders_to_make)
_DRY_POINTS = [0]  # the points of a dry sweep built in this process


class ClaimRunDir(Callback):
    """A Hydra callback (train.yaml's ``hydra.callbacks``): a single run takes its directory's lock
    before Hydra writes ``.hydra/`` into it (:meth:`RunDirLock.claim`), so that a second run
    started into the same directory is refused before it rewrites the first one's record. A run
    or sweep that would change its working directory (``hydra.job.chdir``, from the command line
    or a config file) is refused before Hydra changes it."""

    def on_run_start(self, config, **kwargs) -> None:
        _refuse_chdir(config)
        if config.get("dry_run"):  # takes no lock; the folders Hydra is about to make go again at its end
            _NEW_DIRS.append(folders_to_make(str(config.hydra.run.dir)))
        if D.detect().rank > 0 or config.get("dry_run") or config.hydra.output_subdir is None:
            return
        try:
            RunDirLock(Path(str(config.hydra.run.dir)).absolute()).claim()
        except ConfigError as e:
            fail(str(e))

    def on_multirun_start(self, config, **kwargs) -> None:
        _refuse_chdir(config)


def _refuse_chdir(config) -> None:
    if config.hydra.job.chdir:
        fail("hydra.job.chdir=true: stabletrain reads the paths you give (data, resume, imports) from the directory "
             "you start in and writes into the run directory itself; drop it (or hydra.job.chdir=false)")


class SweepReport(Callback):
    """A Hydra callback (train.yaml's ``hydra.callbacks``): a sweep's last lines are a tally of
    its points (completed, diverged, refused with the first refusal's reason, not finished) and
    the commands that draw its table and curves, where a single run names its figures' command.
    A refused point's line had scrolled away in a long sweep's log, and the sweep's directory was
    only in each point's start line.

    A sweep run again into its directory (resume=auto) has its multirun.yaml and each point's
    ``.hydra/`` rewritten by Hydra before a point may refuse the new command: they are kept at
    the start and put back for the points that refused it, which the tally counts as refused
    this time (their runs' own summaries said completed), so that the table and labels still
    read the overrides each run trained with."""

    def on_multirun_start(self, config, **kwargs) -> None:
        if D.detect().rank > 0:
            return
        root = Path(str(config.hydra.sweep.dir))
        self.made = folders_to_make(root) if config.get("dry_run") else []
        if not root.is_dir():
            return
        if (root / "multirun.yaml").is_file():
            shutil.copyfile(root / "multirun.yaml", root / KEPT_MULTIRUN)
        for record in root.glob("*/.hydra"):
            kept = record.parent / KEPT_HYDRA
            shutil.rmtree(kept, ignore_errors=True)  # one a killed sweep left: what is there now is newer
            shutil.copytree(record, kept)
            (record.parent / REFUSED_NOW).unlink(missing_ok=True)

    def on_job_end(self, config, job_return=None, **kwargs) -> None:
        reason, _REFUSED[0] = _REFUSED[0], None
        if reason is None or D.detect().rank > 0:
            return
        point = Path(str(config.hydra.runtime.output_dir))
        kept = point / KEPT_HYDRA
        if kept.is_dir():  # the record of the run this point holds, not of the command it refused
            shutil.rmtree(point / ".hydra", ignore_errors=True)
            kept.rename(point / ".hydra")
            (point / REFUSED_NOW).write_text(reason + "\n")

    def on_multirun_end(self, config, **kwargs) -> None:
        from stabletrain.analysis.sweeps import find_runs

        if D.detect().rank > 0:
            return
        root = Path(str(config.hydra.sweep.dir))
        try:
            runs = find_runs(root)
        except OSError:
            return
        refused_now = {}
        for r in runs:
            mark = r.path / REFUSED_NOW
            if mark.is_file():
                refused_now[r.path] = mark.read_text().strip()
                mark.unlink()
        for kept in root.glob(f"*/{KEPT_HYDRA}"):
            shutil.rmtree(kept, ignore_errors=True)
        if config.get("dry_run"):  # its points wrote nothing: neither does the sweep
            if (root / KEPT_MULTIRUN).is_file():
                (root / KEPT_MULTIRUN).replace(root / "multirun.yaml")
            else:
                (root / "multirun.yaml").unlink(missing_ok=True)
                remove_made(getattr(self, "made", []))  # a new sweep directory goes too
            n = _DRY_POINTS[0]  # built in this process (a launcher's jobs are counted where they ran)
            say(f"dry run of a sweep{f' of {n} point' + 's' * (n != 1) if n else ''}: nothing trained, nothing written")
            return
        if (root / KEPT_MULTIRUN).is_file():  # no point took this command: the sweep's is the earlier one
            started = [r for r in runs if r.summary.get("status") != "not started"]
            if started and all(r.path in refused_now for r in started):
                (root / KEPT_MULTIRUN).replace(root / "multirun.yaml")
            else:
                (root / KEPT_MULTIRUN).unlink()
        if not runs:
            return
        counts: dict[str, int] = {}
        for r in runs:
            status = "refused this time" if r.path in refused_now else r.summary.get("status", "unfinished")
            counts[status] = counts.get(status, 0) + 1
        tally = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        refused = next((r for r in runs if r.path in refused_now or r.summary.get("status") in ("refused", "failed")),
                       None)
        why = ("" if refused is None else
               f"; {refused.path.name}/ refused this time (its run is as it was): {refused_now[refused.path]}"
               if refused.path in refused_now else
               f"; {refused.path.name}/ {refused.summary['status']}: {refused.summary.get('reason') or '?'}")
        say(f"sweep {root}: {len(runs)} point{'s' * (len(runs) != 1)}, {tally}{why}")
        # with the interpreter that has the packages, as a single run's figures line
        table, curves = (script_command(name, root) for name in ("summarize_sweep.py", "compare_runs.py"))
        if table and curves:
            say(f"its table: {table}; its curves: {curves}")


def dry_run_report(trainer, resumed: tuple[Path, dict] | None = None) -> str:
    """What ``dry_run=true`` prints: the parameters per module, the optimizer's groups, the data,
    the length of the run and the checkpoint it would resume (``resumed``: path and payload)."""
    from stabletrain.optim.param_groups import parameter_table

    t = trainer
    resume = [f"resume: would continue from step {resumed[1]['step']} of {resumed[0]}",
              *t.resume_notes(*resumed), *filter(None, [t.going_back_note(resumed[0], resumed[1]["step"], would=True)])
              ] if resumed else []
    lines = [parameter_table(t.model), t.headline(), t.data_line(), *t.notes, *resume,
             "dry run: nothing trained, nothing written"]
    return "\n".join(lines)


def requeue_after(signum: int, info: D.DistInfo) -> None:
    """The run has checkpointed on ``signum``; under SLURM, have the job run again.

    Under submitit (``hydra/launcher=slurm``) its own handler for the signal, which the loop
    held back while training, now does what it exists for: rank 0 calls the launcher's
    ``checkpoint`` (resubmit the same sweep point), requeues the job and exits. Under a plain
    sbatch script, a preemption warning (SIGUSR1/SIGUSR2) makes rank 0 run
    ``scontrol requeue``. Either way the next attempt finds ``last.pt`` and resumes.
    """
    if D.under_submitit():
        handler = signal.getsignal(signum)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signum, None)
        return
    usr = {getattr(signal, n) for n in ("SIGUSR1", "SIGUSR2") if hasattr(signal, n)}
    if D.under_slurm() and signum in usr and info.is_main:
        if shutil.which("scontrol") is None:
            print("warning: cannot requeue (no scontrol on PATH); resubmit the job to resume", file=sys.stderr)
            return
        job = os.environ.get("SLURM_ARRAY_JOB_ID")
        job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ["SLURM_JOB_ID"]
        subprocess.run(["scontrol", "requeue", job], check=False, timeout=60)


# what frees a run directory that could not be written into, by errno (None: it must move)
_FIX = {errno.ENOSPC: "free space", errno.EDQUOT: "free space", errno.EACCES: "make it writable",
        errno.EPERM: "make it writable", errno.EROFS: None}


def _go_on(run_dir, fix: str | None) -> str:
    """How a run stopped by its run directory goes on: its resume command, or from the start."""
    if fix is None:
        return f"copy it to a writable disk, then continue it there with: {continue_elsewhere()}"
    if last_checkpoint(Path(run_dir)) is None:
        return f"{fix} and run it again (no checkpoint was written)"
    return f"{fix}, then continue it with: {continue_with(run_dir, task_overrides())}"


def continue_elsewhere() -> str:
    """The command that continues this run (or its sweep) from a copy at NEW_PLACE."""
    if sweep_dir() is not None:  # continue_with names the sweep's own directory
        return "the sweep's command plus resume=auto hydra.sweep.dir=NEW_PLACE"
    return continue_with("NEW_PLACE", task_overrides())


def main_guarded(cfg, run_dir, sweep: bool = False) -> dict | None:
    """``run`` with config mistakes reported as one line (no traceback) and exit code 2.

    ``sweep``: a point of a Hydra multirun, whose refusal (say, a token file too short for its
    block size, which only building finds) is recorded in its ``summary.json`` (status
    ``refused``) and ends the point, not the sweep, as a diverged point does."""
    try:
        summary = run(cfg, run_dir)
    except ConfigError as e:
        if sweep:
            refuse_point(Path(run_dir), str(e))
            return None
        RunDirLock(run_dir).release_claim()  # refused before the run took its lock over: a new directory goes with it
        fail(str(e))
        return None
    except RunDirGone as e:
        fail(f"{e}; where it was moved, continue it with: {continue_elsewhere()}", 1)
        return None
    except CheckpointWriteError as e:  # a full disk: one line, the previous checkpoint is kept
        fail(f"{e}; {_go_on(run_dir, _FIX.get(e.errno, 'fix the disk'))}", 1)
        return None
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        ours = e.filename is not None and Path(str(e.filename)).resolve().is_relative_to(Path(run_dir).resolve())
        if not (full or (ours and e.errno in _FIX)):
            raise
        # metrics.jsonl is written at every log step, so a disk filled by another job (or a run dir
        # made read-only) meets it before a checkpoint: one line, and the command that goes on after
        what = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                errno.EROFS: "the file system is read-only"}.get(e.errno, "permission denied")
        fail(f"cannot write into {run_dir}: {what}{f' ({e.filename})' if e.filename else ''}; "
             f"{_go_on(run_dir, _FIX[e.errno])}", 1)
        return None
    except torch.OutOfMemoryError as e:  # the loop has written summary.json (status failed, the step)
        done = read_json(Path(run_dir) / "summary.json") or {}
        ours = done.get("status") == "failed" and str(done.get("reason", "")).startswith("OutOfMemoryError")
        at = f" at step {done['step']}" if ours and "step" in done else ""
        fail(f"out of GPU memory{at} ({'. '.join(first_line(e).split('. ')[:2])}); lower batch_size, set "
             f"micro_batch_size to accumulate smaller micro-batches, or set activation_checkpointing=true",
             1, every_rank=True)
        return None
    except Exception as e:
        if not (D.detect().enabled and (D.is_timeout(e) or D.is_peer_gone(e))):  # one process has no other rank
            raise
        why = (f"a collective waited dist_timeout={cfg.dist_timeout:g} s for another rank, which stopped answering "
               f"(hung, stopped or dead)" if D.is_timeout(e) else
               f"another rank went away in a collective (killed or crashed: {first_line(e)[:120]})")
        fail(f"{why}; the job ends here, and resume=auto continues it from its last checkpoint", 1, every_rank=True)
        return None
    except StoppedAtOnce as e:
        then = (f"continue it with: {continue_with(run_dir, task_overrides())}" if e.saved_step is not None
                else "no checkpoint was written: run it again to start over")
        fail(f"interrupted: {e}; {then}", 128 + signal.SIGINT)
        return None
    except KeyboardInterrupt:  # Ctrl-C while building or loading a resume, before the loop's handler
        # (a fresh run in a directory of an earlier one has not set that one aside yet: its last.pt is not ours)
        resumes = cfg.resume is not None or D.may_be_requeued()
        then = (f"continue it with: {continue_with(run_dir, task_overrides())}"
                if resumes and last_checkpoint(Path(run_dir)) is not None else "run it again")
        fail(f"interrupted before training started (nothing trained); {then}", 128 + signal.SIGINT)
        return None
    if not sweep and summary.get("status") in ("completed", "diverged") and D.detect().is_main:
        figures = figures_command(run_dir)
        if figures is not None:  # the run's last line: where its record is, and how to see it
            say(f"draw its figures (into its plots/) with: {figures}")
    if summary.get("status") == "interrupted" and not D.may_be_requeued():
        # the shell's code for a process ended by that signal: a sweep stops, scripts see it
        sys.exit(128 + int(summary.get("signal", signal.SIGINT)))
    return summary
