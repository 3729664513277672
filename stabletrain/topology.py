"""This process's place in a job (rank, world size, local rank), from the launcher's environment.

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; srun (one task per GPU, also how submitit starts
multi-task jobs) sets SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_LOCALID. Reading them needs
no torch, so the config layer can ask too (only rank 0 writes Hydra's files).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def detect() -> DistInfo:
    """This process's place in the job, from torchrun's or srun's environment."""
    env = os.environ
    if "WORLD_SIZE" in env:  # torchrun, including one torchrun per node started by srun
        return DistInfo(int(env.get("RANK", 0)), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    # srun sets SLURM_STEP_NUM_TASKS for the tasks it starts; a batch script also sees
    # SLURM_NTASKS and SLURM_PROCID=0 but is one process, so it must not count as rank 0 of N.
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1"))
    if tasks > 1 and "SLURM_PROCID" in env:
        return DistInfo(int(env["SLURM_PROCID"]), tasks, int(env.get("SLURM_LOCALID", 0)))
    return DistInfo()


def sweep_flag(argv: list[str]) -> str | None:
    """What in these arguments launches a Hydra sweep, as given: ``-m``, ``--multirun`` or
    ``hydra.mode=MULTIRUN`` (or ``RunMode.MULTIRUN``, which Hydra takes too); None for one run."""
    for a in argv:
        key, _, value = a.lstrip("+").partition("=")
        if a in ("-m", "--multirun") or (key.strip() == "hydra.mode" and value.strip() in ("MULTIRUN",
                                                                                        "RunMode.MULTIRUN")):
            return a
    return None
