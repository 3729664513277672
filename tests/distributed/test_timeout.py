"""A rank that stops answering (SIGSTOP, a hung node) ends the job within ``dist_timeout``
with one line on the ranks still running, and the job resumes from its last checkpoint."""

from __future__ import annotations

import os
import signal
import sys
import time

from tests.distributed.common import GPT, clean_env, fake_slurm_tools, free_port, signal_once_running
from tests.distributed.test_ddp import srun_like
from tests.helpers import ROOT


def _two_ranks(tmp_path, dist_timeout: int):
    """Two ranks of a long run under a stand-in SLURM: (their processes, their logs, the run dir)."""
    run_dir = tmp_path / "run"
    args = [*GPT, "batch_size=16", "steps=400", "ckpt_every=2", f"dist_timeout={dist_timeout}",
            f"hydra.run.dir={run_dir}"]
    job = str(free_port() - 20000)
    env = clean_env(**fake_slurm_tools(tmp_path / "bin", tmp_path / "scontrol.log"), SLURM_JOB_ID=job,
                    SLURM_JOB_NODELIST="localhost")
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    return srun_like(2, [sys.executable, str(ROOT / "train.py"), *args], tmp_path, env, logs), logs, run_dir


def test_a_stopped_rank_ends_the_job_with_one_line(tmp_path):
    ranks, logs, run_dir = _two_ranks(tmp_path, dist_timeout=5)
    try:
        signal_once_running(ranks[1], run_dir, signal.SIGSTOP, after_step=3)
        stopped_at = time.monotonic()
        code = ranks[0].wait(timeout=120)
        waited = time.monotonic() - stopped_at
    finally:
        for p in ranks:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    out = logs[0].read_text()
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1, out[-3000:]
    assert "rank 0: a collective waited dist_timeout=5 s" in errors[0] and "resume=auto" in errors[0]
    assert waited < 60
    assert (run_dir / "checkpoints" / "last.pt").is_file()


def test_a_killed_rank_ends_the_job_with_one_line(tmp_path):
    """SIGKILL of rank 1: rank 0 met gloo's "Connection closed by peer" in a collective and ended
    in Hydra's traceback, without the resume hint a stopped rank gets."""
    ranks, logs, run_dir = _two_ranks(tmp_path, dist_timeout=60)
    try:
        signal_once_running(ranks[1], run_dir, signal.SIGKILL, after_step=3)
        code = ranks[0].wait(timeout=120)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = logs[0].read_text()
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert "rank 0: another rank went away in a collective (killed or crashed" in errors[0], errors[0]
    assert errors[0].endswith("the job ends here, and resume=auto continues it from its last checkpoint")
    assert (run_dir / "checkpoints" / "last.pt").is_file()


def test_a_config_error_found_while_building_is_printed_once(tmp_path):
    """A data file that fails while every rank builds: one line from rank 0, exit 2 on both."""
    (tmp_path / "train.bin").write_bytes(b"\x01\x02\x03")  # not a whole number of uint16 tokens
    (tmp_path / "val.bin").write_bytes(b"\x01\x02\x03\x04")
    job = str(free_port() - 20000)
    env = clean_env(**fake_slurm_tools(tmp_path / "bin", tmp_path / "scontrol.log"), SLURM_JOB_ID=job,
                    SLURM_JOB_NODELIST="localhost")
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    cmd = [sys.executable, str(ROOT / "train.py"), *GPT, "data=tokens", f"data.path={tmp_path / 'train.bin'}",
           f"hydra.run.dir={tmp_path / 'run'}"]
    ranks = srun_like(2, cmd, tmp_path, env, logs)
    codes = [p.wait(timeout=120) for p in ranks]
    errors = [[ln for ln in log.read_text().splitlines() if ln.startswith("error:")] for log in logs]
    assert codes == [2, 2], [log.read_text()[-2000:] for log in logs]
    assert len(errors[0]) == 1 and "train.bin" in errors[0][0] and errors[1] == []
