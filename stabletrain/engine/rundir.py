"""The run directory's lock: one process (rank 0 of one job) trains in a run directory at a time.

``fcntl.flock`` on ``run_dir/.lock``, held while the run lasts. The kernel releases it when the
holder exits however it exits, so a killed run leaves no stale lock; the holder's pid is written
into the file for the refusal message.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from stabletrain.errors import ConfigError
from stabletrain.topology import sweep_flag

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None


def sweep_dir() -> Path | None:
    """The sweep directory when this process trains a point of a Hydra multirun, else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return Path(HydraConfig.get().sweep.dir).resolve()
    except Exception:  # no Hydra (the Python API), or a config without the field
        return None
    return None


def task_overrides() -> tuple[str, ...] | None:
    """The command-line overrides of this process's Hydra job (a sweep point's own values), with
    the ``hydra.*`` ones that its config needs (``hydra.searchpath`` finds options of the user's
    own, ``hydra/launcher`` runs a sweep on SLURM); None outside Hydra (the Python API). Saved
    in checkpoints: a refused resume names the command that fits."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            o = HydraConfig.get().overrides
            return _own(o.hydra) + tuple(str(x) for x in o.task)
    except Exception:
        pass
    return None


# overrides that name where a run lives or how it starts, not what it trains
_NOT_THE_RUN = ("hydra.run.dir=", "hydra.sweep.dir=", "hydra.mode=", "resume=", "hydra.output_subdir=",
                "hydra/job_logging=")


def _own(hydra_overrides) -> tuple[str, ...]:
    """The ``hydra.*`` overrides a command was given, less those that place the run (Hydra lists
    its mode and directory among them)."""
    return tuple(str(x) for x in hydra_overrides if not str(x).lstrip("+~").startswith(_NOT_THE_RUN))


def interpreter() -> str:
    """``python`` where that is this interpreter (an active venv), else this interpreter's path:
    a hint run as printed must find torch and Hydra."""
    found = shutil.which("python")
    # the same folder, not the same file: a venv's python links to the system's
    if found and sys.executable and os.path.dirname(os.path.abspath(found)) == os.path.dirname(sys.executable):
        return "python"
    return sys.executable or "python"


def command(overrides, dir_key: str, dir_value, *, multirun: bool = False, launcher: str | None = None,
            resume: str = "auto", flags: list[str] | None = None) -> str:
    """``python train.py OVERRIDES resume=auto DIR_KEY=DIR``, quoted for a POSIX shell: this
    interpreter, and train.py as the user named it; ``launcher`` (``torchrun ...``) in place
    of the interpreter; ``resume`` a checkpoint's path in place of auto; ``flags`` the run's
    :func:`config_flags` (None: this process's)."""
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith("train.py") else "train.py"
    kept = [o for o in overrides if not o.lstrip("+~").startswith(_NOT_THE_RUN)]
    flags = config_flags() if flags is None else flags
    args = [script, *flags, *(["-m"] if multirun else []), *kept, f"resume={resume}", f"{dir_key}={dir_value}"]
    return " ".join([launcher or shlex.quote(interpreter()), *(shlex.quote(a) for a in args)])


def config_flags() -> list[str]:
    """``--config-path``, ``--config-name`` and ``--config-dir`` where this process was started
    with them (Hydra keeps them among its config sources and job, not among the overrides): a
    continue command needs the config they chose and the options they hold."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        sources, name = hc.runtime.config_sources, hc.job.config_name
    except Exception:  # no Hydra run in this process (a library call, a test)
        return []
    flags = []
    own = Path(__file__).resolve().parents[2] / "configs"
    main = [str(s.path) for s in sources if s.provider == "main" and s.schema == "file"]
    if main and Path(main[0]).resolve() != own:
        flags += ["--config-path", main[0]]
    if name and name != "train":
        flags += ["--config-name", str(name)]
    given = [str(s.path) for s in sources if s.provider == "command-line" and s.schema == "file"]
    return flags + (["--config-dir", given[0]] if given else [])


def figures_command(run_dir: str | Path) -> str | None:
    """The command that draws a run's figures (scripts/plot_dynamics.py of this checkout)."""
    return script_command("plot_dynamics.py", run_dir)


def script_command(name: str, *paths: str | Path) -> str | None:
    """The command that runs ``scripts/<name>`` of this checkout on ``paths``, with the interpreter
    that has this run's packages, its paths relative to the working directory where they lie under
    it; None where the scripts are not beside the package (installed from a wheel)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / name
    if not script.is_file():
        return None

    def short(p: Path) -> str:
        p = Path(p).absolute()
        return str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else str(p)

    python = interpreter()
    python = short(Path(python)) if os.path.isabs(python) else python  # a venv's, from its checkout
    return " ".join(shlex.quote(a) for a in (python, short(script), *(short(Path(p)) for p in paths)))


def launcher_of_this_job() -> str | None:
    """How a command starts this job again: ``torchrun --standalone --nproc_per_node=N`` on one
    node, with a placeholder for the rendezvous of several; ``srun <its options> python``.
    None for a single process."""
    from stabletrain.topology import detect

    info, env = detect(), os.environ
    if info.world == 1:
        return None
    if "TORCHELASTIC_RUN_ID" in env or "LOCAL_WORLD_SIZE" in env:
        local = int(env.get("LOCAL_WORLD_SIZE", info.world))
        return (f"torchrun --standalone --nproc_per_node={local}" if local == info.world else
                f"torchrun --nnodes={info.world // local} --nproc_per_node={local} <its rendezvous options>")
    return f"srun <its options> {shlex.quote(interpreter())}"


# A sweep run again into its directory: Hydra rewrites multirun.yaml and each point's .hydra/
# before a point can refuse the new command (a resume that would change it). What they held is
# kept beside them while the sweep runs (run.SweepReport) and put back for a refused point.
KEPT_HYDRA, KEPT_MULTIRUN, REFUSED_NOW = ".hydra.kept", ".multirun.kept.yaml", ".refused_now"


def folders_to_make(path: str | Path) -> list[Path]:
    """The folders that making ``path`` would create, outermost first (``outputs/<date>`` and its run
    folder for the day's first run); empty where ``path`` exists. Each prefix of the path as
    written counts, since Hydra's makedirs walks ``a/../b`` through ``a`` as well as making ``b``."""
    made, prefix = [], Path()
    for part in Path(path).parts:
        prefix = prefix / part
        folder = Path(os.path.abspath(prefix))
        if not folder.exists() and folder not in made:
            made.append(folder)
    return made


def remove_made(made: list[Path]) -> None:
    """Remove the folders :func:`folders_to_make` found missing before they were made, deepest
    first, each only while empty: a dry run leaves no empty dated folders behind."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:  # not empty (another run's), or gone
            pass


def _sweep_overrides(sweep: Path, earlier: bool = False) -> list[str] | None:
    """The sweep's own command-line overrides (comma lists and all), from its multirun.yaml
    (``earlier``: the one this invocation found, where it kept it)."""
    try:
        import yaml

        found = sweep / KEPT_MULTIRUN
        given = yaml.safe_load((found if earlier and found.is_file() else sweep / "multirun.yaml").read_text())
        given = given["hydra"]["overrides"]
        return [*_own(given.get("hydra") or []), *(str(o) for o in given["task"])]
    except Exception:  # not written (another launcher), unreadable
        return None


def continue_with(run_dir: str | Path, overrides=None, earlier: bool = False) -> str:
    """The command that continues the run in ``run_dir``, started with ``overrides``. A sweep
    point is continued by running its sweep again into the same directory: finished points stay
    as they are, the others go on (``earlier``: the sweep command that ran before this one, for
    a point that refuses this one). Under torchrun or srun it starts with the launcher, its
    options beyond the process count left to the user (:func:`launcher_of_this_job`)."""
    sweep = sweep_dir()
    if sweep is not None:
        ov = _sweep_overrides(sweep, earlier)
        return (command(ov, "hydra.sweep.dir", sweep, multirun=True) if ov is not None
                else f"the sweep's command plus resume=auto hydra.sweep.dir={sweep}")
    if overrides is not None:
        return command(overrides, "hydra.run.dir", run_dir, launcher=launcher_of_this_job())
    return f"the run's command plus resume=auto hydra.run.dir={run_dir}"


def own_dir_key() -> str:
    """The override that gives a run (or a sweep, for its points) a directory of its own."""
    return "hydra.sweep.dir" if sweep_dir() is not None else "hydra.run.dir"


class KeptHydraRecord:
    """Hydra writes ``.hydra/`` (the overrides and config of this attempt) before the run checks
    them; an attempt refused in an existing run directory (a resume that would change the run)
    must not leave its overrides as the run's, which the sweep table and run labels read. Entered
    around Hydra's main with the process's arguments: on exit code 2 (a refusal), the directory's
    earlier ``.hydra/`` is put back."""

    def __init__(self, argv: list[str]):
        given = [a.split("=", 1)[1].strip("'\"") for a in argv if a.lstrip("+~").startswith("hydra.run.dir=")]
        record = Path(given[-1]) / ".hydra" if given and "${" not in given[-1] else None
        self.record = record if record is not None and record.is_dir() and sweep_flag(argv) is None else None
        self.files: dict[str, bytes] = {}

    def __enter__(self) -> KeptHydraRecord:
        if self.record is not None:
            self.files = {p.name: p.read_bytes() for p in self.record.iterdir() if p.is_file()}
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if self.record is None or kind is not SystemExit or exc.code != 2:
            return
        for p in self.record.iterdir() if self.record.is_dir() else ():
            if p.is_file() and p.name not in self.files:
                p.unlink()
        self.record.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            (self.record / name).write_bytes(data)


_CLAIMED: list[int] = []  # locks taken by RunDirLock.claim, which acquire() in this process takes over


class RunDirLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".lock"
        self.fd: int | None = None

    def acquire(self) -> "RunDirLock":
        if fcntl is None:
            return self
        fd = self._claimed()
        if fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._lock_or_refuse(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def claim(self) -> None:
        """Take the lock before Hydra writes the run's ``.hydra/`` (run.ClaimRunDir): a second run
        started into the same new directory a moment later would otherwise rewrite the first one's
        record before the first one's :meth:`acquire`, and only then be refused. That acquire, in
        this process, takes the claimed lock over."""
        self.acquire()
        if self.fd is not None:
            _CLAIMED.append(self.fd)
            self.fd = None

    def release_claim(self) -> None:
        """Release a claim no run took over (one refused before it trained), removing the run
        directory where :meth:`unused`."""
        self.fd = self._claimed()
        if self.fd is not None:
            self.release_and_remove_unused()

    def _claimed(self) -> int | None:
        try:
            here = os.stat(self.path)
        except OSError:
            return None
        for fd in _CLAIMED:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
                _CLAIMED.remove(fd)
                return fd
        return None

    def check_free(self) -> None:
        """Refuse, as :meth:`acquire` would, while another run holds the lock; takes nothing.
        Checked before Hydra writes the run's ``.hydra/``, which would overwrite the running one's."""
        if fcntl is None or not self.path.is_file():
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        self._lock_or_refuse(fd)
        os.close(fd)  # releases it

    def _lock_or_refuse(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"{self.path.parent} is in use by another run (pid {holder} holds {self.path}); "
                              f"wait for it to end or give this run its own {own_dir_key()}") from None

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # names no process that has ended
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None

    def unused(self) -> bool:
        """Whether the run directory holds nothing but Hydra's ``.hydra/`` and this lock: a run
        refused while it was built leaves no directory to mistake for one that ran."""
        return all(p.name in (".hydra", ".lock") for p in self.path.parent.iterdir())

    def release_and_remove_unused(self) -> None:
        """Release; then remove the run directory where :meth:`unused` (held, so no other run is in it)."""
        run_dir = self.path.parent
        unused = self.fd is not None and self.unused()
        self.release()
        if unused:
            shutil.rmtree(run_dir, ignore_errors=True)
