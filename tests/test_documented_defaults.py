"""Every default that docs/methods.md states in its option tables is the value a run composes.

The tables are the user's copy of the methods' defaults (AdamW²'s three power iterations,
sigmaReparam's one, de-escalation's lambda, LocAteR's kappas, StableInit's gain, ...): a
config edit that changes one of them, or a doc edit that misstates one, fails here.
"""

from __future__ import annotations

import re

import pytest
import yaml

from tests.helpers import ROOT, make_cfg

# the option under which each group's keys are read (docs/methods.md documents that option's keys)
OPTION = {
    "optim": "optim=adamw2",
    "reparam": "reparam=sigma",
    "deescalate": "deescalate=block",
    "regularizer": "regularizer=locater",
    "init": "init=stable",
    "norm": "norm=stablenorm",
    "attention": "attention=stable",
}
ROW = re.compile(r"^\| ((?:`[\w.]+`(?:, )?)+) \| (.+?) \|", re.M)
TICKED = re.compile(r"`([^`]*)`")


def documented_defaults() -> list[tuple[str, str]]:
    """``(key, value as written)`` for each row of the methods' option tables."""
    rows = []
    for keys, values in ROW.findall((ROOT / "docs" / "methods.md").read_text()):
        names = TICKED.findall(keys)
        rows += list(zip(names, TICKED.findall(values)[: len(names)], strict=True))
    return rows


def _value(text: str):
    value = yaml.safe_load(text)
    try:  # YAML 1.1 reads 1e-3 as a string
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def test_the_tables_are_found():
    keys = {k for k, _ in documented_defaults()}
    assert {"optim.power_iters", "reparam.power_iters", "deescalate.lambda_", "init.gain",
            "regularizer.locater.mean_coef", "norm.alpha", "attention.c"} <= keys
    assert {k.split(".")[0] for k in keys} <= set(OPTION)


@pytest.mark.parametrize("key, written", documented_defaults())
def test_a_documented_default_is_what_a_run_composes(key, written):
    got = _get(make_cfg(OPTION[key.split(".")[0]]), key)
    want = _value(written)
    if hasattr(got, "value") and not isinstance(got, (int, float)):  # an enum option
        got = got.value
    if isinstance(want, list):
        assert list(got) == want
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-12)
    else:
        assert got == want


def test_gpt_layernorm_eps_is_nanogpts():
    """nanoGPT's LayerNorm eps, 1e-5 (torch's default)."""
    import torch.nn as nn

    from tests.helpers import model_of

    norms = [m for m in model_of(make_cfg("model=gpt_test")).modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(m.eps == 1e-5 for m in norms)
