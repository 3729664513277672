"""What resuming a checkpoint means for a run: which checkpoint (``resume=auto``, a path, a
requeued job's own), whether it fits, what of an earlier run moves aside, and the lines that
say what the resume changed.

:class:`~stabletrain.engine.checkpoint.Checkpointer` reads, writes and checks the files; this
module decides from them; the Trainer puts the chosen state back (``Trainer.maybe_resume``).
Nothing here restores or cuts anything but :func:`set_aside_earlier_run`: a dry run asks
:func:`resume_source` and :func:`resume_notes` too.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from stabletrain.config import HOW_RECORDED, leaf_values, may_change
from stabletrain.engine import distributed as D
from stabletrain.engine.checkpoint import Checkpointer, spelled
from stabletrain.engine.rundir import sweep_dir
from stabletrain.errors import ConfigError
from stabletrain.metrics import previous_name


def resume_source(ckpt: Checkpointer, settings, notes: list) -> tuple[Path, dict] | None:
    """The checkpoint ``settings.resume`` names (or a requeued job's own), loaded and checked
    against this run, refused in one line where it does not fit; None where there is none.
    Why a ``resume=auto`` found none is appended to ``notes``."""
    r = settings.resume
    requeued = r is None and D.may_be_requeued()
    if r is None and not requeued:
        return None
    path = ckpt.find(r)
    if path is None:
        if r == "auto":
            earlier = any((ckpt.run_dir / f).is_file() for f in ("summary.json", "metrics.jsonl"))
            why = ("the run there stopped before its first checkpoint" if earlier else
                   "this sweep point had not started" if sweep_dir() is not None else
                   "to continue a run, pass its directory as hydra.run.dir")
            notes.append(f"resume=auto: no checkpoint in {ckpt.dir}, starting from step 0 ({why})")
        return None
    own = _own_earlier_attempt(ckpt, path, notes) if r != "auto" and D.may_be_requeued() else None
    if own is not None:  # a requeued job started with resume=PATH goes on from where it stopped
        path, ck, requeued = *own, True
    else:
        ck = ckpt.load(path)
    if ck["step"] > settings.total_steps:
        theirs = ckpt.command_of(ck, path)
        raise ConfigError(f"{path} is at step {ck['step']}, past this run's {settings.total_steps} steps: "
                          + (f"continue it with its own command, {theirs}; or " if theirs else "")
                          + f"pass steps={ck['step']} to end it there, more to train on (steps counts from "
                          f"the run's start)")
    # checked before anything is loaded or cut (metrics.jsonl is truncated only after this returns)
    ckpt.check_resumable(path, ck, auto=r == "auto", requeued=requeued, allow_changes=settings.resume_allow_changes)
    return path, ck


def _own_earlier_attempt(ckpt: Checkpointer, path: Path, notes: list) -> tuple[Path, dict] | None:
    """Under a scheduler that requeues, the run dir's last.pt when this same config (its
    ``resume=PATH`` included) wrote it: the job's earlier attempt, to continue rather than
    start again from ``path``."""
    last = ckpt.find("auto")
    if last is None or last.absolute() == path.absolute():
        return None
    ck = ckpt.load(last)
    if not ck.get("config") or ckpt.changed_keys(ck["config"]):
        return None
    notes.append(f"resumed from {last}, not resume={path}: this job was started again (requeued) and "
                 f"goes on from its own last checkpoint")
    return last, ck


def set_aside_earlier_run(ckpt: Checkpointer, notes: list) -> None:
    """Move an earlier run's checkpoints, records, summary, figures and config aside (rank 0), so that
    none is overwritten, restored by a rollback or taken for this run's. They share one suffix
    (``checkpoints.previous2/`` goes with ``metrics.previous2.jsonl``), so that a resume from
    the set-aside checkpoints finds their history (:func:`~stabletrain.engine.checkpoint.records_of`)."""
    if ckpt.info.is_main:
        # the first number none of them has taken: one taken by the records of a run that wrote no
        # checkpoint would pair these checkpoints with that run's records
        moved = ckpt.set_aside(previous_name(ckpt.dir, *(ckpt.run_dir / name for name in _RUN_FILES)))
        suffix = moved.name[len(ckpt.dir.name):] if moved is not None else None
        went = [(ckpt.dir.name + "/", moved.name + "/")] if moved is not None else []
        # config.yaml too: the fresh run writes its own, and the set-aside records say nothing
        # of the settings that made them without it
        for name in _RUN_FILES:
            path = ckpt.run_dir / name
            if not path.exists():
                continue
            dest = ckpt.run_dir / _aside(name, suffix) if suffix else previous_name(path)  # suffix: free for all
            path.replace(dest)
            went.append((name, dest.name))
        if went:
            last = moved / "last.pt" if moved is not None else None  # resume=auto would find this run's
            # a config.yaml alone may be anyone's (a run killed before its first record writes one too)
            held = "an earlier run" if went[-1][0] != "config.yaml" or len(went) > 1 else "a file a run writes"
            notes.append(f"{ckpt.run_dir} held {held}: moved aside "
                         + ", ".join(f"{a} -> {b}" for a, b in went)
                         + (f" (to continue that run instead, stop this one and pass resume={last})"
                            if last is not None and last.is_file() else ""))
    D.barrier(ckpt.info)  # no rank writes a checkpoint into the directory before it has moved


_RUN_FILES = ("metrics.jsonl", "summary.json", "plots", "config.yaml")  # set aside with the checkpoints


def _aside(name: str, suffix: str) -> str:
    """``metrics.jsonl`` -> ``metrics.previous2.jsonl`` for ``suffix`` ``.previous2``."""
    stem, dot, ext = name.partition(".")
    return f"{stem}{suffix}{dot}{ext}"


def changes_of(ckpt: Checkpointer, ck: dict) -> dict[str, str]:
    """``{"optim.lr": "0.001 -> 0.003"}``: every setting this run changes from the checkpoint's,
    those a resume may change included."""
    saved, mine = ck.get("config"), ckpt.config_yaml
    if not (saved and mine):
        return {}
    changed = ckpt.changed_keys(saved, allowed=("resume", "resume_allow_changes", "dry_run"))
    was, now = leaf_values(saved), leaf_values(mine)
    return {k: f"{spelled(was, k)} -> {spelled(now, k)}" for k in changed}


def resume_notes(ckpt: Checkpointer, settings, lr_at, path: Path, ck: dict) -> list[str]:
    """What resuming ``ck`` changes that the user may not expect: keys changed through
    ``resume=PATH`` (only resume=auto refuses them), a new run length, which reshapes the lr
    schedule ``lr_at`` (step -> lr), a new world size and a changed weight average. Read from
    the checkpoint alone."""
    saved, mine = ck.get("config"), ckpt.config_yaml
    if not (saved and mine):
        return []
    notes = []
    changed = ckpt.changed_keys(saved, allowed=("resume", "resume_allow_changes"))
    keys = [k for k in changed if not may_change(k)]
    if keys and settings.resume not in (None, "auto"):
        notes.append(f"resume={path} continues with another {', '.join(keys[:8])}"
                     f"{' ...' if len(keys) > 8 else ''} than the run that wrote it")
    elif keys and settings.resume_allow_changes:  # a norm of one's own swapped for LayerNorm: silent
        notes.append(f"resume_allow_changes=true: the run goes on with changes: "
                     f"{ckpt.changes_shown(ck, keys, at_most=8)}")
    # the settings a resume may change, said too: a new eval_batches scores another part of
    # the val set from here, a new cadence moves the curves' points
    said = ("steps", "epochs", "ema.decay", "dry_run")  # notes of their own below; a dry run's own
    allowed = [k for k in changed if may_change(k) and k not in said]
    if allowed:
        notes.append(f"resumed with other settings: {ckpt.changes_shown(ck, allowed)}")
    if {"steps", "epochs"} & {k.split(".")[0] for k in changed}:
        step, scale = ck["step"], float((ck.get("survival") or {}).get("lr_scale", 1.0))
        lr = lr_at(step) * scale
        if lr_follows_the_length(lr_at, step):
            notes.append(f"the run's length changed: the lr schedule is that of {settings.total_steps} steps "
                         f"from step 0, so at step {step} the lr is {lr:.3g}")
        else:  # a cosine of its own horizon, a step or constant schedule: "reshaped" would be untrue
            notes.append(f"the run's length changed, its lr schedule does not depend on it: at step {step} "
                         f"the lr is {lr:.3g}")
    world, now = ck.get("world"), ckpt.info.world
    if world is not None and world != now:  # allowed: the global batch is the same
        notes.append(f"resumed on {now} process(es), written on {world}: the global batch and its data "
                     f"are the same; dropout, drop path and mixup, where on, draw per process, so from here the "
                     f"run is not bit for bit the one it would have been")
    if "ema.decay" in changed:  # allowed on resume, but val_ema/* then means something else
        notes.append("the weight average changed on resume (ema.decay): " + (
            "it starts now, from the resumed weights" if ckpt.ema is not None and ck.get("ema") is None
            else "it goes on from the resumed average with the new decay" if ckpt.ema is not None
            else "it is off from here"))
    return notes


def lr_follows_the_length(lr_at, step: int) -> bool:
    """Whether the lr schedule ``lr_at`` from ``step`` to the end depends on the run's length (a
    cosine to the end of the run does; one of its own horizon, a step or constant schedule does not)."""
    other = replace(lr_at, total_steps=lr_at.total_steps + 1)
    ahead = {step, (step + lr_at.total_steps) // 2, lr_at.total_steps - 1}
    return any(other(s) != lr_at(s) for s in ahead)


def divergence_ahead(previous: dict | None, step: int, rollback: bool, changes: dict[str, str]) -> str | None:
    """Resumed at ``step`` with ``changes`` before the step the run's ``previous`` summary
    diverged at, a run meets the same state and data again: the line that says so before it
    spends the steps to find out, or None (a rollback goes past it; a change to anything but
    how the run is recorded may too)."""
    at = (previous or {}).get("diverged_at")
    if (previous or {}).get("status") != "diverged" or not isinstance(at, int) or at <= step or rollback \
            or any(not may_change(k, HOW_RECORDED) for k in changes):
        return None
    reason = previous.get("reason")
    return (f"note: this run diverged at step {at}" + (f" ({reason})" if reason else "")
            + " from this checkpoint's state with these settings, and will likely diverge there "
            "again; divergence.action=rollback goes past it (back to a checkpoint before it, "
            "skipping the data from there)")
