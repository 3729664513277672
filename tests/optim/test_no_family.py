"""build_optimizer / classify on an nn.Module of one's own with no registered family (family=None)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stabletrain.config import OptimConfig
from stabletrain.models.registry import DEFAULT_TAU
from stabletrain.optim import AdamW2, build_optimizer, classify


class Plain(nn.Module):
    def __init__(self, own_no_decay: bool = False):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.table = nn.Parameter(torch.randn(3, 8))  # a matrix that is not a layer's weight
        self.head = nn.Linear(8, 2)
        if own_no_decay:
            self.no_weight_decay = lambda: {"table"}


@pytest.mark.parametrize("own_no_decay", [False, True])
def test_classify_without_family(own_no_decay):
    roles = {n: r for n, _, r in classify(Plain(own_no_decay), None)}
    decay = {n for n, r in roles.items() if r.decay}
    expected = {"fc.weight", "head.weight"} | (set() if own_no_decay else {"table"})
    assert decay == expected
    assert roles["norm.weight"].kind == "norm_gain" and roles["fc.bias"].kind == "vector"


@pytest.mark.parametrize("name", ["adamw", "adamw2", "sgd", "lars"])
def test_build_optimizer_without_family(name):
    cfg = OptimConfig(name=name)
    opt, summary = build_optimizer(Plain(), cfg, None)
    decayed = {n for g in opt.param_groups if g["weight_decay"] > 0 for n in g["names"]}
    assert decayed == {"fc.weight", "table", "head.weight"}
    if name == "adamw2":
        assert isinstance(opt, AdamW2) and cfg.tau == DEFAULT_TAU
        assert f"tau={DEFAULT_TAU:g}" in summary


def test_an_unknown_family_still_fails_in_one_line():
    with pytest.raises(ValueError, match="model.family=nosuch is not an option"):
        build_optimizer(Plain(), OptimConfig(), "nosuch")
