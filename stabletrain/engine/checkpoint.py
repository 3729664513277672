"""Atomic checkpoints: write a temp file beside the target, fsync, then rename over it."""

from __future__ import annotations

import errno
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from stabletrain.config import RESUME_MAY_CHANGE, changed_keys, leaf_values, may_change, optim_name_of
from stabletrain.engine import distributed as D
from stabletrain.engine.rundir import (command, config_flags, continue_with, launcher_of_this_job, own_dir_key,
                                      sweep_dir)
from stabletrain.errors import ConfigError, first_line
from stabletrain.metrics import read_json


def mismatch(e: BaseException) -> str:
    """load_state_dict's complaint in one line: its first finding, not its header
    (``Error(s) in loading state_dict for VisionTransformer:``)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    detail = next((ln for ln in lines[1:]), lines[0] if lines else type(e).__name__)
    return detail if len(detail) <= 200 else detail[:197] + "..."


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a quota); the previous one is kept.
    Its message is one line."""

    def __str__(self) -> str:
        return str(self.strerror)


class RunDirGone(RuntimeError):
    """The run directory was deleted or moved while the run trained (or another took its place):
    the run stops without writing, so that no other run's directory is written into."""


def _identity(d: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(d)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def save_checkpoint(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
        _sync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        kept = f"{path} still holds the previous checkpoint" if path.is_file() else "no checkpoint was kept"
        raise _write_error(e, path, kept) from None
    except BaseException:  # a second Ctrl-C mid-write: no checkpoint-sized temp file left behind
        tmp.unlink(missing_ok=True)
        raise


def _write_error(e: OSError, path: Path, kept: str) -> CheckpointWriteError:
    why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or type(e).__name__)
    return CheckpointWriteError(e.errno, f"cannot write {path.name}: {why}; {kept}")


def _sync_dir(d: Path) -> None:
    """Make a rename in ``d`` durable: without it a power loss can bring back the old name's file."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # a platform or filesystem that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temps(ckpt_dir: Path) -> list[Path]:
    """Temp files of checkpoint writes that a kill interrupted (``.last.pt.tmp<pid>``); call it
    only while holding the run directory's lock, when no other process can be writing one."""
    ckpt_dir = Path(ckpt_dir)
    gone = sorted(ckpt_dir.glob(".*.tmp*")) if ckpt_dir.is_dir() else []
    for p in gone:
        if p.is_dir():  # a sharded checkpoint's directory (.last_dcp.tmp, .step_N_dcp.tmp)
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone


def _floating(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            out.append(obj.detach())
    elif isinstance(obj, dict):
        for v in obj.values():
            _floating(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _floating(v, out)
    return out


def all_finite(*states) -> torch.Tensor:
    """Whether every floating tensor in ``states`` (state dicts, nested) is finite, as a bool
    tensor on the CPU: one fused max-abs reduction per device and dtype (``torch._foreach_norm``
    with ord=inf, which cannot overflow as a 2-norm can), read back with a single copy."""
    groups: dict = {}
    for t in _floating(list(states), []):
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    verdict = []
    for ts in groups.values():
        norms = torch._foreach_norm(ts, float("inf"))
        verdict.append(torch.stack(norms).isfinite().all())
    if not verdict:
        return torch.tensor(True)
    return torch.stack([v.to("cpu", non_blocking=False) for v in verdict]).all()


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=True)


def spelled(values: dict, key: str):
    """``values[key]`` as a config's yaml spells it: ``null`` for None, ``unset`` where absent."""
    return "unset" if key not in values else "null" if values[key] is None else values[key]


def last_checkpoint(run_dir: Path) -> Path | None:
    p = Path(run_dir) / "checkpoints" / "last.pt"
    return p if p.is_file() else None


def records_of(ckpt: Path) -> Path | None:
    """The metrics.jsonl of the run that wrote the checkpoint ``ckpt``: ``RUN/checkpoints/x.pt``
    -> ``RUN/metrics.jsonl``; one a fresh run set aside, ``RUN/checkpoints.previous2/x.pt`` ->
    ``RUN/metrics.previous2.jsonl`` (the loop moves the two with one suffix). None for a
    checkpoint outside a run directory."""
    folder = Path(ckpt).parent
    if not folder.name.startswith("checkpoints"):
        return None
    return folder.parent / f"metrics{folder.name[len('checkpoints'):]}.jsonl"


def seed_all(seed: int) -> None:
    """torch's, Python's and NumPy's global generators (timm's Mixup draws from NumPy's)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict:
    """Every global generator a step draws from, as tensors and lists (``weights_only`` loads)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    _, py, py_gauss = random.getstate()  # the second of random.gauss's pair is kept for its next call
    state = {"torch": torch.get_rng_state(), "python": list(py), "python_gauss": py_gauss,
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """What :func:`rng_state` saved. A checkpoint loaded with ``map_location`` a GPU holds its
    generator states on the GPU too; the setters take CPU tensors only."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate((random.getstate()[0], tuple(state["python"]), state.get("python_gauss")))
    if "numpy" in state:  # checkpoints from before it was saved lack it
        n = state["numpy"]
        keys = n["keys"].cpu().numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# --- the ring: the last ``ckpt.keep`` checkpoints besides last.pt, for rollbacks ---------------

RING_PREFIX = "step_"


def ring_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{RING_PREFIX}{step:06d}.pt"


def ring_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the ring's checkpoints, oldest first."""
    out = []
    for p in (Path(run_dir) / "checkpoints").glob(f"{RING_PREFIX}*.pt"):
        try:
            out.append((int(p.stem[len(RING_PREFIX):]), p))
        except ValueError:
            continue
    return sorted(out)


def dcp_dir(pt: Path) -> Path:
    """The sharded model and optimizer that go with the checkpoint file ``pt``: ``last.pt`` ->
    ``last_dcp/``, the ring's ``step_000040.pt`` -> ``step_000040_dcp/``."""
    return Path(pt).parent / f"{Path(pt).stem}_dcp"


def link_tree(src: Path, dest: Path) -> None:
    """``dest``: a directory of hard links to the files of ``src`` (copies where links are not
    possible), put in place by a rename, so the ring keeps a sharded checkpoint without a write."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_or_copy)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def save_to_ring(run_dir: Path, step: int, keep: int, sharded: bool = False) -> Path | None:
    """Add the checkpoint of ``step`` (last.pt, just written) to the ring and drop the oldest beyond ``keep``.

    last.pt is hard-linked into place (no second write), copied where links are not possible;
    either way through a temp file and a rename (atomic). ``sharded``: its model and optimizer
    are in :func:`dcp_dir` of it, linked along."""
    if keep <= 0:
        return None
    source = last_checkpoint(run_dir)
    if source is None:
        return None
    dest = ring_path(run_dir, step)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    try:
        if sharded:  # the directory first, so that the ring's file never lacks it
            link_tree(dcp_dir(source), dcp_dir(dest))
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:  # no hard links here: a copy (a full disk shows up now)
            shutil.copyfile(source, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _write_error(e, dest, f"{source} holds step {step}") from None
    for _, old in ring_checkpoints(run_dir)[:-keep]:
        _drop(old)
    return dest


def _drop(pt: Path) -> None:
    pt.unlink(missing_ok=True)
    shutil.rmtree(dcp_dir(pt), ignore_errors=True)


def drop_ring_after(run_dir: Path, step: int) -> None:
    """A rollback abandons the checkpoints after the step it restored."""
    for s, p in ring_checkpoints(run_dir):
        if s > step:
            _drop(p)


# --- what a run saves and restores ------------------------------------------------------------


class Checkpointer:
    """One run's checkpoints: ``checkpoints/last.pt`` (and under ``parallel=fsdp`` the sharded
    model and optimizer in ``last_dcp/`` beside it), the ring of the last ``keep`` checkpoints
    that rollbacks restore, and what resuming one checks first.

    A checkpoint holds the model, the optimizer, the weight average, the divergence watch, the
    monitors' state, every RNG, the resolved config, the optimizer's name and what the trainer
    passes as ``survival`` (its rollback bookkeeping), at ``step``. The trainer decides when to
    save and what a restored step means; this class knows where things are and how they are
    written: atomically, and only when every weight and optimizer tensor is finite."""

    def __init__(self, run_dir: Path, info, device: torch.device, *, model, optimizer, divergence, ema=None,
                 monitor=None, sharded: bool = False, keep: int = 0, config_yaml: str = "",
                 equivalent: dict | None = None, overrides=None):
        self.run_dir, self.dir, self.info, self.device = Path(run_dir), Path(run_dir) / "checkpoints", info, device
        self.model, self.optimizer, self.divergence, self.ema, self.monitor = model, optimizer, divergence, ema, monitor
        self.sharded, self.keep, self.config_yaml = sharded, keep, config_yaml
        self.overrides = None if overrides is None else list(overrides)
        self.equivalent = equivalent or {}
        # stored in each checkpoint: an optimizer's state does not carry over to another optimizer
        self.optim_name = optim_name_of(config_yaml) or type(optimizer).__name__
        self._identity = _identity(self.run_dir) if info.is_main else None

    def changed_keys(self, saved_yaml: str, allowed=RESUME_MAY_CHANGE) -> list[str]:
        """The keys a checkpoint's config sets otherwise than this run's, but those ``allowed`` to change."""
        return changed_keys(saved_yaml, self.config_yaml, allowed, self.equivalent)

    def fits(self, ck: dict) -> bool:
        """Whether ``ck``'s weights have this model's names and shapes (a sharded checkpoint's are
        not read here: taken to fit)."""
        theirs = ck.get("model")
        if self.sharded or not isinstance(theirs, dict):
            return True
        mine = self.model.state_dict()
        return theirs.keys() == mine.keys() and all(
            getattr(theirs[k], "shape", None) == getattr(v, "shape", None) for k, v in mine.items())

    def command_of(self, ck: dict, path: Path | None = None) -> str | None:
        """The command that continues the run that wrote ``ck`` (read from ``path``): its own
        overrides (saved in the checkpoint; None for a checkpoint without them), or a sweep
        point's sweep command. A checkpoint of another run's checkpoints/ is continued in that
        run's directory (resume=auto here would find nothing and start from step 0), one kept
        elsewhere in this directory by its path."""
        if sweep_dir() is not None:  # the command that made the point, not the one it is refusing
            return continue_with(self.run_dir, earlier=True)
        theirs = ck.get("overrides")
        if theirs is None or ("launcher" not in ck and self.info.world > 1):  # written before launchers were saved
            return None
        where, resume = self.run_dir, "auto"
        if path is not None and not Path(path).absolute().is_relative_to(self.run_dir.absolute()):
            if Path(path).parent.name == "checkpoints":
                where = Path(path).parent.parent
            else:
                resume = str(path)
        # the flags that chose its config (--config-name ...), saved beside its overrides
        return command(theirs, "hydra.run.dir", where, launcher=ck.get("launcher"), resume=resume,
                       flags=ck.get("config_flags"))

    def _changes_refused(self, path: Path, ck: dict, changed: list[str]) -> str:
        """Why resume=auto refuses ``changed`` keys, with their values there and here, and what to
        do: the run's own command; resume_allow_changes only where the weights still fit."""
        shown = self.changes_shown(ck, changed)
        theirs = self.command_of(ck, path)
        own = f"its own command, {theirs}" if theirs else "the overrides it was started with"
        done = (read_json(path.parent.parent / "summary.json") or {}).get("status") == "completed"
        fits = self.fits(ck)
        fix = (f"the run there completed at step {ck['step']} ({own}, with a larger steps=, trains it on)"
               if done else f"continue it with {own}")
        fix += ("; or pass resume_allow_changes=true to continue with the changes" if fits else
                "; this model's weights do not fit that checkpoint, so resume_allow_changes cannot help")
        fix += f"; a new run goes in another {own_dir_key()}" if done or not fits else ""
        return f"resume=auto would change the resumed run's {shown}: {fix}"

    def changes_shown(self, ck: dict, changed: list[str], at_most: int = 4) -> str:
        """``k (a there, b here), ...``: the first ``at_most`` changed keys with their values."""
        was, now = leaf_values(ck["config"]), leaf_values(self.config_yaml)
        shown = ", ".join(f"{k} ({spelled(was, k)} there, {spelled(now, k)} here)" for k in changed[:at_most])
        return shown + (f" and {len(changed) - at_most} more" if len(changed) > at_most else "")

    # --- saving ---------------------------------------------------------------------------

    def _payload(self, step: int, survival: dict) -> dict:
        """Everything but the model, the optimizer and the weight average."""
        return {"step": step, "rng": rng_state(), "divergence": self.divergence.state_dict(),
                "config": self.config_yaml, "overrides": self.overrides, "optim_name": self.optim_name,
                "launcher": launcher_of_this_job(),  # how the command that continues it starts
                "config_flags": config_flags(),
                "world": self.info.world,
                "survival": survival,
                "monitor": self.monitor.state_dict() if self.monitor is not None else {}}

    def save(self, step: int, survival: dict, ring: bool = False) -> bool:
        """Write last.pt (and with ``ring`` add it to the ring), unless a weight or optimizer
        tensor is not finite (a finite loss does not prove them finite): a finite last.pt is never
        replaced by a non-finite one. Returns whether it was written, the same on every rank."""
        gone = self.info.is_main and self._identity is not None and _identity(self.run_dir) != self._identity
        if D.broadcast_object(gone, self.info):  # its records went with it; a new one there is another run's
            raise RunDirGone(f"the run directory {self.run_dir} was deleted or moved while the run trained (or "
                             f"another took its place): stopped at step {step} without writing into it")
        ok = self._save_sharded(step, survival) if self.sharded else self._save_whole(step, survival)
        if ok and ring and self.info.is_main and self.keep > 0:
            save_to_ring(self.run_dir, step, self.keep, sharded=self.sharded)
        D.barrier(self.info)
        return ok

    def _save_whole(self, step: int, survival: dict) -> bool:
        ok = True
        if self.info.is_main:
            model, optim = self.model.state_dict(), self.optimizer.state_dict()
            # one fused reduction on the device, read back with the sync the save makes anyway
            ok = bool(all_finite(model, optim["state"]))
            if ok:
                ema = self.ema.state_dict() if self.ema is not None else None
                save_checkpoint(self.dir / "last.pt", {**self._payload(step, survival), "model": model,
                                                       "optimizer": optim, "ema": ema})
        return D.broadcast_object(ok, self.info)

    def _save_sharded(self, step: int, survival: dict) -> bool:
        """Every rank checks its shards and writes them through torch.distributed.checkpoint into
        ``last_dcp/``; rank 0 then writes the rest into last.pt, marked ``"dcp": True`` (its shards are
        the ``<stem>_dcp/`` beside it: a ring copy's are its own)."""
        from stabletrain.engine import sharding as S

        local = [S.local(t) for t in self.model.state_dict().values() if torch.is_tensor(t)]
        local += [S.local(v) for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        ok = S.all_finite_everywhere(all_finite(local))
        if ok:
            stepped = bool(self.optimizer.state)  # before its first step an optimizer has nothing to save
            S.save_dcp(self.dir, self.model, self.optimizer if stepped else None, step, self._ema_module)
            if self.info.is_main:
                ema = self.ema.counters() if self.ema is not None else None
                save_checkpoint(self.dir / "last.pt", {**self._payload(step, survival), "ema": ema,
                                                       "dcp": True, "dcp_optim": stepped})
                S.drop_previous_dcp(self.dir)
        return ok

    @property
    def _ema_module(self):
        return self.ema.module if self.ema is not None else None

    # --- finding and checking -------------------------------------------------------------

    def find(self, resume: str | None) -> Path | None:
        """The checkpoint ``resume`` names (``None`` or ``auto``: this run's last.pt), as rank 0 sees it."""
        path = last_checkpoint(self.run_dir) if resume in (None, "auto") else Path(resume)
        return D.broadcast_object(path, self.info)  # rank 0's view of the shared filesystem decides

    def load(self, path: Path) -> dict:
        """The payload of ``path``; a file that is no checkpoint is a one-line ConfigError."""
        try:
            return load_checkpoint(path, map_location=self.device)
        except Exception as e:  # a directory, a file that is no checkpoint, a torn write
            ring = ring_checkpoints(Path(path).parent.parent)
            mine = [k for k, p in ring if p == Path(path)]  # a torn ring checkpoint: one before it
            ring = [p for k, p in ring if k < mine[0]] if mine else [p for _, p in ring]
            fix = (f"resume={ring[-1]} (the newest ring checkpoint beside it)" if ring else
                   "pass a last.pt written by a run, or start a new run")
            raise ConfigError(f"resume={path}: not a readable checkpoint ({type(e).__name__}: {first_line(e)}); "
                              f"{fix}") from None

    def check_resumable(self, path: Path, ck: dict, *, auto: bool, requeued: bool, allow_changes: bool) -> None:
        """Refuse, in one line, to resume a checkpoint into a run it does not fit: another config
        (a requeued job), another optimizer, changed keys (``resume=auto`` unless
        ``allow_changes``), another ``parallel``."""
        changed = self.changed_keys(ck["config"], allowed=("resume",)) if requeued else []
        if changed:
            # keys a resume may change (a larger steps=) need only the resume asked for
            fix = ("resume=auto" if all(may_change(k) for k in changed) else
                   "resume=auto resume_allow_changes=true")
            raise ConfigError(f"{path} was written by a run with another {', '.join(changed[:8])}"
                              f"{' ...' if len(changed) > 8 else ''}; pass {fix} "
                              f"to continue it anyway, or give this run its own {own_dir_key()}")
        theirs = ck.get("optim_name") or optim_name_of(ck.get("config", ""))
        if theirs is not None and theirs != self.optim_name:
            own = self.command_of(ck, path)
            raise ConfigError(f"{path} was written with optim={theirs}, this run uses optim={self.optim_name}: an "
                              f"optimizer's state does not carry over; resume with optim={theirs}"
                              + (f" (its own command: {own})" if own else "") + ", or start a new run")
        if bool(ck.get("dcp")) != self.sharded:  # before the changed keys: resume_allow_changes cannot help
            def par(sharded):
                return "fsdp" if sharded else "ddp"

            raise ConfigError(f"{path} was written with parallel={par(ck.get('dcp'))}, this run uses "
                              f"parallel={par(self.sharded)}: resume it with the parallel it was written with")
        if auto and not allow_changes and ck.get("config") and self.config_yaml:
            changed = self.changed_keys(ck["config"])
            if changed:
                raise ConfigError(self._changes_refused(path, ck, changed))

    # --- restoring ------------------------------------------------------------------------

    def restore(self, path: Path, ck: dict) -> str | None:
        """Put checkpoint ``path`` (loaded as ``ck``) back: the model, the optimizer, the weight
        average, the divergence watch, the monitors and every RNG. The step and the survival
        state are the caller's (``ck["step"]``, ``ck.get("survival")``). Returns a note for the
        user when the checkpoint had to be repaired."""
        try:
            note = self._load_weights(path, ck)
        except (torch.OutOfMemoryError, ConfigError):
            raise
        except (RuntimeError, ValueError, KeyError) as e:  # load_state_dict's mismatches
            theirs = self.command_of(ck, path)
            fix = (f"resume it with the command it was written with, {theirs}" if theirs else
                   f"resume it with the config it was written with ({path.parent.parent / 'config.yaml'})")
            raise ConfigError(f"{path} does not fit this run's model or optimizer ({mismatch(e)}); {fix}") from None
        self.divergence.load_state_dict(ck["divergence"], step=ck["step"])
        set_rng_state(ck["rng"])
        if self.monitor is not None and ck.get("monitor"):
            self.monitor.load_state_dict(ck["monitor"])
        if self.ema is not None:
            self.ema.load_state_dict(ck.get("ema"), self.model)
        return note

    def _load_weights(self, path: Path, ck: dict) -> str | None:
        """The model and optimizer: from ``ck``, or from its DCP directory when sharded (with the
        weight average's model). The optimizer's settings stay this run's: loading a state dict
        puts the checkpoint's param-group values back, so a weight decay, betas or tau changed on
        resume (which config.yaml and the notes then claim) was silently dropped; its state (the
        moments, the step counts) is the checkpoint's. Returns a note when the shards were found
        elsewhere."""
        settings = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                    for g in self.optimizer.param_groups]  # the lr is the schedule's, set every step
        note = self._load_weights_and_state(path, ck)
        for group, own in zip(self.optimizer.param_groups, settings):
            group.update(own)
        return note

    def _load_weights_and_state(self, path: Path, ck: dict) -> str | None:
        if not self.sharded:
            self.model.load_state_dict(ck["model"])
            self.optimizer.load_state_dict(ck["optimizer"])
            return None
        from stabletrain.engine import sharding as S

        # a weight average added on resume has none saved: it starts from the loaded weights
        ema = self._ema_module if ck.get("ema") is not None else None
        stepped = ck.get("dcp_optim", True)
        found = []
        for shards in self._dcp_candidates(path):  # the same list on every rank: each load is collective
            saved_step = S.load_dcp(shards, self.model, self.optimizer if stepped else None, ema)
            if saved_step == ck["step"]:
                break
            found.append(f"{shards.name}/ holds step {saved_step}")
        else:
            ring = [p.name for s, p in ring_checkpoints(self.run_dir) if s <= ck["step"]]
            instead = (f"resume={path.parent / ring[-1]} (the newest ring checkpoint)" if ring
                       else "start a new run (no ring checkpoint to resume)")
            raise ConfigError(f"the sharded weights of {path} (step {ck['step']}) are not beside it "
                              f"({'; '.join(found) or f'no {dcp_dir(path).name}/'}): a kill or another run "
                              f"replaced them; {instead}")
        if not stepped:  # saved before the first step: the optimizer starts afresh, as it did then
            self.optimizer.load_state_dict({"state": {}, "param_groups": self.optimizer.state_dict()["param_groups"]})
        if shards == dcp_dir(path):
            return None
        # a kill in a save between its shards and last.pt: the previous shards become last.pt's
        # again, before a save could drop them
        if self.info.is_main:
            shutil.rmtree(dcp_dir(path), ignore_errors=True)
            shards.rename(dcp_dir(path))
        D.barrier(self.info)
        return (f"{path.name}'s shards were in {shards.name}/ (a save was cut off before its last.pt): "
                f"resumed from them, and moved them back to {dcp_dir(path).name}/")

    def _dcp_candidates(self, path: Path) -> list[Path]:
        """Where the shards of ``path`` may be: its own directory, and for last.pt the previous
        shards a cut-off save left (rank 0's view of the shared filesystem)."""
        from stabletrain.engine.sharding import previous_dcp

        found = [dcp_dir(path)]
        if path.name == "last.pt":
            found.append(previous_dcp(path.parent))
        return D.broadcast_object([p for p in found if (p / ".metadata").is_file()], self.info)

    def set_aside(self, dest: Path) -> Path | None:
        """A fresh run in a directory that holds an earlier run's checkpoints: move them to ``dest``
        (``checkpoints.previous/``, ...: :func:`stabletrain.engine.resume.set_aside_earlier_run`
        names it with the run's records), so that none is overwritten and no rollback restores one
        of them. Returns where they went, None where there was nothing to move (rank 0)."""
        if not self.dir.is_dir() or not any(self.dir.iterdir()):
            return None
        self.dir.rename(dest)
        return dest

    # --- the ring ---------------------------------------------------------------------------

    def ring_before(self, step: int) -> tuple[int, Path] | None:
        """``(step, path)`` of the newest ring checkpoint from before ``step``, as rank 0 sees it."""
        found = None
        if self.info.is_main:
            before = [(s, p) for s, p in ring_checkpoints(self.run_dir) if s < step]
            found = before[-1] if before else None
        return D.broadcast_object(found, self.info)

    def drop_after(self, step: int) -> None:
        """A rollback abandons the ring's checkpoints after the step it restored (rank 0)."""
        if self.info.is_main:
            drop_ring_after(self.run_dir, step)
