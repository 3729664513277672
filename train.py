"""stabletrain entry point: ``python train.py [group=option] [key=value] ...``.

Works as a plain process, under ``torchrun``, under ``srun``, and as a Hydra multirun
(``-m``, locally or on SLURM through submitit). Config mistakes are reported in one line.
"""

from __future__ import annotations

import contextlib
import io
import sys


_STARTED = []  # main() has begun: from there the run's own lines say what a Ctrl-C stopped


def _interrupted_while_starting(kind, value, tb) -> None:
    """A Ctrl-C in the seconds of imports and composition of a single run, before the run's own
    handlers: one line, not the traceback of whichever import it landed in (the process still ends
    by SIGINT). A sweep's (-m) is not said to be at the start: its points may be running."""
    if issubclass(kind, KeyboardInterrupt) and not _STARTED and sweep_flag(sys.argv) is None:
        print("\nerror: interrupted while starting, before training; run it again", file=sys.stderr)
        return
    _previous_hook(kind, value, tb)


_previous_hook, sys.excepthook = sys.excepthook, _interrupted_while_starting

from stabletrain.topology import sweep_flag  # noqa: E402 - the standard library's only

import hydra  # noqa: E402 - after the hook: importing torch takes seconds
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402

from stabletrain.cli import check_overrides, epochs_over_steps  # noqa: E402
from stabletrain.config import register  # noqa: E402
from stabletrain.engine.distributed import detect  # noqa: E402
from stabletrain.engine.rundir import KeptHydraRecord  # noqa: E402
from stabletrain.errors import fail  # noqa: E402
from stabletrain.run import main_guarded  # noqa: E402

register()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg) -> None:
    _STARTED.append(True)
    hc = HydraConfig.get()
    main_guarded(cfg, hc.runtime.output_dir, sweep=hc.mode == RunMode.MULTIRUN)


def follower_argv(argv: list[str]) -> list[str]:
    """Overrides for ranks > 0 of a DDP job: Hydra creates no directory and writes nothing.

    Each rank composes the config itself, and the default run dir is timestamped, so ranks
    started a second apart would each make their own; instead they compose into ``.`` (which
    exists) and use the directory rank 0 broadcasts (stabletrain.run).
    """
    mine = ("hydra.run.dir=", "hydra.output_subdir=", "hydra/job_logging=")
    kept = [a for a in argv if not a.lstrip("+~").startswith(mine)]
    return kept + ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none"]


if __name__ == "__main__":
    # -m after an override (train.py model=x -m lr=1,2) ends Hydra's argparse at the overrides after it
    sys.argv[1:] = epochs_over_steps(sorted(sys.argv[1:], key=lambda a: a not in ("-m", "--multirun")))
    args = sys.argv[1:]
    info = detect()
    if info.enabled and sweep_flag(args) is not None:
        fail("-m under torchrun/srun would run every sweep point on every rank; sweep with "
             "hydra/launcher=slurm (hydra.launcher.tasks_per_node=N) or call torchrun once per point")
    if info.rank > 0:
        with contextlib.redirect_stderr(io.StringIO()):  # rank 0 reports a bad override, once
            check_overrides(args)
        sys.argv[1:] = follower_argv(args)
    else:
        check_overrides(args)
    if any(a.lower() in ("dry_run=true", "+dry_run=true") for a in args) and not any(
            a.lstrip("+~").startswith("hydra.output_subdir=") for a in args):
        sys.argv.append("hydra.output_subdir=null")  # a dry run writes nothing: not Hydra's record either
    with KeptHydraRecord(sys.argv[1:]):  # a refused attempt leaves the run's own record
        main()
