"""DDP on CPU (gloo) under torchrun and srun: one process's numbers, one run dir, stop and resume together.

Tolerance: data is step-indexed and DDP averages the ranks' gradients, so two ranks of 32
compute the same step as one process of 64 up to float32 summation order; losses and weights
agree to 1e-5 relative (observed: ~1e-7).
"""

from __future__ import annotations

import signal
import sys

import pytest
import torch

from tests.distributed.common import GPT, clean_env, fake_slurm_tools, free_port, run, signal_once_running, \
    start, torchrun_cmd, wait_ok
from tests.helpers import ROOT, losses, train

REL = 1e-5


def _weights(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def assert_same_training(ddp_dir, one_dir):
    a, b = _weights(ddp_dir), _weights(one_dir)
    assert a["step"] == b["step"]
    for k, w in b["model"].items():
        torch.testing.assert_close(a["model"][k], w, rtol=REL, atol=1e-7, msg=k)
    la, lb = losses(ddp_dir), losses(one_dir)
    assert sorted(la) == sorted(lb)
    for s in lb:
        # The logged loss must be the global batch's, not rank 0's half of it.
        assert la[s] == pytest.approx(lb[s], rel=REL), f"step {s}: DDP logged {la[s]}, one process {lb[s]}"


def test_torchrun_two_ranks_match_one_process_in_one_run_dir(tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    # A plain torchrun command, with the default timestamped run dir under the working directory.
    run(torchrun_cmd(2, "model=gpt_test", "steps=5", *GPT), cwd=work)
    made = sorted(p for p in (work / "outputs").glob("*/*"))
    assert [p.name for p in work.iterdir()] == ["outputs"], "a rank > 0 wrote into the working directory"
    assert len(made) == 1, f"ranks disagreed on the run dir: {made}"
    ddp = made[0]
    assert (ddp / ".hydra" / "config.yaml").is_file() and (ddp / "summary.json").is_file()

    train(tmp_path / "one", "model=gpt_test", "steps=5", *GPT)
    assert_same_training(ddp, tmp_path / "one")


def srun_like(ntasks: int, cmd: list[str], cwd, env: dict, logs) -> list:
    """What ``srun --ntasks=N cmd`` starts on one node: N processes told their place by SLURM."""
    return [start(cmd, cwd, {**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NTASKS": str(ntasks),
                             "SLURM_STEP_NUM_TASKS": str(ntasks)}, logs[r]) for r in range(ntasks)]


def test_srun_ranks_stop_together_on_one_signal_and_torchrun_resumes_identically(tmp_path):
    ddp = tmp_path / "ddp"
    # A constant schedule makes the horizon irrelevant: the resumed run can end soon after the stop.
    args = [*GPT, "batch_size=16", "schedule=constant", "ckpt_every=1000"]
    here = f"hydra.run.dir={ddp}"
    requeues = tmp_path / "scontrol.log"
    job = str(free_port() - 20000)  # the rendezvous port is derived from the job id
    env = clean_env(**fake_slurm_tools(tmp_path / "bin", requeues), SLURM_JOB_ID=job, SLURM_JOB_NODELIST="localhost")
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    ranks = srun_like(2, [sys.executable, str(ROOT / "train.py"), *args, here, "steps=400"], tmp_path, env, logs)
    # Only rank 1 is warned: rank 0 must learn it through the stop-flag all-reduce, or the two
    # would part ways at the next gradient all-reduce.
    signal_once_running(ranks[1], ddp, signal.SIGUSR1, after_step=3)
    for proc, log in zip(ranks, logs):
        wait_ok(proc, log)
    k = _weights(ddp)["step"]
    assert 3 <= k < 400
    summary = (ddp / "summary.json").read_text()
    assert '"interrupted"' in summary and "SIGUSR1" in summary
    assert requeues.read_text().split() == ["requeue", job]  # by rank 0, once

    total = k + 4
    run(torchrun_cmd(2, *args, here, f"steps={total}", "resume=auto"), cwd=tmp_path)
    assert _weights(ddp)["step"] == total
    train(tmp_path / "one", *args, f"steps={total}")
    assert_same_training(ddp, tmp_path / "one")
