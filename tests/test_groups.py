"""Every option of every config group composes and trains a tiny model of each family."""

import math

import numpy as np
import pytest
from PIL import Image

from tests.helpers import ROOT, losses, make_cfg, train

FAMILIES = {"vit": "vit_test", "swin": "swin_test", "gpt": "gpt_test"}
# norm/attention/reparam/init/deescalate are covered in full product by tests/layers.
GROUPS = ["optim", "schedule", "regularizer", "monitor", "logger"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((ROOT / "configs" / g).glob("*.yaml"))]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("group,option", OPTIONS)
def test_group_option_trains(tmp_path, group, option, family):
    extra = ["logger.wandb=disabled"] if group == "logger" else []
    s = train(tmp_path, f"model={FAMILIES[family]}", f"{group}={option}", *extra, "steps=3", "batch_size=4",
              "eval_every=3", "eval_batches=1", "logger.log_every=1", "schedule.milestones=[1]",
              "monitor.weight_every=2", "monitor.probe_every=2", "monitor.probe_batch_size=2")
    assert s["status"] == "completed"
    assert all(math.isfinite(v) for v in losses(tmp_path).values())


def test_wandb_offline_by_default(tmp_path):
    assert make_cfg().logger.wandb == "offline"
    train(tmp_path, "model=gpt_test", "logger=default", "steps=2", "batch_size=4", "eval_every=1000", quiet=False)
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline wandb run written"


def test_imagefolder(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            d = tmp_path / "data" / split / c
            d.mkdir(parents=True)
            for i in range(4):
                Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(d / f"{i}.png")
    s = train(tmp_path / "run", "model=vit_test", "data=imagefolder", f"data.root={tmp_path / 'data'}",
              "data.num_workers=0", "steps=2", "batch_size=4", "eval_every=2", "data.mixup=0.8")
    assert s["status"] == "completed" and "val/acc" in s["final"]


def test_gpt_learns_the_embedded_text(tmp_path):
    s = train(tmp_path, "model=gpt_test", "steps=150", "batch_size=16", "optim=adamw", "optim.lr=3e-3",
              "eval_every=150", "eval_batches=4")
    assert s["final"]["val/loss"] < 0.6 * math.log(256)  # uniform over bytes is ln 256 = 5.55
