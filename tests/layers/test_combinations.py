"""Every component combination builds and trains in every family (the issue's product).

norm x placement x attention x reparam x init x deescalate = 4 x 2 x 3 x 3 x 4 x 3 = 864 cases
per family (vit_test, swin_test, gpt_test): each is built with ``build_model``, trained two
AdamW steps (with sigmaReparam's power iteration after each step) on a batch of 2, and must
keep a finite loss and finite parameters. In GPT the first batch also proves causality for
every combination: its second sequence differs from the first only after position ``CUT``,
so the logits up to ``CUT`` must agree.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from stabletrain.layers.reparam import reparam_step
from stabletrain.config import Components
from stabletrain.models.registry import build_model
from tests.layers.helpers import make_cfg, model_input

NORMS = ["layernorm", "rmsnorm", "stablenorm", "none"]
PLACEMENTS = ["pre", "post"]
ATTENTIONS = ["softmax", "qknorm", "stable"]
REPARAMS = {"none": {"name": "none"}, "sigma": {"name": "sigma"}, "sigma_qk": {"name": "sigma", "apply_to": "qk"}}
INITS = ["family", "xavier", "trunc_xavier", "stable"]
DEESCS = {"none": {"name": "none"}, "block": {"name": "deescalate", "placement": "block"},
          "ffn": {"name": "deescalate", "placement": "ffn"}}
MODELS = ["vit_test", "swin_test", "gpt_test"]
TOKENS, CUT = 8, 4


def _batch(cfg, case):
    x = model_input(cfg, batch=2, tokens=TOKENS, seed=case)
    g = torch.Generator().manual_seed(case)
    if cfg.model.family == "gpt":
        x[1] = x[0]
        x[1, CUT + 1:] = (x[0, CUT + 1:] + 1 + torch.randint(0, 200, (TOKENS - CUT - 1,), generator=g)) % 256
        return x, torch.randint(0, cfg.model.vocab_size, (2, TOKENS), generator=g)
    return x, torch.randint(0, cfg.model.num_classes, (2,), generator=g)


def _train_two_steps(cfg, case) -> str | None:
    """None if the case is healthy, else what went wrong."""
    torch.manual_seed(case)
    model = build_model(cfg.model, Components.of(cfg)).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    x, y = _batch(cfg, case)
    gpt = cfg.model.family == "gpt"
    for step in range(2):
        out = model(x)
        if gpt and step == 0:
            if not torch.allclose(out[0, :CUT + 1], out[1, :CUT + 1], rtol=1e-5, atol=1e-5):
                return "logits before the cut depend on later tokens"
            if torch.allclose(out[0, CUT + 1:], out[1, CUT + 1:]):
                return "changed tokens changed nothing (vacuous causality check)"
        loss = F.cross_entropy(out.flatten(0, -2).float(), y.flatten())
        if not torch.isfinite(loss):
            return f"loss {loss.item()} at step {step}"
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cfg.reparam.name != "none":
            reparam_step(model)
    if not torch.isfinite(torch.stack(torch._foreach_norm(params))).all():
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        return f"non-finite parameters {bad[:3]}"
    return None


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("model_name", MODELS)
def test_every_combination_builds_and_trains(model_name, norm, placement):
    failures = []
    cases = itertools.product(ATTENTIONS, REPARAMS, INITS, DEESCS)
    for case, (attention, reparam, init, deesc) in enumerate(cases):
        cfg = make_cfg(model_name, norm=dict(name=norm, placement=placement, alpha=0.25),
                       attention=dict(name=attention), reparam=REPARAMS[reparam], init=dict(name=init),
                       deescalate=DEESCS[deesc])
        problem = _train_two_steps(cfg, case)
        if problem:
            failures.append(f"attention={attention} reparam={reparam} init={init} deescalate={deesc}: {problem}")
    assert not failures, "\n".join(failures)
