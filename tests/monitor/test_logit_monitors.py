"""attn_logit_max/<block> and logits/log_z against explicit computation on tiny models."""

import json

import pytest
import torch

from stabletrain.layers.attention import logit_max
from stabletrain.models.registry import transformer_blocks
from stabletrain.monitor import names as N
from stabletrain.monitor.runner import MonitorRunner
from tests.helpers import make_cfg, model_of, train


def _batch(model_name: str, cfg, n: int = 3):
    g = torch.Generator().manual_seed(1)
    if model_name == "gpt_test":
        t = cfg.model.block_size
        return (torch.randint(0, cfg.model.vocab_size, (n, t), generator=g),
                torch.randint(0, cfg.model.vocab_size, (n, t), generator=g))
    return torch.randn(n, 3, cfg.model.img_size, cfg.model.img_size, generator=g), torch.randint(0, 10, (n,))


def _explicit(model, x, causal: bool) -> tuple[dict[str, float], float, dict[str, float]]:
    """Per block: norm1 input -> qkv weights -> q/k norms -> scale q.k, masked max and the mean
    over heads of the attention entropy; and mean log Z."""
    inputs = {}
    blocks = transformer_blocks(model)
    hooks = [blk.register_forward_pre_hook(lambda _m, a, name=name: inputs.__setitem__(name, a[0]))
             for name, blk in blocks]
    with torch.no_grad():
        out = model(x).double()
    for h in hooks:
        h.remove()
    maxima, entropy = {}, {}
    for name, blk in blocks:
        a = blk.attn
        h = blk.norm1(inputs[name]).double()
        w, b = a.qkv.weight.double(), a.qkv.bias.double() if a.qkv.bias is not None else 0.0
        qkv = h @ w.T + b
        bsz, t, _ = qkv.shape
        q, k, _v = qkv.view(bsz, t, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        with torch.no_grad():
            q, k = a.q_norm(q.float()).double(), a.k_norm(k.float()).double()
        logits = a.scale * torch.einsum("bhqd,bhkd->bhqk", q, k)
        if causal:
            logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        maxima[name] = float(logits.max())
        probs = logits.softmax(-1)
        entropy[name] = float(-torch.special.xlogy(probs, probs).sum(-1).mean())
    return maxima, float(torch.logsumexp(out, -1).mean()), entropy


@pytest.mark.parametrize("model_name,extra", [
    ("vit_test", []), ("gpt_test", []), ("gpt_test", ["attention=qknorm"]),
    ("vit_test", ["norm=stablenorm", "attention=stable", "init=stable"]), ("gpt_test", ["reparam=sigma"])])
def test_monitors_match_explicit_computation(model_name, extra):
    cfg = make_cfg(f"model={model_name}", "monitor=standard", *extra)
    torch.manual_seed(0)
    model = model_of(cfg)
    with torch.no_grad():  # larger logits than at init, so that the max is not near 0
        for _, blk in transformer_blocks(model):
            if hasattr(blk.attn.qkv, "weight") and isinstance(blk.attn.qkv.weight, torch.nn.Parameter):
                blk.attn.qkv.weight.mul_(4.0)
    x, y = _batch(model_name, cfg)
    runner = MonitorRunner(model, cfg.monitor, (x, y), device=torch.device("cpu"))
    got = runner.probe_metrics()
    model.eval()
    maxima, lz, entropy = _explicit(model, x, causal=model_name == "gpt_test")
    for name, want in maxima.items():
        assert got[N.metric(N.ATTN_LOGIT_MAX, name)] == pytest.approx(want, rel=1e-4, abs=1e-5), name
        assert got[N.metric(N.ENTROPY, name, N.ENT_MEAN)] == pytest.approx(entropy[name], rel=1e-4), name
    assert got[N.LOG_Z] == pytest.approx(lz, rel=1e-5)
    assert all(blk.attn.probe is None for _, blk in transformer_blocks(model))


def test_logit_max_masks():
    logits = torch.arange(16.0).view(1, 1, 4, 4)
    assert float(logit_max(logits, None, False)) == 15.0
    assert float(logit_max(logits, None, True)) == 15.0  # the diagonal's last entry is kept
    future = logits.clone()
    future[..., 0, 3] = 100.0  # query 0, key 3: masked under causal
    assert float(logit_max(future, None, False)) == 100.0 and float(logit_max(future, None, True)) == 15.0
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[3, 3] = False
    assert float(logit_max(logits, keep, False)) == 14.0
    assert float(logit_max(logits, torch.zeros(4, 4).masked_fill(~keep, float("-inf")), False)) == 14.0


def test_logged_at_the_probe_cadence(tmp_path):
    train(tmp_path, "model=gpt_test", "steps=4", "batch_size=4", "monitor=standard", "monitor.weight_every=100",
          "monitor.probe_every=2", "eval_every=1000")
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    probed = [r["step"] for r in recs if N.LOG_Z in r]
    assert 2 in probed and 4 in probed
    r = next(r for r in recs if r["step"] == 4 and N.LOG_Z in r)
    assert all(N.metric(N.ATTN_LOGIT_MAX, f"blocks.{i}") in r for i in range(2))
