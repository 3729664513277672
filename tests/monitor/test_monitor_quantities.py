"""Monitor maths against explicit float64 computations (docs/methods.md §2, 3, 4, 7)."""

import math

import pytest
import torch

from stabletrain import spectral
from stabletrain.monitor import names as N
from stabletrain.monitor import quantities as Q

D, H = 24, 3
DH = D // H


def _weights(seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, d, generator=g) / math.sqrt(d) for _ in range(4)]


def _sv(m):
    return torch.linalg.svdvals(m.double())


def _head_qk(wq, wk, h):
    return wq[h * DH:(h + 1) * DH].double().T @ wk[h * DH:(h + 1) * DH].double()  # d x d


def _head_ov(wo, wv, h):
    return wo[:, h * DH:(h + 1) * DH].double() @ wv[h * DH:(h + 1) * DH].double()  # d x d


def test_qk_ov_per_head_and_full_width_match_exact_svd():
    wq, wk, wv, wo = _weights()
    got = Q.qk_ov_stats(wq, wk, wv, wo, H, per_head=True)
    qk = torch.stack([_sv(_head_qk(wq, wk, h))[0] for h in range(H)])
    ov = torch.stack([_sv(_head_ov(wo, wv, h))[0] for h in range(H)])
    assert got["sigma1/wq_t_wk_max"] == pytest.approx(qk.max().item(), rel=1e-5)
    assert got["sigma1/wq_t_wk_mean"] == pytest.approx(qk.mean().item(), rel=1e-5)
    assert got["sigma1/wo_wv_max"] == pytest.approx(ov.max().item(), rel=1e-5)
    assert got["sigma1/wo_wv_mean"] == pytest.approx(ov.mean().item(), rel=1e-5)
    for h in range(H):
        assert got[f"sigma1/wq_t_wk_head{h}"] == pytest.approx(qk[h].item(), rel=1e-5)
        assert got[f"sigma1/wo_wv_head{h}"] == pytest.approx(ov[h].item(), rel=1e-5)
    full_qk = sum(_head_qk(wq, wk, h) for h in range(H))
    full_ov = sum(_head_ov(wo, wv, h) for h in range(H))
    assert torch.allclose(full_qk, wq.double().T @ wk.double())  # sum over heads = full width
    assert got["sigma1/wq_t_wk_full"] == pytest.approx(_sv(full_qk)[0].item(), rel=1e-5)
    assert got["sigma1/wo_wv_full"] == pytest.approx(_sv(full_ov)[0].item(), rel=1e-5)


def test_full_width_power_iteration_path_converges_and_warm_starts():
    wq, wk, wv, wo = _weights(1)
    exact = _sv(wq.double().T @ wk.double())[0].item()
    warm = {}
    got = Q.qk_ov_stats(wq, wk, wv, wo, H, exact_max_dim=0, iters=1000, warm=warm)
    assert got["sigma1/wq_t_wk_full"] == pytest.approx(exact, rel=1e-4)
    assert "sigma1/wq_t_wk_full" in warm and "sigma1/wo_wv_full" in warm
    # one further step from the stored vectors keeps the converged value
    again = Q.qk_ov_stats(wq, wk, wv, wo, H, exact_max_dim=0, iters=1, warm=warm)
    assert again["sigma1/wq_t_wk_full"] == pytest.approx(exact, rel=1e-4)


def test_weight_sigma1_and_mlp_stats_match_exact():
    g = torch.Generator().manual_seed(2)
    w1 = torch.randn(4 * D, D, generator=g)
    w2 = torch.randn(D, 4 * D, generator=g)
    warm = {}
    got = Q.mlp_stats(w1, w2, iters=500, warm=warm)
    assert got["sigma1/w1"] == pytest.approx(spectral.sigma1_exact(w1).item(), rel=1e-4)
    assert got["sigma1/w2"] == pytest.approx(spectral.sigma1_exact(w2).item(), rel=1e-4)
    assert got["sigma1/w2_w1"] == pytest.approx(_sv(w2.double() @ w1.double())[0].item(), rel=1e-5)
    big = Q.mlp_stats(w1, w2, exact_max_dim=0, iters=1000)
    assert big["sigma1/w2_w1"] == pytest.approx(_sv(w2.double() @ w1.double())[0].item(), rel=1e-4)
    # warm start: a single iteration from the stored vectors stays at the converged value
    warm_again = Q.weight_sigma1({"w1": w1}, iters=1, warm=warm)
    assert warm_again["sigma1/w1"] == pytest.approx(spectral.sigma1_exact(w1).item(), rel=1e-4)


def test_sec_curve_of_rank_one_product_is_one():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(D, generator=g), torch.randn(D, generator=g)
    wq = torch.stack([torch.outer(torch.randn(DH, generator=g), a) for _ in range(H)]).reshape(D, D)
    wk = torch.stack([torch.outer(torch.randn(DH, generator=g), b) for _ in range(H)]).reshape(D, D)
    wv = wo = torch.eye(D)
    got = Q.qk_ov_stats(wq, wk, wv, wo, H)
    sizes = N.sec_sizes(DH)
    assert sizes == [1, 2, 4, 8]
    for s in sizes:
        assert got[f"sec/s{s}"] == pytest.approx(1.0, abs=1e-5)


def test_sec_curve_flat_spectrum_and_random_against_explicit():
    # orthonormal rows, W_q^h = W_k^h: every head's product is a rank-d_h projection
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(4)))
    got = Q.qk_ov_stats(q.T, q.T, q.T, q, H)
    for s in N.sec_sizes(DH):
        assert got[f"sec/s{s}"] == pytest.approx(s / DH, abs=1e-5)
    wq, wk, wv, wo = _weights(5)
    got = Q.qk_ov_stats(wq, wk, wv, wo, H)
    for s in N.sec_sizes(DH):
        curves = []
        for h in range(H):
            e = _sv(_head_qk(wq, wk, h)).pow(2)
            curves.append((e[:s].sum() / e.sum()).item())
        assert got[f"sec/s{s}"] == pytest.approx(max(curves), abs=1e-5)


def test_qk_spectrum_stats_against_explicit_d_by_d():
    wq, wk, _, _ = _weights(6)
    got = Q.qk_spectrum_stats(wq, wk, H)
    trace = fro2 = tr2 = var = 0.0
    for h in range(H):
        w = _head_qk(wq, wk, h)  # W_QK = W_q^h^T W_k^h, d x d
        t, f, t2 = torch.trace(w), torch.trace(w.T @ w), torch.trace(w @ w)
        trace, fro2, tr2 = trace + t, fro2 + f, tr2 + t2
        var = var + D * t2 - t**2
    assert got["qk_spectrum/eig_mean_trace"] == pytest.approx(trace.item(), rel=1e-9, abs=1e-9)
    assert got["qk_spectrum/eig_scale_fro2"] == pytest.approx(fro2.item(), rel=1e-9)
    assert got["qk_spectrum/eig_scale_tr2"] == pytest.approx(tr2.item(), rel=1e-9, abs=1e-9)
    assert got["qk_spectrum/eig_var_d2"] == pytest.approx(var.item(), rel=1e-9, abs=1e-9)
    # the variance is d^2 Var of the eigenvalues of W_QK (003 Eq. 8), here via eigvals
    w = _head_qk(wq, wk, 0)
    ev = torch.linalg.eigvals(w)
    d2var = (D * (ev**2).sum() - ev.sum() ** 2).real
    assert (D * torch.trace(w @ w) - torch.trace(w) ** 2).item() == pytest.approx(d2var.item(), rel=1e-6)


def test_norm_stats_and_activation_norms():
    gamma, beta = torch.full((D,), 2.0), torch.ones(D)
    got = Q.norm_stats(gamma, beta, "norm2")
    assert got == {"norm/norm2_gamma": pytest.approx(2 * math.sqrt(D)),
                   "norm/norm2_beta": pytest.approx(math.sqrt(D))}
    assert Q.norm_stats(gamma, None, "norm1") == {"norm/norm1_gamma": pytest.approx(2 * math.sqrt(D))}
    x = torch.randn(3, 5, D)
    grad = torch.randn(3, 5, D)
    got = Q.to_floats(Q.activation_norms(x, grad))
    assert got["norm/x"] == pytest.approx(torch.stack([x[i].norm() for i in range(3)]).mean().item(), rel=1e-6)
    assert got["norm/grad_x"] == pytest.approx(torch.stack([grad[i].norm() for i in range(3)]).mean().item(), rel=1e-6)


def test_entropy_uniform_one_hot_and_mixed_heads():
    b, t = 2, 7
    uniform = torch.full((b, 1, t, t), 1.0 / t)
    one_hot = torch.eye(t).expand(b, 1, t, t)
    got = Q.to_floats(Q.attention_entropy(torch.cat([uniform, one_hot], 1)))
    assert got["entropy/head0"] == pytest.approx(math.log(t))
    assert got["entropy/head1"] == pytest.approx(0.0, abs=1e-12)
    assert got["entropy/min"] == pytest.approx(0.0, abs=1e-12)
    assert got["entropy/mean"] == pytest.approx(math.log(t) / 2)
    assert got["entropy/log_T"] == pytest.approx(math.log(t))


def test_entropy_causal_rows_and_masked_entries():
    t = 6
    causal = torch.ones(t, t).tril()
    probs = (causal / causal.sum(-1, keepdim=True))[None, None].repeat(2, 2, 1, 1)
    per_row = [math.log(i + 1) for i in range(t)]
    got = Q.to_floats(Q.attention_entropy(probs, causal=True))
    assert got["entropy/mean"] == pytest.approx(sum(per_row) / t)
    assert got["entropy/log_T"] == pytest.approx(sum(per_row) / t)
    # masked entries contribute 0 even if the tensor holds junk there
    junk = probs + torch.triu(torch.full((t, t), 0.3), 1)
    assert Q.to_floats(Q.attention_entropy(junk, causal=True))["entropy/mean"] == pytest.approx(sum(per_row) / t)
    mask = causal.bool()
    assert Q.to_floats(Q.attention_entropy(junk, mask=mask))["entropy/mean"] == pytest.approx(sum(per_row) / t)


@pytest.mark.parametrize("shape", [(7, 7), (3, 7, 7), (1, 2, 3, 7, 7)])
def test_entropy_of_probabilities_without_batch_and_head_dims_is_refused_in_one_line(shape):
    with pytest.raises(ValueError, match=r"\(batch, heads, queries, keys\); got shape .*probs\[None\]"):
        Q.attention_entropy(torch.full(shape, 1.0 / 7))


def test_uniform_reference_with_a_mask_per_sample_is_the_mean_over_every_row():
    """The mask broadcasts over heads: its own rows carry the mean of all B x H x T rows."""
    b, h, t = 3, 4, 7
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(b, 1, t, t, generator=g) < 0.6
    mask[0, 0, 2] = False  # a row with no allowed key is left out
    keep = mask & torch.ones(t, t, dtype=torch.bool).tril()
    counts = [int(keep[i, 0, r].sum()) for i in range(b) for _ in range(h) for r in range(t)]
    want = sum(math.log(n) for n in counts if n) / sum(1 for n in counts if n)
    assert float(Q.reference_entropy(torch.Size((b, h, t, t)), mask, causal=True)) == pytest.approx(want, rel=1e-12)
    every_key = torch.ones(b, 1, t, 1, dtype=torch.bool)  # a mask of one column: all keys allowed
    assert float(Q.reference_entropy(torch.Size((b, h, t, t)), every_key)) == pytest.approx(math.log(t), rel=1e-12)


def test_to_floats_keeps_order_and_values_across_dtypes():
    x = torch.tensor(0.1, dtype=torch.float32)
    values = {"a": x, "b": 2.5, "c": torch.tensor(1 / 3, dtype=torch.float64),
              "d": torch.tensor([7], dtype=torch.int64), "e": torch.tensor(0.375, dtype=torch.bfloat16),
              "f": torch.tensor(3.0, requires_grad=True) * 2}
    got = Q.to_floats(values)
    assert list(got) == list(values)
    assert got == {"a": float(x), "b": 2.5, "c": 1 / 3, "d": 7.0, "e": 0.375, "f": 6.0}
    assert all(type(v) is float for v in got.values())


@pytest.mark.parametrize("t, s", [(7, 7), (3, 7), (7, 3), (1, 1)])
def test_uniform_reference_of_causal_rows_counts_each_rows_keys(t, s):
    """Causal without a mask (computed on the host): row i sees min(i + 1, S) keys, as the
    masked path counts them."""
    want = sum(math.log(min(i + 1, s)) for i in range(t)) / t
    shape = torch.Size((2, 3, t, s))
    assert Q.reference_entropy(shape, causal=True) == pytest.approx(want, rel=1e-12, abs=1e-15)
    every_key = torch.ones(1, 1, 1, s, dtype=torch.bool)
    assert float(Q.reference_entropy(shape, every_key, causal=True)) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_entropy_random_probs_against_formula():
    probs = torch.softmax(torch.randn(3, 4, 5, 5, generator=torch.Generator().manual_seed(7)), -1).double()
    expect = (-(probs * probs.log()).sum(-1)).mean((0, 2))
    got = Q.head_entropy(probs)
    assert torch.allclose(got, expect)


def test_token_similarity_identical_centred_zero_and_formula():
    row = torch.randn(1, 1, D)
    assert float(Q.token_similarity(row.expand(2, 9, D))) == pytest.approx(1.0)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    assert float(Q.token_similarity(x - x.mean(1, keepdim=True))) == pytest.approx(0.0, abs=1e-12)
    assert float(Q.token_similarity(torch.zeros(2, 9, D))) == 1.0
    p = torch.full((9, 9), 1 / 9, dtype=torch.float64)
    expect = sum(((p @ x[i]).norm() ** 2 / x[i].norm() ** 2).item() for i in range(2)) / 2
    assert float(Q.token_similarity(x)) == pytest.approx(expect, rel=1e-12)


def _bound_direct(s, t):
    """Theorem 3.1 written out with math, float64."""
    beta = math.exp(-s * math.sqrt(t / (t - 1)))
    return math.log(1 + (t - 1) * beta) + s * math.sqrt(t * (t - 1)) * beta / (1 + (t - 1) * beta)


def _single_head(seed, d=16, d_h=4, t=12, x_scale=0.25):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(d_h, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    wk = torch.randn(d_h, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    x = x_scale * torch.randn(2, t, d, generator=g, dtype=torch.float64)
    return wq, wk, x


def test_entropy_bound_matches_direct_formula():
    wq, wk, x = _single_head(0)
    d_h, t = wq.shape[0], x.shape[1]
    sigma = torch.linalg.matrix_norm(wq.T @ wk, 2).item() / math.sqrt(d_h)
    sx = [torch.linalg.matrix_norm(x[b], 2).item() ** 2 for b in range(2)]
    expect = sum(_bound_direct(sigma * s, t) for s in sx) / 2
    got = Q.entropy_lower_bound(wq, wk, x)
    assert got.shape == (1,)
    assert got.item() == pytest.approx(expect, rel=1e-6)
    causal = sum(sum([0.0] + [_bound_direct(sigma * s, n) for n in range(2, t + 1)]) / t for s in sx) / 2
    assert Q.entropy_lower_bound(wq, wk, x, causal=True).item() == pytest.approx(causal, rel=1e-6)
    # heads stacked give the per-head values; huge s gives 0, s = 0 gives log T
    two = Q.entropy_lower_bound(torch.stack([wq, 0 * wq]), torch.stack([wk, wk]), x)
    assert two[0].item() == pytest.approx(expect, rel=1e-6)
    assert two[1].item() == pytest.approx(math.log(t))
    assert Q.theorem31_bound(torch.tensor(1e6), torch.tensor(50.0)).item() == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_measured_entropy_respects_theorem31(seed, causal):
    wq, wk, x = _single_head(seed)
    d_h, t = wq.shape[0], x.shape[1]
    logits = (x @ wq.T) @ (x @ wk.T).transpose(-1, -2) / math.sqrt(d_h)  # q k^T / sqrt(d_h)
    if causal:
        logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    probs = logits.softmax(-1)[:, None]
    measured = Q.head_entropy(probs, causal=causal)[0].item()
    bound = Q.entropy_lower_bound(wq, wk, x, causal=causal)[0].item()
    assert bound > 0.3  # a non-trivial regime, not a vacuous bound
    assert measured >= bound
    # and row by row, the theorem's actual statement
    sigma = torch.linalg.matrix_norm(wq.T @ wk, 2) / math.sqrt(d_h)
    for b in range(2):
        s = sigma * torch.linalg.matrix_norm(x[b], 2) ** 2
        row_ent = -torch.special.xlogy(probs[b, 0], probs[b, 0]).sum(-1)
        n = torch.arange(1, t + 1) if causal else torch.full((t,), t)
        assert bool((row_ent >= Q.theorem31_bound(s, n) - 1e-12).all())


@pytest.mark.parametrize("causal", [False, True])
def test_entropy_bound_under_a_key_mask_counts_each_rows_allowed_keys(causal):
    """A padding mask (sequence 0 sees its first 5 keys, sequence 1 all 12; a query-shaped
    mask for good measure): each row's bound is Theorem 3.1's for its allowed keys, averaged
    over the rows the measured entropy averages over, and stays below it (with every key's
    count, the first sequence's bound was above its entropy)."""
    wq, wk, x = _single_head(4, x_scale=0.05)  # small logits: entropies near log(keys)
    t = x.shape[1]
    lengths = torch.tensor([5, t])
    mask = (torch.arange(t)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    sigma = torch.linalg.matrix_norm(wq.T @ wk, 2) / math.sqrt(wq.shape[0])
    rows = []
    for b in range(2):
        s = (sigma * torch.linalg.matrix_norm(x[b], 2) ** 2).item()
        for i in range(t):
            n = min(i + 1, lengths[b].item()) if causal else lengths[b].item()
            rows.append(_bound_direct(s, n) if n > 1 else 0.0)
    got = Q.entropy_lower_bound(wq, wk, x, causal=causal, mask=mask)
    assert got.shape == (1,) and got.item() == pytest.approx(sum(rows) / len(rows), rel=1e-9)
    logits = (x @ wq.T) @ (x @ wk.T).transpose(-1, -2) / math.sqrt(wq.shape[0])
    keep = mask[:, 0] & (torch.ones(t, t, dtype=torch.bool).tril() if causal else True)
    probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)[:, None]
    measured = Q.head_entropy(probs, mask, causal)[0].item()
    assert got.item() <= measured
    if not causal:
        assert Q.entropy_lower_bound(wq, wk, x[:1])[0].item() > Q.head_entropy(probs[:1], mask[:1])[0].item()
    # a mask that allows every key changes nothing; one that leaves a row no key drops the row
    assert torch.allclose(Q.entropy_lower_bound(wq, wk, x, causal, mask=torch.ones(t, t, dtype=torch.bool)),
                          Q.entropy_lower_bound(wq, wk, x, causal), rtol=1e-12)
    none_for_last = torch.ones(t, t, dtype=torch.bool)
    none_for_last[-1] = False
    kept = Q.entropy_lower_bound(wq, wk, x, False, mask=none_for_last)
    per_b = [(sigma * torch.linalg.matrix_norm(x[b], 2) ** 2).item() for b in range(2)]
    assert kept.item() == pytest.approx(sum(_bound_direct(s, t) for s in per_b) / 2, rel=1e-9)


def _biased_logits(wq, wk, x, bq, bk, causal):
    t = x.shape[1]
    logits = (x @ wq.T + bq) @ (x @ wk.T + bk).transpose(-1, -2) / math.sqrt(wq.shape[0])
    if causal:
        logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return logits


@pytest.mark.parametrize("causal", [False, True])
def test_theorem31_bound_with_qk_biases(causal):
    """Row i's logits are X W_k^T [W_q | b_q] [x_i; 1] plus a constant (from b_k), so the bound
    is the theorem's with s = ||[W_q | b_q]^T W_k|| / sqrt(d_h) ||X|| ||[X | 1]||, and it holds
    row by row."""
    wq, wk, x = _single_head(2)
    d_h, t = wq.shape[0], x.shape[1]
    g = torch.Generator().manual_seed(7)
    bq, bk = 0.5 * torch.randn(2, d_h, generator=g, dtype=torch.float64)
    probs = _biased_logits(wq, wk, x, bq, bk, causal).softmax(-1)
    wqa = torch.cat([wq, bq[:, None]], 1)
    sigma = torch.linalg.matrix_norm(wqa.T @ wk, 2).item() / math.sqrt(d_h)
    xa = torch.cat([x, torch.ones(*x.shape[:2], 1, dtype=torch.float64)], -1)
    s = [sigma * torch.linalg.matrix_norm(x[b], 2).item() * torch.linalg.matrix_norm(xa[b], 2).item()
         for b in range(2)]
    n_keys = list(range(2, t + 1)) if causal else [t] * t
    expect = sum(sum(_bound_direct(sb, n) for n in n_keys) / t for sb in s) / 2
    got = Q.entropy_lower_bound(wq, wk, x, causal, bq_h=bq)
    assert got.item() == pytest.approx(expect, rel=1e-6)
    assert 0.3 < got.item() <= Q.head_entropy(probs[:, None], causal=causal)[0].item()
    for b in range(2):
        row_ent = -torch.special.xlogy(probs[b], probs[b]).sum(-1)
        n = torch.arange(1, t + 1) if causal else torch.full((t,), t)
        assert bool((row_ent >= Q.theorem31_bound(torch.tensor(s[b]), n) - 1e-12).all())


def test_a_q_bias_can_take_the_entropy_below_the_bias_free_bound():
    """Why the bias counts: with a large q bias, the bound of W_q, W_k alone is no bound."""
    wq, wk, x = _single_head(2)
    g = torch.Generator().manual_seed(7)
    bq, bk = 3.0 * torch.randn(2, wq.shape[0], generator=g, dtype=torch.float64)
    measured = Q.head_entropy(_biased_logits(wq, wk, x, bq, bk, False).softmax(-1)[:, None])[0].item()
    assert Q.entropy_lower_bound(wq, wk, x).item() > measured
    assert Q.entropy_lower_bound(wq, wk, x, bq_h=bq).item() <= measured


def test_block_metric_names_follow_the_contract():
    wq, wk, wv, wo = _weights(8)
    g = torch.Generator().manual_seed(8)
    w1, w2 = torch.randn(2 * D, D, generator=g), torch.randn(D, 2 * D, generator=g)
    got = Q.block_weight_metrics("blocks.3", wq=wq, wk=wk, wv=wv, wo=wo, w1=w1, w2=w2, num_heads=H,
                                 norm1=(torch.ones(D), torch.zeros(D)), norm2=(torch.ones(D), None))
    expect = {f"sigma1/blocks.3/{q}" for q in ("wq", "wk", "wv", "wo", "w1", "w2", "w2_w1",
                                               "wq_t_wk_max", "wq_t_wk_mean", "wq_t_wk_full",
                                               "wo_wv_max", "wo_wv_mean", "wo_wv_full")}
    expect |= {f"sec/blocks.3/s{s}" for s in (1, 2, 4, 8)}
    expect |= {f"qk_spectrum/blocks.3/{q}" for q in N.QK_STATS}
    expect |= {"norm/blocks.3/norm1_gamma", "norm/blocks.3/norm1_beta", "norm/blocks.3/norm2_gamma"}
    assert set(got) == expect
    assert all(isinstance(v, float) for v in got.values())
    probs = torch.softmax(torch.randn(2, H, 5, 5), -1)
    x = torch.randn(2, 5, D)
    probe = Q.to_floats(Q.block_probe_values("blocks.3", probs=probs, attn_input=x, wq=wq, wk=wk, num_heads=H,
                                                   block_input=x, block_input_grad=x, per_head=True))
    assert set(probe) == ({"entropy/blocks.3/min", "entropy/blocks.3/mean", "entropy/blocks.3/log_T",
                           "entropy/blocks.3/bound_min", "token_sim/blocks.3", "norm/blocks.3/x",
                           "norm/blocks.3/grad_x"}
                          | {f"entropy/blocks.3/head{h}" for h in range(H)}
                          | {f"entropy/blocks.3/bound_head{h}" for h in range(H)})
    assert probe["entropy/blocks.3/bound_min"] <= probe["entropy/blocks.3/min"]


def test_head_entropy_leaves_out_rows_with_no_allowed_key():
    """Uniform rows over T keys score log T; a row whose every key is masked is not a zero in the mean."""
    t = 5
    mask = torch.ones(1, 1, t, t, dtype=torch.bool)
    mask[..., 0, :] = False
    probs = torch.full((1, 1, t, t), 1.0 / t).masked_fill(~mask, 0.0)
    assert Q.head_entropy(probs, mask=mask)[0].item() == pytest.approx(math.log(t), rel=1e-6)  # fp32 sums
