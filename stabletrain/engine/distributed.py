"""Process topology from the launcher's environment (torchrun, or srun under SLURM)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; srun sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID."""
    env = os.environ
    if "WORLD_SIZE" in env:
        return DistInfo(int(env.get("RANK", 0)), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env and "MASTER_ADDR" in env:
        return DistInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)))
    return DistInfo()


def init(info: DistInfo, device: torch.device) -> None:
    if not info.enabled or dist.is_initialized():
        return
    os.environ.setdefault("RANK", str(info.rank))
    os.environ.setdefault("WORLD_SIZE", str(info.world))
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world)


def broadcast_object(obj, info: DistInfo):
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
