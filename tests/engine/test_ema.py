"""Weight EMA (ema.decay): the recursion, its cadence, sigmaReparam at eval, checkpoints."""

import json

import pytest
import torch
from torch import nn

from stabletrain.config import ConfigError
from stabletrain.engine.ema import WeightEma
from tests.helpers import make_cfg, train, model_of

FAST = ["model=vit_test", "batch_size=16", "logger.log_every=1", "ema.decay=0.9"]


def _walk(model: nn.Module, n: int, seed: int = 0) -> list[torch.Tensor]:
    """Random weights for ``n`` steps, as an optimizer would leave them."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(model.weight.shape, generator=g) for _ in range(n)]


@pytest.mark.parametrize("every", [1, 3])
def test_average_follows_the_recursion(every):
    d, n = 0.8, 7
    model = nn.Linear(3, 2, bias=False)
    model.register_buffer("counter", torch.zeros(2))
    expect = model.weight.detach().clone()
    ema = WeightEma(model, d, every=every)
    for step, w in enumerate(_walk(model, n)):
        with torch.no_grad():
            model.weight.copy_(w)
            model.counter.fill_(step)
        ema.after_step(model, step)
        if (step + 1) % every == 0:  # e <- d^k e + (1 - d^k) w every k-th step
            expect = d**every * expect + (1 - d**every) * w
        torch.testing.assert_close(ema.module.weight, expect)
    assert ema.updates == n // every
    assert torch.equal(ema.module.counter, torch.full((2,), float(every * (n // every) - 1)))  # copied


def test_warmup_starts_with_a_copy_then_follows_timms_schedule():
    d = 0.999
    model = nn.Linear(2, 2, bias=False)
    ema = WeightEma(model, d, warmup=True)
    walk = _walk(model, 3)
    expect = None
    for step, w in enumerate(walk):
        with torch.no_grad():
            model.weight.copy_(w)
        ema.after_step(model, step)
        k = step  # timm: decay 0 at the first update, then 1 - (1 + k)^(-2/3), capped at d
        decay = 0.0 if k == 0 else min(1 - (1 + k) ** (-2 / 3), d)
        expect = w.clone() if expect is None else decay * expect + (1 - decay) * w
        torch.testing.assert_close(ema.module.weight, expect)


def test_eval_refits_sigma_reparam_to_the_averaged_weights():
    from stabletrain.layers.reparam import sigma_reparams
    from stabletrain.spectral import sigma1_exact

    torch.manual_seed(0)
    model = model_of(make_cfg("model=vit_test", "reparam=sigma"))
    ema = WeightEma(model, 0.5)
    with torch.no_grad():  # a new leading direction, which the copied u, v do not know
        for w, _ in sigma_reparams(model):
            m = w.view(w.shape[0], -1)  # conv kernels as (out, in * k * k)
            m.add_(5 * torch.outer(torch.randn(m.shape[0]), torch.randn(m.shape[1])) / m.numel() ** 0.5)
    ema.after_step(model, 0)
    stale = [part.sigma(mat.float()).item() / sigma1_exact(mat).item()
             for w, rep in sigma_reparams(ema.module) for part, mat in zip(rep.parts, rep.part_matrices(w.detach()))]
    assert min(stale) < 0.5  # the live model's vectors badly underestimate the average's sigma1
    for w, rep in sigma_reparams(ema.for_eval()):
        for part, mat in zip(rep.parts, rep.part_matrices(w.detach())):
            assert part.sigma(mat.float()).item() == pytest.approx(sigma1_exact(mat).item(), rel=1e-4)


def test_trainer_reports_the_average_and_resumes_it(tmp_path):
    s = train(tmp_path / "full", *FAST, "steps=6", "eval_every=3")
    recs = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert sum("val_ema/acc" in r for r in recs) == 2 and "val_ema/loss" in s["final"]
    full = torch.load(tmp_path / "full/checkpoints/last.pt", weights_only=True)["ema"]
    assert full["updates"] == 6

    from stabletrain.build import build_trainer
    from tests.helpers import QUIET
    from tests.engine.test_loop import _run_until

    t = build_trainer(make_cfg(*QUIET, *FAST, "steps=6", "eval_every=3", "ckpt_every=3"), tmp_path / "half")
    _run_until(t, 3)
    train(tmp_path / "half", *FAST, "steps=6", "eval_every=3", "resume=auto")
    half = torch.load(tmp_path / "half/checkpoints/last.pt", weights_only=True)["ema"]
    assert half["updates"] == 6
    for k, v in full["module"].items():
        torch.testing.assert_close(half["module"][k], v, rtol=1e-6, atol=1e-7, msg=k)


def test_a_checkpoint_without_an_average_starts_it_from_its_weights(tmp_path):
    train(tmp_path, "model=vit_test", "batch_size=16", "steps=2", "eval_every=1000")
    from stabletrain.build import build_trainer
    from tests.helpers import QUIET

    t = build_trainer(make_cfg(*QUIET, *FAST, "steps=4", "resume=auto", "eval_every=1000"), tmp_path)
    assert t.maybe_resume() == 2
    for a, b in zip(t.ema.module.state_dict().values(), t.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad, msg", [("ema.decay=1.0", "ema.decay=1.0 must be in (0, 1)"),
                                      ("ema.every=0", "ema.every=0 must be >= 1")])
def test_bad_ema_settings_are_one_line_errors(bad, msg):
    from stabletrain.build import validate

    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        validate(make_cfg("model=vit_test", bad))


def test_sigma_reparam_recipe_trains_and_scores_its_average(tmp_path):
    s = train(tmp_path, "experiment=sigma_vit_b", "model=vit_test", "steps=2", "batch_size=8", "eval_every=2",
              "eval_batches=1", "precision=fp32")
    assert s["status"] == "completed"
    final = s["final"]
    assert 0 <= final["val_ema/acc"] <= 1 and final["val_ema/loss"] > 0
    assert final["val_ema/loss"] != final["val/loss"]  # decay 0.99996 after 2 steps: nearly the initial model


def test_the_start_line_gives_the_averages_horizon_and_warns_when_it_outlasts_the_run():
    from types import SimpleNamespace

    from stabletrain.build import ema_note

    assert ema_note(SimpleNamespace(decay=0.9, warmup=False, every=1), 20) == \
        "weight average: ema.decay=0.9 (over ~10 steps), scored as val_ema/*"
    long = ema_note(SimpleNamespace(decay=0.99996, warmup=False, every=1), 20)
    assert long.startswith("warning: ema.decay=0.99996 averages over ~25000 steps, more than the run's 20")
    assert not ema_note(SimpleNamespace(decay=0.99996, warmup=True, every=1), 20).startswith("warning")  # warmed up
    # averaging every 30th step in a 20-step run: the average is the initial weights
    assert ema_note(SimpleNamespace(decay=0.5, warmup=True, every=30), 20) == (
        "warning: ema.every=30 is more than the run's 20 steps: the average never takes a step, and val_ema/* "
        "scores the initial weights; lower ema.every")


@pytest.mark.parametrize("second,note", [
    ("ema.decay=0.9", "the weight average changed on resume (ema.decay): it goes on from the resumed average"),
    ("ema.decay=null", "the weight average changed on resume (ema.decay): it is off from here"),
])
def test_a_resume_that_changes_the_weight_average_says_so(tmp_path, capsys, second, note):
    from tests.helpers import train

    args = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger=none", "monitor=off"]
    train(tmp_path, *args, "steps=2", "ema.decay=0.99")
    train(tmp_path, *args, "steps=4", second, "resume=auto", quiet=False)
    assert note in capsys.readouterr().err


def test_a_weight_average_added_on_resume_says_it_starts_there(tmp_path, capsys):
    from tests.helpers import train

    args = ["model=gpt_test", "batch_size=8", "eval_every=1000", "logger=none", "monitor=off"]
    train(tmp_path, *args, "steps=2")
    train(tmp_path, *args, "steps=4", "ema.decay=0.9", "resume=auto", quiet=False)
    assert "it starts now, from the resumed weights" in capsys.readouterr().err


def test_the_explicit_update_path_lerps_by_one_minus_decay():
    """WeightEma._update_unless without ``skip`` (the FSDP2 path) must give timm's numbers:
    e <- d e + (1 - d) w, as the found_inf path and timm's own update do."""
    d = 0.8
    model = nn.Linear(3, 2, bias=False)
    ema = WeightEma(model, d)
    e0 = ema.module.weight.detach().clone()
    with torch.no_grad():
        model.weight.copy_(torch.randn(2, 3, generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():  # as after_step calls it
        ema._update_unless(model, d, None)
    torch.testing.assert_close(ema.module.weight, d * e0 + (1 - d) * model.weight.detach())
