"""Attention variants against explicit softmax formulas (004 Eq. 3; docs/methods.md §5)."""

import math

import pytest
import torch
from timm.models.swin_transformer import WindowAttention

from stabletrain.config import AttentionConfig, NormConfig
from stabletrain.layers.attention import Attention, SwinAttention, qk_transform
from stabletrain.config import Components
from stabletrain.models.registry import build_model
from tests.layers.helpers import make_cfg

D, H = 24, 3
DH = D // H


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rms(x, g, eps):
    return g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _sn(x, g, alpha, eps):  # StableNorm, eps inside the root
    return g * x.shape[-1] ** alpha * x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def explicit_logits(name, q, k, qg, kg, *, alpha=0.25, c=1.618, n=16, eps=1e-5):
    """The docs/methods.md formulas, written out: q, k of shape (B, H, T, d_h)."""
    d_h = q.shape[-1]
    if name == "softmax":
        return q @ k.transpose(-2, -1) / math.sqrt(d_h)
    if name == "qknorm":
        return _rms(q, qg, eps) @ _rms(k, kg, eps).transpose(-2, -1) / math.sqrt(d_h)
    tau = c * math.log2(n)
    return tau * (_sn(q, qg, alpha, eps) @ _sn(k, kg, alpha, eps).transpose(-2, -1)) / d_h ** (2 * alpha)


def _randomise_gains(mod, seed=1):
    g = _gen(seed)
    with torch.no_grad():
        for norm in (mod.q_norm, mod.k_norm):
            if getattr(norm, "weight", None) is not None:
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g))


def _qkv(mod, x, h):
    b, t, _ = x.shape
    return (mod.qkv(x).view(b, t, 3, h, -1).permute(2, 0, 3, 1, 4)).unbind(0)


def _gains(mod):
    qg = getattr(mod.q_norm, "weight", None)
    kg = getattr(mod.k_norm, "weight", None)
    return qg, kg


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["softmax", "qknorm", "stable"])
def test_attention_equals_explicit_softmax_of_the_formula(name, causal):
    t = 16
    mod = Attention(D, H, attn_cfg=AttentionConfig(name=name, alpha=0.25), norm_cfg=NormConfig(alpha=0.5),
                    seq_len=t, causal=causal)
    _randomise_gains(mod)
    x = torch.randn(2, t, D, generator=_gen(0))
    mod.probe = {}
    with torch.no_grad():
        out = mod(x)
        q, k, v = _qkv(mod, x, H)
        logits = explicit_logits(name, q, k, *_gains(mod), n=t)
        if causal:
            logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        probs = logits.softmax(-1)
        want = mod.proj((probs @ v).transpose(1, 2).reshape(2, t, D))
    torch.testing.assert_close(mod.probe["probs"], probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_stable_logits_bounded_for_any_input_scale(scale):
    t = 16
    mod = Attention(D, H, attn_cfg=AttentionConfig(name="stable"), norm_cfg=NormConfig(alpha=0.25), seq_len=t)
    _randomise_gains(mod)
    tau = 1.618 * math.log2(t)
    qg, kg = _gains(mod)
    bound = tau * (qg.abs().max() * kg.abs().max()).item()
    x = scale * torch.randn(2, t, D, generator=_gen(2))
    with torch.no_grad():
        q, k, _ = _qkv(mod, x, H)
        logits = mod.scale * mod.q_norm(q) @ mod.k_norm(k).transpose(-2, -1)
        ref = explicit_logits("stable", q, k, qg, kg, n=t)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert logits.abs().max().item() <= bound * (1 + 1e-5)
    # softmax attention has no such bound: its logits scale with the input squared
    plain = (q @ k.transpose(-2, -1) / math.sqrt(DH)).abs().max().item()
    if scale == 1e3:
        assert plain > 1e3 * bound


def test_stable_logits_do_not_depend_on_alpha():
    t = 16
    x = torch.randn(2, t, D, generator=_gen(3))
    outs = []
    for alpha in (0.0, 0.25, 0.5):
        torch.manual_seed(0)
        mod = Attention(D, H, attn_cfg=AttentionConfig(name="stable", alpha=alpha, eps=1e-12),
                        norm_cfg=NormConfig(), seq_len=t)
        with torch.no_grad():
            outs.append(mod(x))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-5, atol=1e-6)


def test_tau_is_c_log2_n():
    for alpha in (0.0, 0.25, 0.475):
        _, _, scale = qk_transform(AttentionConfig(name="stable", c=1.618, alpha=alpha), NormConfig(), DH, 512)
        assert scale * DH ** (2 * alpha) == pytest.approx(14.562, abs=5e-4)
    _, _, scale = qk_transform(AttentionConfig(name="stable", c=1.618, alpha=0.25), NormConfig(), 64, 1024)
    assert scale * 64**0.5 == pytest.approx(16.18, abs=1e-9)
    _, _, scale = qk_transform(AttentionConfig(name="stable", c=1.618, seq_len=512), NormConfig(alpha=0.5), DH, 7)
    assert scale * DH == pytest.approx(14.562, abs=5e-4)  # seq_len overrides the model's N
    for name in ("softmax", "qknorm"):
        assert qk_transform(AttentionConfig(name=name), NormConfig(), DH, 512)[2] == DH**-0.5


# --- Swin: relative position bias and shift mask preserved --------------------------------


def _swin_mask_and_attn():
    cfg = make_cfg("swin_test", depths=[2, 1])  # swin_test's single block per stage never shifts
    model = build_model(cfg.model, Components.of(cfg))
    blk = model.layers[0].blocks[1]  # the shifted block of stage 0
    assert blk.attn_mask is not None and any(blk.shift_size)
    return blk.attn_mask, blk.attn


@pytest.mark.parametrize("shifted", [False, True])
def test_swin_softmax_equals_timm_window_attention(shifted):
    mask, ours = _swin_mask_and_attn()
    with torch.no_grad():
        ours.relative_position_bias_table.normal_(0, 1.0, generator=_gen(4))
    ref = WindowAttention(ours.dim, ours.num_heads, window_size=ours.window_size, qkv_bias=True)
    ref.load_state_dict(ours.state_dict())
    nw = mask.shape[0]
    x = torch.randn(2 * nw, ours.window_area, ours.dim, generator=_gen(5))
    m = mask if shifted else None
    with torch.no_grad():
        torch.testing.assert_close(ours(x, m), ref(x, m), rtol=1e-5, atol=1e-5)
        ref.fused_attn = not ref.fused_attn  # timm's explicit path too
        torch.testing.assert_close(ours(x, m), ref(x, m), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["softmax", "qknorm", "stable"])
def test_swin_variants_keep_bias_and_shift_mask(name):
    mask, timm_attn = _swin_mask_and_attn()
    with torch.no_grad():
        timm_attn.relative_position_bias_table.normal_(0, 1.0, generator=_gen(6))
    mod = SwinAttention.from_timm(timm_attn, attn_cfg=AttentionConfig(name=name, alpha=0.25),
                                  norm_cfg=NormConfig(), attn_fp32=False)
    _randomise_gains(mod)
    nw, n, h = mask.shape[0], mod.window_area, mod.num_heads
    x = torch.randn(2 * nw, n, mod.dim, generator=_gen(7))
    mod.probe = {}
    with torch.no_grad():
        out = mod(x, mask)
        q, k, v = _qkv(mod, x, h)
        bias = mod.relative_position_bias_table[mod.relative_position_index.view(-1)].view(n, n, h).permute(2, 0, 1)
        logits = explicit_logits(name, q, k, *_gains(mod), n=n) + bias
        logits = logits + mask.repeat(2, 1, 1)[:, None]  # window w of image i is row i * nw + w
        probs = logits.softmax(-1)
        want = mod.proj((probs @ v).transpose(1, 2).reshape(2 * nw, n, -1))
    torch.testing.assert_close(mod.probe["probs"], probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_attn_fp32_under_bf16_autocast_matches_fp32():
    t = 16
    mod = Attention(D, H, attn_cfg=AttentionConfig(name="softmax"), norm_cfg=NormConfig(), seq_len=t,
                    attn_fp32=True)
    x = torch.randn(2, t, D, generator=_gen(8))
    with torch.no_grad():
        ref = mod(x)
        q, k, v = (z.bfloat16() for z in _qkv(mod, x, H))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            from stabletrain.layers.attention import attend

            fp32 = attend(mod, x, q, k, v)
            mod.attn_fp32 = False
            bf16 = attend(mod, x, q, k, v)
    want = ((q.float() @ k.float().transpose(-2, -1)) * DH**-0.5).softmax(-1) @ v.float()
    assert fp32.dtype == torch.bfloat16 and bf16.dtype == torch.bfloat16
    torch.testing.assert_close(fp32.float(), want.bfloat16().float(), rtol=0, atol=0)
    assert ref.shape == (2, t, D)


def test_explicit_probs_reads_a_boolean_mask_as_sdpa_does():
    """True = attend, as in F.scaled_dot_product_attention; a float mask is added."""
    import torch.nn.functional as F

    from stabletrain.layers.attention import explicit_probs

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 5, 4).unbind(0)
    keep = torch.rand(5, 5) > 0.4
    keep[:, 0] = True
    for mask in (keep, torch.zeros(5, 5).masked_fill(~keep, float("-inf"))):
        p = explicit_probs(q, k, 0.5, mask, False)
        assert torch.allclose(p @ v, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5), atol=1e-6)
        assert bool((p[..., ~keep] == 0).all())


@pytest.mark.parametrize("t, s", [(5, 5), (2, 5), (5, 7)])
def test_explicit_causal_masks_align_as_sdpa_does(t, s):
    """SDPA's is_causal keeps keys j <= i (top-left) also when queries and keys differ in number;
    the probabilities, the logit max and the entropy's key count follow it."""
    import torch.nn.functional as F

    from stabletrain.layers.attention import explicit_probs, logit_max
    from stabletrain.monitor.quantities import _key_mask

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, t, 4), torch.randn(2, 2, s, 4), torch.randn(2, 2, s, 4)
    p = explicit_probs(q, k, 0.5, None, True)
    assert torch.allclose(p @ v, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5), atol=1e-6)
    keep = torch.ones(t, s, dtype=torch.bool).tril()
    assert torch.equal(p > 0, keep.expand_as(p))
    assert torch.equal(_key_mask(p.shape, None, True, "cpu"), keep)
    logits = 0.5 * q @ k.transpose(-1, -2)
    assert logit_max(logits, None, True) == logits.masked_fill(~keep, float("-inf")).amax()


@pytest.mark.parametrize("model,n", [("vit_test", (16 // 4) ** 2 + 1), ("gpt_test", 32), ("swin_test", 4 * 4)])
def test_a_built_models_stableatten_scale_counts_its_tokens_per_attention(model, n):
    """N is what the family passes: a ViT's patches plus the class token, a GPT's block, a Swin
    window's area; scale = 1.618 log2(N) d_h^(-2 alpha) in every block."""
    from tests.helpers import model_of

    cfg = make_cfg(model, attention=dict(name="stable"), norm=dict(name="stablenorm", alpha=0.25))
    attns = [m for m in model_of(cfg).modules() if hasattr(m, "q_norm") and hasattr(m, "scale")]
    assert attns
    for a in attns:
        head_dim = a.q_norm.weight.numel()
        assert a.scale == pytest.approx(1.618 * math.log2(n) * head_dim ** -0.5, rel=1e-12), (model, a.scale)
