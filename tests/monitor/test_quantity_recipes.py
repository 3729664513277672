"""Monitor recipes the other monitor tests leave open (monitor/quantities.py, runner.py, names.py
and spectral.py), each against an explicit formula, an exact SVD or a hand-computed value
(docs/methods.md §7)."""

import math

import pytest
import torch

from stabletrain import spectral
from stabletrain.layers.deescalate import token_similarity
from stabletrain.models.registry import transformer_blocks
from stabletrain.monitor import names as N
from stabletrain.monitor import quantities as Q
from stabletrain.monitor.runner import HISTORY, MonitorRunner
from tests.helpers import make_cfg, model_of

D, H = 24, 3


def _sv1(m):
    return torch.linalg.svdvals(m.double())[0].item()


def _weights(seed, d=D):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, d, generator=g) / math.sqrt(d) for _ in range(4)]


def _runner(model_name, *overrides, n=3):
    cfg = make_cfg(f"model={model_name}", "monitor=standard", *overrides)
    torch.manual_seed(0)
    model = model_of(cfg)
    g = torch.Generator().manual_seed(1)
    if model_name == "gpt_test":
        t = cfg.model.block_size
        batch = (torch.randint(0, cfg.model.vocab_size, (n, t), generator=g),
                 torch.randint(0, cfg.model.vocab_size, (n, t), generator=g))
    else:
        batch = (torch.randn(n, 3, cfg.model.img_size, cfg.model.img_size, generator=g), torch.randint(0, 10, (n,)))
    return MonitorRunner(model, cfg.monitor, batch, device=torch.device("cpu")), model, batch


def _block_inputs(model, x):
    """Each block's input on ``x``, in eval mode."""
    seen = {}
    hooks = [blk.register_forward_pre_hook(lambda _m, a, name=name: seen.__setitem__(name, a[0].detach()))
             for name, blk in transformer_blocks(model)]
    model.eval()
    with torch.no_grad():
        out = model(x)
    for h in hooks:
        h.remove()
    return seen, out


# --- quantities.py ---------------------------------------------------------------------


def test_entropy_with_a_causal_mask_and_a_key_mask_allows_only_keys_both_allow():
    """Causal and a padding-style key mask together: row i has the keys j <= i that the mask keeps,
    uniform rows over n keys score log n, and the reference is the mean log n over rows."""
    t = 6
    mask = torch.ones(1, 1, t, t, dtype=torch.bool)
    mask[..., 1] = False  # key 1 is padding: every row loses it
    allowed = mask[0, 0] & torch.ones(t, t, dtype=torch.bool).tril()
    n = allowed.sum(-1).double()  # [1, 1, 2, 3, 4, 5]
    probs = (allowed / n[:, None])[None, None].expand(2, 2, t, t).float()
    junk = probs + 0.3 * (~allowed)  # what masked entries hold must not count
    want = float(torch.log(n).mean())
    got = Q.to_floats(Q.attention_entropy(junk, mask=mask, causal=True))
    assert got["entropy/mean"] == pytest.approx(want, rel=1e-6)
    assert got["entropy/log_T"] == pytest.approx(want, rel=1e-12)


def test_full_width_products_up_to_exact_max_dim_are_exact():
    """``exact_max_dim`` is inclusive: a d x d product with d = exact_max_dim takes the exact
    sigma1 (one power-iteration step would not reach it)."""
    wq, wk, wv, wo = _weights(11)
    got = Q.qk_ov_stats(wq, wk, wv, wo, H, exact_max_dim=D, iters=1)
    assert got["sigma1/wq_t_wk_full"] == pytest.approx(_sv1(wq.double().T @ wk.double()), rel=1e-6)
    assert got["sigma1/wo_wv_full"] == pytest.approx(_sv1(wo.double() @ wv.double()), rel=1e-6)
    g = torch.Generator().manual_seed(12)
    w1, w2 = torch.randn(2 * D, D, generator=g), torch.randn(D, 2 * D, generator=g)
    assert Q.mlp_stats(w1, w2, exact_max_dim=D, iters=1)["sigma1/w2_w1"] == pytest.approx(
        _sv1(w2.double() @ w1.double()), rel=1e-6)


def test_huge_weights_with_a_dead_unit_keep_their_spectral_norms():
    """A diverging run's weights (entries ~1e12) with dead units (a zero row of W_q and W_k, a
    hidden unit with a zero row of W_1 and column of W_2): the power iterations run on fp32 copies
    scaled by each matrix's largest entry, so the products' norms do not overflow and sigma1 is
    the exact SVD's (float64)."""
    g = torch.Generator().manual_seed(9)
    scale = 1e12
    wq, wk, wv, wo = (w * scale for w in _weights(9))
    w1 = torch.randn(2 * D, D, generator=g) * scale / math.sqrt(D)
    w2 = torch.randn(D, 2 * D, generator=g) * scale / math.sqrt(2 * D)
    wq[0], wk[0] = 0.0, 0.0
    w1[0], w2[:, 0] = 0.0, 0.0
    blk = Q.BlockWeights("blocks.0", wq, wk, wv, wo, w1, w2, H)
    got = Q.stacked_weight_metrics([blk], iters_cold=400, iters_warm=400)
    ref = Q.block_weight_metrics("blocks.0", wq=wq, wk=wk, wv=wv, wo=wo, w1=w1, w2=w2, num_heads=H,
                                 iters=400, exact_max_dim=0)
    want = {"wq": wq, "w1": w1, "wq_t_wk_full": wq.double().T @ wk.double(), "w2_w1": w2.double() @ w1.double()}
    for q, m in want.items():
        key = N.metric(N.SIGMA1, "blocks.0", q)
        assert got[key] == pytest.approx(_sv1(m), rel=1e-4), key
        assert ref[key] == pytest.approx(_sv1(m), rel=1e-4), key


def _sec_explicit(wq, wk, h, s):
    """SEC(d_h, s) from the d x d products' SVDs, max over heads; a zero product counts as 0."""
    k = wq.shape[0] // h
    curves = []
    for i in range(h):
        e = torch.linalg.svdvals(wq[i * k:(i + 1) * k].double().T @ wk[i * k:(i + 1) * k].double()).pow(2)
        curves.append(float(e[:s].sum() / e.sum()) if e.sum() > 0 else 0.0)
    return max(curves)


@pytest.mark.parametrize("zero_heads", [[0], [0, 1, 2]])
def test_zero_query_heads_have_no_qk_spectrum_in_the_batched_pass(zero_heads):
    """A zero-initialised (or dead) query head: W_q^h^T W_k^h = 0, so its sigma1 is 0 and it counts
    as SEC 0 (sec_curve's rule), in the batched pass as in the per-block one; W_k's own spectrum
    must not show through."""
    wq, wk, wv, wo = _weights(13)
    k = D // H
    for i in zero_heads:
        wq[i * k:(i + 1) * k] = 0.0
    g = torch.Generator().manual_seed(13)
    w1, w2 = torch.randn(2 * D, D, generator=g), torch.randn(D, 2 * D, generator=g)
    got = Q.stacked_weight_metrics([Q.BlockWeights("blocks.0", wq, wk, wv, wo, w1, w2, H)], per_head=True)
    ref = Q.block_weight_metrics("blocks.0", wq=wq, wk=wk, wv=wv, wo=wo, w1=w1, w2=w2, num_heads=H, per_head=True)
    for i in zero_heads:
        assert got[f"sigma1/blocks.0/wq_t_wk_head{i}"] == 0.0
    for s in N.sec_sizes(k):
        key = f"sec/blocks.0/s{s}"
        assert got[key] == pytest.approx(_sec_explicit(wq, wk, H, s), abs=1e-7), key
        assert ref[key] == pytest.approx(_sec_explicit(wq, wk, H, s), abs=1e-7), key


# --- spectral.py -----------------------------------------------------------------------


def _low_rank(g, n, k, rank, d, scale=1.0):
    return (torch.randn(n, k, rank, generator=g, dtype=torch.float64)
            @ torch.randn(n, rank, d, generator=g, dtype=torch.float64)) * scale


@pytest.mark.parametrize("scale", [1.0, 1e6])
def test_gram_spectra_of_rank_deficient_factors_match_exact_svd(scale):
    """Collapsed heads: ``A^T B`` with a rank-2 factor, at init scale and at a diverging run's
    (entries ~1e6). The Cholesky shift is relative to G_A, so it still factorises; the spectrum is
    the exact SVD's up to that shift: two singular values, then ~0, never NaN (eigenvalues
    rounded below 0 are clamped)."""
    g = torch.Generator().manual_seed(5)
    n, k, d = 4, 8, 40
    for a, b in ((_low_rank(g, n, k, 2, d, scale), torch.randn(n, k, d, generator=g, dtype=torch.float64) * scale),
                 (torch.randn(n, k, d, generator=g, dtype=torch.float64), _low_rank(g, n, k, 2, d))):
        exact = torch.stack([torch.linalg.svdvals(a[i].T @ b[i])[:k] for i in range(n)])
        got = spectral.product_singular_values_gram(a, b)
        assert torch.isfinite(got).all() and (got >= 0).all()
        top = exact[:, :1]
        assert torch.allclose(got[:, :2], exact[:, :2], rtol=1e-6)
        assert (got[:, 2:] <= 1e-5 * top).all()


# --- names.py --------------------------------------------------------------------------


def test_parse_rejects_names_with_more_parts_than_the_contract():
    """``group/block/quantity`` has exactly three parts (``group/block`` for token_sim)."""
    assert N.parse("sigma1/blocks.0/wq/extra") is None
    assert N.parse("token_sim/blocks.0/x") is None
    assert N.parse("sigma1/blocks.0") is None
    assert N.parse("sigma1/blocks.0/wq") == ("sigma1", "blocks.0", "wq")
    with pytest.raises(ValueError, match="must not contain '/'"):  # it would read as another block
        N.metric(N.SIGMA1, "blocks/0", N.WQ)


# --- runner.py -------------------------------------------------------------------------


def test_gpt_probe_uses_causal_rows_for_the_reference_and_the_bound():
    """GPT's attention is causal: ``log_T`` is the mean over rows of log(i + 1) (0-indexed rows),
    and the Theorem 3.1 bound is the causal one, from W_q, W_k and norm1 of the block input."""
    runner, model, (x, _) = _runner("gpt_test")
    got = runner.probe_metrics()
    t = x.shape[1]
    want_log_t = sum(math.log(i + 1) for i in range(t)) / t
    inputs, _ = _block_inputs(model, x)
    for name, blk in transformer_blocks(model):
        assert blk.attn.causal and blk.attn.qkv.bias is None
        assert got[N.metric(N.ENTROPY, name, N.ENT_LOG_T)] == pytest.approx(want_log_t, rel=1e-12)
        wq, wk, _ = blk.attn.qkv.weight.detach().chunk(3, 0)
        h = blk.attn.num_heads
        with torch.no_grad():
            attn_in = blk.norm1(inputs[name])
        bound = Q.entropy_lower_bound(Q.split_heads(wq, h), Q.split_heads(wk, h), attn_in, causal=True)
        assert got[N.metric(N.ENTROPY, name, N.ENT_BOUND_MIN)] == pytest.approx(float(bound.min()), rel=1e-6)


def test_vit_bound_uses_the_q_bias_of_the_fused_projection():
    """With q/k biases (timm's ViT), the bound logged is Theorem 3.1's with ``[W_q^h | b_q^h]``,
    b_q the first third of the fused qkv bias (docs/methods.md §7), not the k bias; checked with
    biases that differ (at init all are 0), and it stays below the measured entropy."""
    runner, model, (x, _) = _runner("vit_test")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, blk in transformer_blocks(model):
            blk.attn.qkv.bias.copy_(torch.randn(blk.attn.qkv.bias.shape, generator=g))
    got = runner.probe_metrics()
    inputs, _ = _block_inputs(model, x)
    for name, blk in transformer_blocks(model):
        h = blk.attn.num_heads
        wq, wk, _ = blk.attn.qkv.weight.detach().chunk(3, 0)
        bq = blk.attn.qkv.bias.detach().chunk(3, 0)[0].reshape(h, -1)
        with torch.no_grad():
            attn_in = blk.norm1(inputs[name])
        bound = Q.entropy_lower_bound(Q.split_heads(wq, h), Q.split_heads(wk, h), attn_in, bq_h=bq)
        assert got[N.metric(N.ENTROPY, name, N.ENT_BOUND_MIN)] == pytest.approx(float(bound.min()), rel=1e-6)
        assert got[N.metric(N.ENTROPY, name, N.ENT_BOUND_MIN)] <= got[N.metric(N.ENTROPY, name, N.ENT_MIN)]


def _attention_called_with(model, attn_mask=None, is_causal=False):
    """Each block's attention called with this mask and causal flag, whatever the block passes."""
    for _, blk in transformer_blocks(model):
        blk.attn.forward = lambda x, _m=None, _c=False, f=blk.attn.forward: f(x, attn_mask, is_causal)


@pytest.mark.parametrize("how", ["padding", "float", "causal"])
def test_probe_reads_the_mask_and_causal_flag_the_attention_was_called_with(how):
    """A block that passes its attention a padding mask, a float mask or ``is_causal``: the
    entropy's reference and the Theorem 3.1 bound count each row's allowed keys (they counted
    every key, a bound above the measured entropy); a float mask's values move the logits, so
    no bound is logged for it."""
    runner, model, (x, _) = _runner("vit_test", "model.qkv_bias=false")
    inputs, _ = _block_inputs(model, x)
    t = next(iter(inputs.values())).shape[1]
    lengths = torch.tensor([3, t, t - 2])
    pad = (torch.arange(t)[None, :] < lengths[:, None])[:, None, None, :]
    mask = {"padding": pad, "float": torch.zeros(pad.shape).masked_fill(~pad, float("-inf")), "causal": None}[how]
    _attention_called_with(model, mask, how == "causal")
    got = runner.probe_metrics()
    inputs, _ = _block_inputs(model, x)
    for name, blk in transformer_blocks(model):
        if how == "causal":
            assert got[N.metric(N.ENTROPY, name, N.ENT_LOG_T)] == pytest.approx(
                sum(math.log(i + 1) for i in range(t)) / t, rel=1e-12)
        else:
            assert got[N.metric(N.ENTROPY, name, N.ENT_LOG_T)] == pytest.approx(
                sum(math.log(n) for n in lengths.tolist()) / 3, rel=1e-12)
        key = N.metric(N.ENTROPY, name, N.ENT_BOUND_MIN)
        if how == "float":
            assert key not in got
            continue
        h = blk.attn.num_heads
        wq, wk, _ = blk.attn.qkv.weight.detach().chunk(3, 0)
        with torch.no_grad():
            attn_in = blk.norm1(inputs[name])
        bound = Q.entropy_lower_bound(Q.split_heads(wq, h), Q.split_heads(wk, h), attn_in, how == "causal",
                                      mask=None if how == "causal" else pad)
        assert got[key] == pytest.approx(float(bound.min()), rel=1e-6)
        assert got[key] <= got[N.metric(N.ENTROPY, name, N.ENT_MIN)]


def test_swin_block_input_maps_are_one_token_list_per_image():
    """A Swin block's input is a (B, H, W, C) map: ``norm/<block>/x`` is each image's Frobenius
    norm and ``token_sim/<block>`` each image's similarity over its H W tokens, means over the batch."""
    runner, model, (x, _) = _runner("swin_test")
    got = runner.probe_metrics()
    inputs, _ = _block_inputs(model, x)
    for name, xin in inputs.items():
        assert xin.dim() == 4  # (B, H, W, C)
        flat = xin.double().reshape(xin.shape[0], -1, xin.shape[-1])
        assert got[N.metric(N.NORM, name, N.ACT_X)] == pytest.approx(
            float(torch.stack([f.norm() for f in flat]).mean()), rel=1e-5)
        mean_tok = flat.mean(1, keepdim=True).expand_as(flat)  # P X: every token replaced by the mean
        sim = [(mean_tok[i].norm() ** 2 / flat[i].norm() ** 2).item() for i in range(len(flat))]
        assert got[N.metric(N.TOKEN_SIM, name)] == pytest.approx(sum(sim) / len(sim), rel=1e-6)
        assert float(token_similarity(flat).mean()) == pytest.approx(sum(sim) / len(sim), rel=1e-9)


def test_the_probe_of_a_model_with_non_finite_weights_logs_nothing():
    """A diverged model (a NaN in one weight) gets no probe record: no NaN entropies, bounds or
    norms that would read as measurements; the attention capture is switched off again."""
    runner, model, _ = _runner("vit_test")
    with torch.no_grad():
        model.blocks[1].mlp.fc2.weight[0, 0] = float("nan")
    assert runner.probe_metrics() == {}
    assert all(blk.attn.probe is None for _, blk in transformer_blocks(model))


class _Sink:
    def __init__(self):
        self.records, self.messages = [], []

    def log(self, step, values):
        self.records.append((step, values))

    def message(self, text):
        self.messages.append(text)


def test_probe_runs_in_eval_mode_and_restores_training_mode():
    """Drop path must not touch the probe: ``logits/log_z`` is the eval-mode forward's mean log Z,
    whatever mode the model trains in, and the pass leaves the model in its training mode."""
    runner, model, (x, _) = _runner("vit_test", "model.drop_path=0.9", "monitor.weight_every=100000",
                                    "monitor.probe_every=1", "monitor.alerts=false")
    runner.attach(_Sink())
    model.train()
    runner.after_step(0)
    assert model.training
    (step, got), = runner.sink.records
    _, out = _block_inputs(model, x)
    assert step == 1
    assert got[N.LOG_Z] == pytest.approx(float(torch.logsumexp(out.double(), -1).mean()), rel=1e-6)


def test_forensics_keep_the_latest_snapshots_and_skip_non_finite_ones():
    """The weight history keeps the last HISTORY passes, and a divergence reports the last one
    whose weights were finite."""
    runner, _, _ = _runner("vit_test", "monitor.weight_every=1", "monitor.probe_every=100000",
                           "monitor.alerts=false")
    runner.attach(_Sink())
    steps = iter(range(10_000))
    runner.weight_metrics = lambda: {"sigma1/blocks.0/wq": float(next(steps))}
    for step in range(-1, HISTORY + 10):
        runner.after_step(step)
    assert len(runner.history) == HISTORY
    assert [h["step"] for h in runner.history] == list(range(11, HISTORY + 11))
    assert runner.sink.records[-1] == (HISTORY + 10, {"sigma1/blocks.0/wq": float(HISTORY + 10)})
    runner.history = [{"step": 2, "sigma1/blocks.0/wq": 1.0}, {"step": 4, "sigma1/blocks.0/wq": 2.0},
                      {"step": 6, "sigma1/blocks.0/nonfinite_weights": 1.0}]
    forensics = runner.summary("diverged")["forensics"]
    assert forensics["last_finite_snapshot"] == {"step": 4, "sigma1/blocks.0/wq": 2.0}


def test_forensics_take_a_weight_pass_at_the_step_a_diverged_run_stopped():
    """A run that diverges between weight passes (skipped steps leave its weights finite) reports
    the weights it stopped with, not the last scheduled pass (step 0 with the default cadence)."""
    runner, _, _ = _runner("vit_test", "monitor.weight_every=100", "monitor.probe_every=100000",
                           "monitor.alerts=false")
    runner.attach(_Sink())
    runner.after_step(-1)  # the initial pass, at step 0
    assert [h["step"] for h in runner.history] == [0]
    with torch.no_grad():  # the weights move after it
        for p in runner.model.parameters():
            p.mul_(3.0)
    forensics = runner.summary("diverged", 30)["forensics"]
    snap = forensics["last_finite_snapshot"]
    assert snap["step"] == 30
    assert snap["sigma1/blocks.0/wq"] == pytest.approx(3.0 * runner.history[0]["sigma1/blocks.0/wq"], rel=1e-3)
    assert "grew" in forensics["growth"] and "at step 30" in forensics["growth"]
    # without the step (or with non-finite weights) nothing is added
    before = len(runner.history)
    runner.summary("diverged")
    assert len(runner.history) == before
