"""z-loss, the one-file example of a loss term: the formula, its gradient, and the trainer."""

import dataclasses
import math

import pytest
import torch

from stabletrain.errors import ConfigError
from stabletrain.losses import build_loss_terms
from stabletrain.losses.zloss import ZLoss, ZLossParams, log_z
from tests.helpers import losses, make_cfg, train

GPT = ["model=gpt_test", "batch_size=8", "optim=adamw", "eval_every=1000", "ckpt_every=1000"]


def test_value_is_coef_times_mean_squared_log_partition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g) * 4
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.reshape(-1, 7).tolist()) / 15
    got = ZLoss(ZLossParams(coef=1e-3))(None, logits, None, None)
    assert got.item() == pytest.approx(1e-3 * want, rel=1e-6)
    assert log_z(logits.bfloat16()).dtype == torch.float32


def test_gradient_is_2_coef_log_z_softmax_over_positions():
    """d/dz_i of coef * mean_n (log Z_n)^2 is coef * 2 log Z_n softmax(z_n)_i / N."""
    logits = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    ZLoss(ZLossParams(coef=0.5))(None, logits, None, None).backward()
    lz = torch.logsumexp(logits.detach(), -1, keepdim=True)
    want = 0.5 * 2 * lz * logits.detach().softmax(-1) / 4
    torch.testing.assert_close(logits.grad, want)


def test_parameters_are_checked_in_one_line():
    with pytest.raises(ConfigError, match=r"regularizer.zloss.coef=-1.0 must be >= 0"):
        build_loss_terms({"zloss": {"coef": -1.0}})
    with pytest.raises(ConfigError, match=r"regularizer.zloss: .*coeff.*its keys: coef"):
        build_loss_terms({"zloss": {"coeff": 1.0}})
    with pytest.raises(ConfigError,
                       match=r"^regularizer.zloss.coef=fast must be a number, e.g. regularizer.zloss.coef=0.0001$"):
        build_loss_terms({"zloss": {"coef": "fast"}})
    with pytest.raises(ConfigError, match="regularizer=nope is not an option; choose one of: locater, zloss"):
        build_loss_terms({"nope": {}})



@pytest.mark.parametrize("field,given,line", [
    (("coef", float, dataclasses.field(default="???")), {},
     "regularizer.own.coef has no default: set it, regularizer.own.coef=VALUE"),
    (("on", bool, dataclasses.field(default=True)), {"on": "maybe"},
     "regularizer.own.on=maybe must be true or false, e.g. regularizer.own.on=true"),
])
def test_a_parameter_of_ones_own_term_is_asked_for_or_checked_in_one_line(field, given, line):
    """A parameter without a default is asked for by name; a switch given a word says true or false."""
    from stabletrain.losses import LOSS_TERMS

    LOSS_TERMS.register("own", params=dataclasses.make_dataclass("Own", [field]))(lambda p: None)
    try:
        with pytest.raises(ConfigError) as e:
            build_loss_terms({"own": given})
        assert str(e.value) == line
    finally:
        LOSS_TERMS._entries.pop("own")


def test_a_loss_term_yaml_written_as_the_other_groups_is_refused_saying_how_it_is_written():
    """name: zloss / coef: 1e-4 made "regularizer=name is not an option", a term never typed."""
    from omegaconf import OmegaConf

    from stabletrain.build import validate

    cfg = make_cfg("model=gpt_test")
    cfg.regularizer = OmegaConf.create({"name": "zloss", "coef": 1e-4})
    with pytest.raises(ConfigError, match=r"^regularizer.name=zloss is no loss term's parameters: a loss term's yaml "
                                          r"holds them under the term's name, as configs/regularizer/zloss.yaml does"):
        validate(cfg)


def test_composes_alone_and_with_locater():
    cfg = make_cfg("model=gpt_test", "regularizer=zloss", "regularizer.zloss.coef=1e-3")
    assert dict(cfg.regularizer) == {"zloss": {"coef": 1e-3}}
    both = make_cfg("model=gpt_test", "regularizer=[locater,zloss]")
    assert [t.name for t in build_loss_terms(both.regularizer)] == ["locater", "zloss"]


def test_trainer_logs_its_share_and_trains_on_it(tmp_path):
    """One step: the logged penalty is the formula on the initial model's logits; the run
    differs from one without the term."""
    from stabletrain.build import build_trainer

    s = train(tmp_path / "z", *GPT, "steps=1", "regularizer=zloss", "regularizer.zloss.coef=0.1",
              "logger.log_every=1")
    rec = [r for r in _records(tmp_path / "z") if "loss/penalty" in r][0]
    t = build_trainer(make_cfg("logger=none", "monitor=off", *GPT, "steps=1"), tmp_path / "fresh")
    (x, _), = next(t.data.train_iter(0, t.shard))
    with torch.no_grad():
        want = 0.1 * torch.logsumexp(t.model(x).float(), -1).pow(2).mean().item()
    assert rec["loss/penalty"] == pytest.approx(want, rel=1e-5)
    assert "loss/zloss" not in rec  # one term: loss/penalty is its share
    assert s["status"] == "completed"
    train(tmp_path / "plain", *GPT, "steps=1", "logger.log_every=1")  # the same run without the term
    assert rec["loss"] == pytest.approx(losses(tmp_path / "plain")[1] + want, rel=1e-5)  # task + penalty
    with_term, without = (torch.load(tmp_path / d / "checkpoints/last.pt", weights_only=True)["model"]
                          for d in ("z", "plain"))
    assert any(not torch.equal(with_term[k], without[k]) for k in without)  # its gradient moved the weights


def test_gradient_accumulation_gives_the_whole_batch_step(tmp_path):
    """z-loss is a mean over positions, so two micro-batches of 4 give the step of one of 8."""
    args = [*GPT, "steps=3", "regularizer=zloss", "regularizer.zloss.coef=0.1", "logger.log_every=1"]
    train(tmp_path / "one", *args)
    train(tmp_path / "two", *args, "micro_batch_size=4")
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    pen = [[r["loss/penalty"] for r in _records(tmp_path / d) if "loss/penalty" in r] for d in ("one", "two")]
    assert pen[1] == pytest.approx(pen[0], rel=1e-5)


def test_several_terms_each_logged_and_summed(tmp_path):
    train(tmp_path, *GPT, "steps=2", "regularizer=[locater,zloss]", "logger.log_every=1")
    recs = [r for r in _records(tmp_path) if "loss/penalty" in r]
    assert recs and all(r["loss/penalty"] == pytest.approx(r["loss/locater"] + r["loss/zloss"], rel=1e-6)
                        for r in recs)


def _records(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_log_z_of_bf16_logits_is_computed_in_fp32():
    """Summed in fp32, not rounded to bf16 first: equal to the float64 value at fp32 precision."""
    x = (torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    torch.testing.assert_close(log_z(x), torch.logsumexp(x.double(), -1).float(), rtol=1e-6, atol=1e-6)
