"""Never lose a run (#18): finite checkpoints, completing a run whose steps are done, resume checks."""

import json

import torch

from tests.helpers import train

GPT = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger.log_every=1"]


def _finite(state) -> bool:
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_finite(v) for v in state)
    return True


def test_a_checkpoint_never_holds_non_finite_weights_or_optimizer_state(tmp_path):
    """lr=1000 makes the weights and Adam's moments non-finite at step 4 while the loss is still
    finite (it turns NaN at step 5): last.pt must keep the finite step-0..3 state, not step 4's."""
    s = train(tmp_path, "model=gpt_test", "optim=adamw", "optim.lr=1000", "warmup=0", "steps=200", "ckpt_every=4")
    assert s["status"] == "diverged" and "non-finite weights" in s["reason"] and s["step"] == 4
    assert not (tmp_path / "checkpoints/last.pt").exists()  # step 4's was the first: none is better than NaN
    t = train(tmp_path / "two", "model=gpt_test", "optim=adamw", "optim.lr=1000", "warmup=0", "steps=200",
              "ckpt_every=2")
    assert t["status"] == "diverged" and t["diverged_at"] == 4
    state = torch.load(tmp_path / "two/checkpoints/last.pt", weights_only=True)
    assert state["step"] == 2 and _finite(state["model"]) and _finite(state["optimizer"]["state"])
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "diverged"
