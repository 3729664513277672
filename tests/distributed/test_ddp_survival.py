"""Surviving a spike under DDP: both ranks skip the same NaN step and roll back together (no hang),
with the numbers of one process."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.common import GPT, run, torchrun_cmd
from tests.distributed.test_ddp import assert_same_training
from tests.helpers import losses, train

SPIKE = ["steps=12", "divergence.action=rollback", "divergence.max_skips=2", "ckpt_every=4",
         "debug.nan_at_step=6", "batch_size=16"]


def test_two_ranks_skip_and_roll_back_like_one_process(tmp_path):
    ddp = tmp_path / "ddp"
    run(torchrun_cmd(2, *GPT, *SPIKE, f"hydra.run.dir={ddp}"), cwd=tmp_path)
    train(tmp_path / "one", *GPT, *SPIKE)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (ddp, tmp_path / "one"))
    assert a["status"] == b["status"] == "completed"
    assert a["rollbacks"] == b["rollbacks"] and len(a["rollbacks"]) == 0  # one NaN < max_skips: skipped only
    wa, wb = (torch.load(d / "checkpoints/last.pt", weights_only=True)["model"] for d in (ddp, tmp_path / "one"))
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-7, msg=k)
    la, lb = losses(ddp), losses(tmp_path / "one")
    assert la[6] == lb[6] == "nan"  # the skipped step's record: no healthy step to average
    assert all(la[s] == pytest.approx(lb[s], rel=1e-5) for s in lb if s != 6)
    skipped = [json.loads(x).get("train/skipped_steps") for x in (ddp / "metrics.jsonl").read_text().splitlines()]
    assert skipped.count(1) == 1


def test_two_ranks_roll_back_together(tmp_path):
    ddp = tmp_path / "ddp"
    run(torchrun_cmd(2, *GPT, *SPIKE, "divergence.max_skips=1", f"hydra.run.dir={ddp}"), cwd=tmp_path)
    train(tmp_path / "one", *GPT, *SPIKE, "divergence.max_skips=1")
    a, b = (json.loads((d / "summary.json").read_text()) for d in (ddp, tmp_path / "one"))
    assert a["status"] == b["status"] == "completed"
    assert a["rollbacks"] == b["rollbacks"] and a["rollbacks"][0]["restored_step"] == 4
    assert_same_training(ddp, tmp_path / "one")
