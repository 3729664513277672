"""Launching training the way a cluster does, on one CPU machine: torchrun, fake SLURM tools."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import QUIET, ROOT

TORCHRUN = Path(sys.executable).with_name("torchrun")
GPT = ["model=gpt_test", "logger.log_every=1", "eval_every=1000", *QUIET]


def clean_env(**extra: str) -> dict:
    """This environment without launcher variables (the tests may themselves run under SLURM)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def torchrun_cmd(nproc: int, *overrides: str) -> list[str]:
    assert TORCHRUN.is_file(), f"torchrun not found beside {sys.executable}"
    return [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "train.py"), *overrides]


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{_failure(out.stderr)}"
    return out


def _failure(stderr: str) -> str:
    """The first worker's traceback (the cause) and the launcher's last words (its summary)."""
    first = stderr.find("Traceback")
    cause = stderr[first:first + 3000] + "\n[...]\n" if first >= 0 else ""
    return cause + stderr[-2000:]


def logged_step(run_dir: Path) -> int:
    """The last step with a training loss in ``run_dir/metrics.jsonl`` (0 when none yet)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "loss" in rec:
            steps.append(rec["step"])
    return max(steps)


def signal_once_running(proc: subprocess.Popen, run_dir: Path, sig: int, after_step: int,
                        pid_of=lambda p: p.pid, timeout: float = 180) -> int:
    """Send ``sig`` to ``pid_of(proc)`` once the run has logged ``after_step``; returns that pid."""
    deadline = time.monotonic() + timeout
    while logged_step(run_dir) < after_step:
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {after_step}"
        assert time.monotonic() < deadline, f"no step {after_step} within {timeout}s"
        time.sleep(0.02)
    pid = pid_of(proc)
    os.kill(pid, sig)
    return pid


def child_with_env(parent: int, key: str, value: str) -> int:
    """The child process of ``parent`` whose environment has ``key=value`` (e.g. RANK=1)."""
    want = f"{key}={value}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and want in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no child of {parent} with {key}={value}")


def fake_slurm_tools(bin_dir: Path, log: Path) -> dict:
    """``sbatch``, ``srun`` and ``scontrol`` stand-ins; returns an env with them first on PATH.

    sbatch answers like SLURM (job 4242) without running anything; scontrol prints a
    one-host node list as its host name and appends any other call's arguments to ``log``;
    srun exists only because submitit looks for it.
    """
    bin_dir.mkdir(parents=True, exist_ok=True)
    tools = {
        "sbatch": 'echo "Submitted batch job 4242"',
        "scontrol": f'if [ "$1" = show ]; then echo "$3"; else echo "$@" >> "{log}"; fi',
        "srun": 'echo "srun is not available in tests" >&2; exit 1',
    }
    for name, body in tools.items():
        p = bin_dir / name
        p.write_text(f"#!/bin/sh\n{body}\n")
        p.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def free_port(lo: int = 20000, hi: int = 40000) -> int:
    """A TCP port in [lo, hi) that nothing listens on now."""
    for port in random.sample(range(lo, hi), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise AssertionError("no free port")


def start(cmd: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """A process in its own session (a test can end it and all it started), output to ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)


def wait_ok(proc: subprocess.Popen, log: Path, timeout: int = 240, expect: int = 0) -> str:
    """Wait for ``proc``; its output, after checking its exit code."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    out = log.read_text()
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}:\n{out[-4000:]}"
    return out


def finish(message: str) -> None:
    """End a torchrun test script: free what holds collectives' work, then the group, then say so.

    Sharded parameters' gradients keep gloo work objects; left to the interpreter's exit they
    sometimes aborted a rank there ("terminate called without an active exception") after every
    check had passed. The caller's models must already be out of scope (built inside a function).
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    if dist.get_rank() == 0:
        print(message, flush=True)
    dist.destroy_process_group()
