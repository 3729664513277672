"""Process topology from the launcher's environment, and the few collectives the loop needs.

One process per device. torchrun sets RANK/WORLD_SIZE/LOCAL_RANK and the rendezvous address;
srun (one task per GPU, also how submitit starts multi-task jobs) sets SLURM_PROCID,
SLURM_STEP_NUM_TASKS and SLURM_LOCALID, and the rendezvous address is derived here from the
step's node list. Everything else in a DDP run needs no communication beyond DDP's gradient
all-reduce: see docs/distributed.md for which numbers are identical on every rank and why.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import shutil
import signal
import subprocess

import torch
import torch.distributed as dist

from stabletrain.errors import ConfigError
from stabletrain.topology import DistInfo, detect  # noqa: F401  (re-exported: the loop's view of the job)

DEFAULT_PORT = 29500
_cpu_group = None  # a gloo group for host-side flags when the main backend is NCCL

def pick_device(name: str, info: DistInfo) -> torch.device:
    """The device this process trains on: ``auto`` is a CUDA GPU if one is visible, and
    ``cuda`` is this rank's (its local rank modulo the visible GPUs)."""
    asked = name
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{info.local_rank % max(1, torch.cuda.device_count())}"  # one GPU per task too
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={asked} but no CUDA GPU is visible; use device=cpu or device=auto")
        if dev.index >= (n := torch.cuda.device_count()):
            raise ConfigError(f"device={asked} but {n} GPU(s) are visible (cuda:0 to cuda:{n - 1}); use device=cuda, "
                              f"which picks this rank's GPU")
        torch.cuda.set_device(dev)
    return dev


def under_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


def under_submitit() -> bool:
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def may_be_requeued() -> bool:
    """Whether a scheduler may start this same job again after a preemption or time limit."""
    return under_slurm() or under_submitit()


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``scontrol show hostnames`` when there is one, else
    the simple forms ``node07``, ``gpu[03-06,9]`` and ``a1,b2`` are read here."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=30, check=True).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR")
    prefix, ranges = m.groups()
    return prefix if ranges is None else prefix + re.split(r"[-,]", ranges)[0]


def slurm_rendezvous(env=os.environ) -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT for a job started by srun, unless the user set them.

    The port is derived from the job id so that two jobs sharing a node do not collide;
    every task of one job computes the same value.
    """
    out = {}
    if "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise RuntimeError("srun started several tasks but SLURM_JOB_NODELIST is unset; set MASTER_ADDR")
        out["MASTER_ADDR"] = first_host(nodes)
    if "MASTER_PORT" not in env:
        job = re.sub(r"\D", "", env.get("SLURM_JOB_ID", ""))
        out["MASTER_PORT"] = str(20000 + int(job) % 20000 if job else DEFAULT_PORT)
    return out


def init(info: DistInfo, device: torch.device, timeout_s: float | None = None) -> None:
    """Join the process group: NCCL on GPUs, gloo on CPU. ``timeout_s``: how long a collective
    waits for the other ranks before it fails (``dist_timeout``), so a stopped or hung rank
    ends the job with torch's timeout error (:func:`stabletrain.run.main_guarded` says which rank
    to look at) instead of leaving the others waiting."""
    global _cpu_group
    if not info.enabled or dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # srun: torch's env:// rendezvous reads these
        os.environ.update(slurm_rendezvous())
        os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world), LOCAL_RANK=str(info.local_rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(DEFAULT_PORT))
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world, **kwargs)
    _cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None


def broadcast_object(obj, info: DistInfo):
    """Rank 0's ``obj`` on every rank (picklable objects, sent once)."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_cpu_group)
    return box[0]


def agree_on_signal(signum: int | None, info: DistInfo) -> int | None:
    """The stop signal any rank has caught, on every rank, so all stop after the same step.

    A signal can reach the ranks at different moments (or only some of them); stopping on
    local knowledge would leave the others waiting in the next step's all-reduce. This is a
    host-side all-reduce of one integer on a gloo group: it never waits for the GPU.
    """
    if not info.enabled:
        return signum
    flag = torch.tensor([signal_rank(signum)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_cpu_group)
    return int(flag.item()) % 256 or None


def signal_rank(signum: int | None) -> int:
    """An order on stop signals, the signal in its low byte: where ranks caught different ones, the
    largest wins. A preemption warning (SIGUSR1/2: checkpoint, then requeue) outranks SIGTERM and
    SIGINT (checkpoint and stop), so that no requeue is lost to another rank's plain stop."""
    if not signum:
        return 0
    usr = [getattr(signal, n) for n in ("SIGUSR1", "SIGUSR2") if hasattr(signal, n)]
    priority = 3 if signum in usr else 2 if signum == signal.SIGTERM else 1
    return priority * 256 + int(signum)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier(group=_cpu_group)


def shutdown(info: DistInfo) -> None:
    """Destroy the process groups, after the garbage that may hold their work: sharded
    parameters' gradients keep collectives' work objects, and one destroyed at the
    interpreter's exit instead aborted the rank now and then, after a run that had succeeded."""
    global _cpu_group
    if info.enabled and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
    _cpu_group = None


def is_timeout(err: BaseException) -> bool:
    """A collective that gave up waiting for another rank (gloo's and NCCL's wordings)."""
    text = f"{type(err).__name__}: {err}".lower()
    return isinstance(err, (RuntimeError, dist.DistError)) and ("timed out" in text or "timeout" in text)


_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote process exited", "ncclremoteerror", "socket closed")


def is_peer_gone(err: BaseException) -> bool:
    """A collective whose other end went away (a rank killed or crashed): gloo's "Connection
    closed by peer", NCCL's remote error."""
    text = f"{type(err).__name__}: {err}".lower()
    return isinstance(err, (RuntimeError, dist.DistError)) and any(w in text for w in _PEER_GONE)
