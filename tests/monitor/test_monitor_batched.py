"""The batched weight pass (quantities.stacked_weight_metrics / model_weight_metrics) against
exact SVDs, explicit formulas and the per-block reference, on ViT- and Swin-shaped stacks."""

import math

import pytest
import torch

from stabletrain import spectral
from stabletrain.models.registry import transformer_blocks
from stabletrain.monitor import names as N
from stabletrain.monitor import quantities as Q
from tests.helpers import make_cfg, model_of

EXACT = dict(iters_cold=400, iters_warm=400)  # power iteration run to convergence
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # the GPU box runs both
POWER = {N.WQ, N.WK, N.WV, N.WO, N.W1, N.W2, N.W2_W1, N.WQ_T_WK_FULL, N.WO_WV_FULL}


def _sv(m):
    return torch.linalg.svdvals(m.double())


def _block(name, seed, d, heads, hidden, norms=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(device)

    nt = ((("norm1_gamma", 1 + r(d)), ("norm1_beta", r(d)), ("norm2_gamma", 1 + r(d))) if norms else ())
    return Q.BlockWeights(name, r(d, d), r(d, d), r(d, d), r(d, d), r(hidden, d), r(d, hidden), heads, nt)


def _explicit(b: Q.BlockWeights) -> dict[str, float]:
    """Every metric of one block from d x d products and their SVDs, float64."""
    d, h = b.wq.shape[1], b.num_heads
    k = b.wq.shape[0] // h
    wq, wk, wv, wo, w1, w2 = (w.cpu().double() for w in (b.wq, b.wk, b.wv, b.wo, b.w1, b.w2))
    qk_heads = [wq[i * k:(i + 1) * k].T @ wk[i * k:(i + 1) * k] for i in range(h)]  # d x d each
    ov_heads = [wo[:, i * k:(i + 1) * k] @ wv[i * k:(i + 1) * k] for i in range(h)]
    qk = torch.stack([_sv(m)[:k] for m in qk_heads])  # (H, d_h): the nonzero spectrum
    ov1 = torch.stack([_sv(m)[0] for m in ov_heads])
    s = lambda q: N.metric(N.SIGMA1, b.name, q)  # noqa: E731
    out = {s(N.WQ): _sv(wq)[0], s(N.WK): _sv(wk)[0], s(N.WV): _sv(wv)[0], s(N.WO): _sv(wo)[0],
           s(N.W1): _sv(w1)[0], s(N.W2): _sv(w2)[0], s(N.W2_W1): _sv(w2 @ w1)[0],
           s(N.WQ_T_WK_FULL): _sv(wq.T @ wk)[0], s(N.WO_WV_FULL): _sv(wo @ wv)[0],
           s(N.WQ_T_WK_MAX): qk[:, 0].max(), s(N.WQ_T_WK_MEAN): qk[:, 0].mean(),
           s(N.WO_WV_MAX): ov1.max(), s(N.WO_WV_MEAN): ov1.mean()}
    for i in range(h):
        out[s(f"wq_t_wk_head{i}")] = qk[i, 0]
        out[s(f"wo_wv_head{i}")] = ov1[i]
    energy = qk.pow(2)
    for sz in N.sec_sizes(k):
        out[N.metric(N.SEC, b.name, f"s{sz}")] = (energy[:, :sz].sum(1) / energy.sum(1)).max()
    tr = sum(torch.trace(m) for m in qk_heads)
    fro2 = sum(torch.trace(m.T @ m) for m in qk_heads)
    tr2 = sum(torch.trace(m @ m) for m in qk_heads)
    var = sum(d * torch.trace(m @ m) - torch.trace(m) ** 2 for m in qk_heads)
    out.update({N.metric(N.QK_SPECTRUM, b.name, q): v for q, v in zip(N.QK_STATS, (tr, fro2, tr2, var))})
    out.update({N.metric(N.NORM, b.name, q): t.cpu().double().norm() for q, t in b.norms})
    return {key: float(v) for key, v in out.items()}


def _check(got, b, power_rel=1e-4):
    want = _explicit(b)
    if not any("_head" in k for k in got):
        want = {k: v for k, v in want.items() if "_head" not in k}
    assert set(want) <= set(got)
    scale = 1 + want[N.metric(N.QK_SPECTRUM, b.name, N.EIG_SCALE_FRO2)]
    for key, v in want.items():
        group, _, q = key.split("/")
        if group == N.SIGMA1 and q in POWER:
            assert got[key] <= v * (1 + 1e-5), key  # power iteration: a lower bound (up to fp32 rounding)
            assert got[key] == pytest.approx(v, rel=power_rel), key
        elif group == N.SEC:
            assert got[key] == pytest.approx(v, abs=1e-7), key
        elif q.startswith(N.WO_WV):  # top eigenvalue by repeated squaring: error < (d_h - 1) / (e 2^24)
            assert got[key] <= v * (1 + 1e-9) and got[key] == pytest.approx(v, rel=1e-6), key
        else:  # per-head spectra, traces (which may cancel to ~0: abs scaled), norms: exact up to rounding
            assert got[key] == pytest.approx(v, rel=1e-7, abs=1e-9 * scale), key


def _reference(b: Q.BlockWeights, per_head=True) -> dict[str, float]:
    b = b._replace(**{f: getattr(b, f).cpu() for f in ("wq", "wk", "wv", "wo", "w1", "w2")},
                   norms=tuple((q, t.cpu()) for q, t in b.norms))
    norm = dict(b.norms)
    return Q.block_weight_metrics(b.name, wq=b.wq, wk=b.wk, wv=b.wv, wo=b.wo, w1=b.w1, w2=b.w2, num_heads=b.num_heads,
                                  norm1=(norm.get("norm1_gamma"), norm.get("norm1_beta")),
                                  norm2=(norm.get("norm2_gamma"), norm.get("norm2_beta")),
                                  per_head=per_head, iters=400, exact_max_dim=1024)


@pytest.mark.parametrize("device", DEVICES)
def test_vit_shaped_stack_matches_exact_svd_and_the_per_block_reference(device):
    blocks = [_block(f"blocks.{i}", i, 24, 3, 48, device=device) for i in range(4)]
    got = Q.stacked_weight_metrics(blocks, per_head=True, **EXACT)
    # On an H100 the device's random start vectors left sigma1(W_1) 3e-4 short after 400 steps.
    power_rel = 1e-4 if device == "cpu" else 1e-3
    for b in blocks:
        _check(got, b, power_rel=power_rel)
        ref = _reference(b)
        mine = {k: v for k, v in got.items() if k.split("/")[1] == b.name}
        assert list(mine) == list(ref)  # same names, same order as the per-block path
        for key in ref:  # power-iteration values: against the exact SVD above (the reference's are approximate)
            if key.split("/")[-1] not in POWER:
                assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9), key
    without = Q.stacked_weight_metrics(blocks, per_head=False, **EXACT)
    assert set(without) == {k for k in got if "_head" not in k}


@pytest.mark.parametrize("device", DEVICES)
def test_swin_shaped_stages_of_two_widths_and_chunks(device):
    # stage 0: d=16, 2 heads of 8; stage 1: d=32, 4 heads of 8 (and a d_h=16 variant), interleaved
    blocks = [_block("layers.0.blocks.0", 0, 16, 2, 64), _block("layers.1.blocks.0", 1, 32, 4, 128),
              _block("layers.0.blocks.1", 2, 16, 2, 64), _block("layers.1.blocks.1", 3, 32, 4, 128),
              _block("layers.2.blocks.0", 4, 32, 2, 64, norms=False)]
    blocks = [b._replace(**{f: getattr(b, f).to(device) for f in ("wq", "wk", "wv", "wo", "w1", "w2")},
                         norms=tuple((q, t.to(device)) for q, t in b.norms)) for b in blocks]
    got = Q.stacked_weight_metrics(blocks, per_head=True, **EXACT)
    assert [k.split("/")[1] for k in got] == sorted((k.split("/")[1] for k in got),
                                                    key=[b.name for b in blocks].index)  # input order kept
    for b in blocks:
        _check(got, b)
    assert {f"sec/layers.2.blocks.0/s{s}" for s in (1, 2, 4, 8, 16)} <= set(got)
    assert not any(k.startswith("norm/layers.2.blocks.0") for k in got)
    # a tiny stacking budget: one block per chunk, same values
    one_by_one = Q.stacked_weight_metrics(blocks, per_head=True, budget_bytes=1, **EXACT)
    assert list(one_by_one) == list(got)
    for key in got:
        assert one_by_one[key] == pytest.approx(got[key], rel=1e-5, abs=1e-12), key


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_block_is_flagged_and_the_others_are_unaffected(device):
    blocks = [_block(f"blocks.{i}", i, 24, 3, 48, device=device) for i in range(4)]
    clean = Q.stacked_weight_metrics(blocks, per_head=True, **EXACT)
    w1 = blocks[1].w1.clone()
    w1[3, 5] = float("nan")
    wq = blocks[2].wq.clone()
    wq[0, 0] = float("inf")
    bad = list(blocks)
    bad[1], bad[2] = blocks[1]._replace(w1=w1), blocks[2]._replace(wq=wq)
    warm = {}
    got = Q.stacked_weight_metrics(bad, per_head=True, warm=warm, **EXACT)
    for b in bad[1:3]:
        assert {k for k in got if k.split("/")[1] == b.name} == {f"sigma1/{b.name}/nonfinite_weights"}
        assert got[f"sigma1/{b.name}/nonfinite_weights"] == 1.0
    for key, v in got.items():
        if key.split("/")[1] in ("blocks.0", "blocks.3"):
            assert v == pytest.approx(clean[key], rel=1e-5, abs=1e-12), key
    # the stored start vectors stayed usable: the repaired blocks converge again from them
    assert all(torch.isfinite(v).all() for state in warm.values() for v in state)
    again = Q.stacked_weight_metrics(blocks, per_head=True, warm=warm, **EXACT)
    for b in blocks:
        _check(again, b)


def test_warm_start_keeps_the_converged_value_and_recovers_from_zero_weights():
    blocks = [_block(f"blocks.{i}", i, 24, 3, 48) for i in range(3)]
    warm = {}
    Q.stacked_weight_metrics(blocks, warm=warm, **EXACT)
    one_step = Q.stacked_weight_metrics(blocks, warm=warm, iters_cold=400, iters_warm=1)
    for b in blocks:
        _check(one_step, b)
    # a zero W_o (zero-init projections) gives zeros, not NaN, and leaves no zero vector behind
    zero = [b._replace(wo=torch.zeros_like(b.wo)) for b in blocks]
    warm = {}
    got = Q.stacked_weight_metrics(zero, per_head=True, warm=warm, **EXACT)
    for b in zero:
        for q in ("wo", "wo_wv_full", "wo_wv_max", "wo_wv_mean", "wo_wv_head0"):
            assert got[f"sigma1/{b.name}/{q}"] == pytest.approx(0.0, abs=1e-6)
        assert got[f"sigma1/{b.name}/wq_t_wk_max"] > 0.1
    later = Q.stacked_weight_metrics(blocks, warm=warm, iters_cold=400, iters_warm=400)
    for b in blocks:
        _check(later, b)


def test_rank_one_and_orthonormal_heads_give_the_sec_extremes():
    d, h = 24, 3
    k = d // h
    g = torch.Generator().manual_seed(3)
    a, c = torch.randn(d, generator=g), torch.randn(d, generator=g)
    wq = torch.stack([torch.outer(torch.randn(k, generator=g), a) for _ in range(h)]).reshape(d, d)
    wk = torch.stack([torch.outer(torch.randn(k, generator=g), c) for _ in range(h)]).reshape(d, d)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    w1 = torch.randn(2 * d, d, generator=g)
    rank1 = Q.BlockWeights("blocks.0", wq, wk, torch.eye(d), torch.eye(d), w1, w1.T.contiguous(), h)
    ortho = Q.BlockWeights("blocks.1", q.T, q.T, q.T, q, w1, w1.T.contiguous(), h)
    got = Q.stacked_weight_metrics([rank1, ortho], **EXACT)
    for s in N.sec_sizes(k):
        assert got[f"sec/blocks.0/s{s}"] == pytest.approx(1.0, abs=1e-7)
        assert got[f"sec/blocks.1/s{s}"] == pytest.approx(s / k, abs=1e-6)  # q is orthonormal in fp32
    assert got["sigma1/blocks.1/wq_t_wk_max"] == pytest.approx(1.0, rel=1e-6)
    _check(got, rank1)
    _check(got, ortho)


def test_real_models_vit_gpt_swin_match_the_per_block_reference():
    for name in ("vit_test", "gpt_test", "swin_test"):
        torch.manual_seed(0)
        model = model_of(make_cfg(f"model={name}"))
        blocks = transformer_blocks(model)
        got = Q.model_weight_metrics(blocks, per_head=True, **EXACT)
        ref = {}
        for bname, blk in blocks:
            ref.update(_reference(Q.block_weights(bname, blk)))
        assert list(got) == list(ref), name
        for key in ref:
            if key.split("/")[-1] not in POWER:
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9), (name, key)
        for bname, blk in blocks:  # init weights: sigma1 ~ sigma2, power iteration converges slowly
            _check(got, Q.block_weights(bname, blk), power_rel=1e-2)
        if name == "swin_test":
            assert {b.wq.shape[1] for b in (Q.block_weights(n, m) for n, m in blocks)} == {16, 32}


@pytest.mark.parametrize("budget", [1, 200_000, Q.STACK_BUDGET_BYTES])
def test_block_chunks_cut_a_model_as_the_pass_cuts_its_weights(budget):
    """What a sharded model's weight pass relies on (runner.weight_metrics under FSDP2): the chunks
    found from the raw weights' shapes are the pass's own, so computing chunk by chunk, with one
    warm dict, gives the whole pass's numbers exactly, cold and warm."""
    torch.manual_seed(0)
    # two widths (2 blocks of 20 kB stacked, 3 of 82 kB); parametrized weights
    model = model_of(make_cfg("model=swin_test", "model.depths=[2,3]", "reparam=sigma"))
    blocks = transformer_blocks(model)
    chunks = Q.block_chunks(blocks, budget)
    by_weights = Q._chunks([Q.block_weights(n, b) for n, b in blocks], budget)
    assert [[n for n, _ in c] for c in chunks] == [[w.name for w in c] for c in by_weights]
    assert [len(c) for c in chunks] == {1: [1] * 5, 200_000: [2, 2, 1], Q.STACK_BUDGET_BYTES: [2, 3]}[budget]
    whole_warm, chunked_warm = {}, {}
    for _ in range(2):
        whole = Q.model_weight_metrics(blocks, warm=whole_warm, budget_bytes=budget)
        chunked = {}
        for c in chunks:
            chunked.update(Q.model_weight_metrics(c, warm=chunked_warm, budget_bytes=budget))
        assert chunked == whole


@pytest.mark.parametrize("device", DEVICES)
def test_one_pass_is_one_transfer_and_no_scalar_sync(monkeypatch, device):
    blocks = ([_block(f"blocks.{i}", i, 24, 3, 48, device=device) for i in range(3)]
              + [_block("layers.1.blocks.0", 9, 32, 4, 64, device=device)])
    calls = {"cpu": 0, "tolist": 0}

    def banned(self, *a, **k):
        raise AssertionError("host sync on a scalar")

    for m in ("item", "__float__", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, m, banned)
    for m in calls:
        orig = getattr(torch.Tensor, m)

        def counted(self, *a, _m=m, _orig=orig, **k):
            calls[_m] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, m, counted)
    Q.stacked_weight_metrics(blocks, per_head=True, warm={})
    assert calls["cpu"] == 1  # the single device-to-host copy; tolist only reads host tensors
    assert calls["tolist"] <= 1 + 2 * 2  # norms, then per chunk the finite flags and the table


def test_spectral_pair_power_iteration_and_gram_spectra():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 6, 20, generator=g), torch.randn(5, 6, 20, generator=g)
    state = tuple(spectral.random_unit(*s, generator=g) for s in ((5, 6), (5, 20), (5, 20)))
    sa, sb, sab, _ = spectral.pair_power_iteration(a, b, state, 300)
    for i in range(5):
        assert sa[i].item() == pytest.approx(_sv(a[i])[0].item(), rel=1e-5)
        assert sb[i].item() == pytest.approx(_sv(b[i])[0].item(), rel=1e-5)
        assert sab[i].item() == pytest.approx(_sv(a[i].T @ b[i])[0].item(), rel=1e-5)
    exact = torch.stack([_sv(a[i].double().T @ b[i].double())[:6] for i in range(5)])
    assert torch.allclose(spectral.product_singular_values_gram(a, b), exact, rtol=1e-7, atol=1e-10)
    assert torch.allclose(spectral.product_singular_values(a, b).double(), exact, rtol=1e-4, atol=1e-5)
    a64, b64 = a.double(), b.double()
    c = spectral.gram_product_core(a64 @ a64.mT, b64 @ b64.mT)  # float64 Grams, as the monitor's
    top = spectral.top_eigenvalue(c)
    assert torch.allclose(top.sqrt(), exact[:, 0], rtol=1e-7) and (top.sqrt() <= exact[:, 0] * (1 + 1e-9)).all()
    assert (spectral.top_eigenvalue(torch.zeros(2, 4, 4)) == 0).all()
    # non-finite matrices give NaN rows, the others their spectra
    c[1, 0, 0] = float("nan")
    ev = spectral.symmetric_spectra(c)
    assert torch.isnan(ev[1]).all() and torch.allclose(ev[0].sqrt(), exact[0], rtol=1e-7)


def test_top_eigenvalue_upper_is_the_trace_root_of_the_power_and_never_below_the_top():
    """tr(C^m)^(1/m) from the traces divided out at each squaring, against the eigenvalues."""
    g = torch.Generator().manual_seed(3)
    scale = torch.logspace(-3, 3, 6, dtype=torch.float64)[:, None, None]
    x = torch.randn(6, 40, 9, generator=g, dtype=torch.float64) * scale
    c = x.mT @ x  # (6, 9, 9) PSD, scales from 1e-6 to 1e6
    ev = torch.linalg.eigvalsh(c).clamp_min(0)
    for squarings in (0, 1, 3):
        m = 2**squarings
        expect = (ev / ev[:, -1:]).pow(m).sum(-1).pow(1 / m) * ev[:, -1]
        assert torch.allclose(spectral.top_eigenvalue_upper(c, squarings), expect, rtol=1e-12)
    up = spectral.top_eigenvalue_upper(c)  # 2^24: within 9^(2^-24) of the top, and not below it
    assert (up >= ev[:, -1] * (1 - 1e-13)).all() and (up <= ev[:, -1] * 9 ** 2.0**-24 * (1 + 1e-13)).all()
    assert torch.allclose(spectral.top_eigenvalue(c), ev[:, -1], rtol=1e-6)
    bad = c.clone()
    bad[1, 0, 0] = float("inf")
    out = spectral.top_eigenvalue_upper(torch.cat([bad, torch.zeros(1, 9, 9, dtype=c.dtype)]))
    assert torch.isnan(out[1]) and out[-1] == 0 and torch.equal(out[[0, 2, 3, 4, 5]], up[[0, 2, 3, 4, 5]])
    low = spectral.top_eigenvalue(torch.cat([bad, torch.zeros(1, 9, 9, dtype=c.dtype)]))
    assert torch.isnan(low[1]) and low[-1] == 0  # a non-finite matrix is not taken for a zero one


def test_an_eigensolver_failure_blanks_only_its_own_matrix(monkeypatch):
    """The CPU path solves every block's Grams in one call; where LAPACK gives up on one, the
    others keep their values."""
    solve = torch.linalg.eigvalsh

    def flaky(m):
        if m.dim() == 3 or m[0, 0] == 7:
            raise torch.linalg.LinAlgError("did not converge")
        return solve(m)

    grams = torch.eye(3, dtype=torch.float64).repeat(4, 1, 1) * torch.tensor([1.0, 7.0, 2.0, 3.0])[:, None, None]
    monkeypatch.setattr(torch.linalg, "eigvalsh", flaky)
    top = Q._top_eigenvalue(grams)
    assert torch.isnan(top[1]) and top[[0, 2, 3]].tolist() == [1.0, 2.0, 3.0]


def test_runs_under_a_budget_are_consecutive_and_never_empty():
    assert Q.runs_under([3, 3, 3, 5, 1], 6) == [[0, 1], [2], [3, 4]]
    assert Q.runs_under([10, 1], 6) == [[0], [1]] and Q.runs_under([], 6) == []
    assert Q.runs_under([0, 5, 2], 6) == [[0, 1], [2]]  # a first item of no size opens a run too
    # one block's share: its fused W_qkv in fp32, its input stacked and in fp64, and its input
    # Grams in fp64, four times over
    assert Q.bound_bytes((8, 1024, 768), (2304, 768), False) == (4 * 2304 * 768 + 12 * 8 * 1024 * 768
                                                                 + 4 * 8 * 8 * 768 * 768)
    assert Q.bound_bytes((2, 5, 768), (2304, 768), True) == 4 * 2304 * 768 + 12 * 2 * 5 * 768 + 4 * 8 * 2 * 5 * 5 * 2


def test_repeated_squaring_dispatches_a_few_ops_a_squaring():
    """On a GPU the probe pass's bounds cost host launches, not arithmetic (small batches): each
    squaring is a bmm, a trace and a division; the logs are taken once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    c = torch.eye(4, dtype=torch.float64).expand(3, 2, 4, 4)
    counts = []
    for squarings in (8, 16):
        with Count() as count:
            spectral.top_eigenvalue_upper(c, squarings)
        counts.append(count.ops)
    # a bmm a squaring, and a division by the trace (four ops) every fourth
    assert (counts[1] - counts[0]) / 8 <= 2 and counts[0] <= 2 * 8 + 30, counts


def test_squared_norm_by_squaring_bounds_the_exact_one_from_above():
    """The GPU path of the entropy bound's ||X||_2^2 (repeated squaring) against the CPU path's
    eigensolver, on the smaller Gram either way round."""
    g = torch.Generator().manual_seed(4)
    for shape in ((3, 50, 12), (3, 12, 50)):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        exact = Q._gram_top(Q._gram(x), by_squaring=False)
        assert torch.allclose(exact, torch.linalg.matrix_norm(x, 2) ** 2, rtol=1e-12)
        squared = Q._gram_top(Q._gram(x), by_squaring=True)
        assert (squared >= exact * (1 - 1e-13)).all() and torch.allclose(squared, exact, rtol=5e-7)


@pytest.mark.parametrize("by_squaring", [False, True])
def test_entropy_bounds_of_several_blocks_are_each_blocks_own(monkeypatch, by_squaring):
    """All blocks' norms in one batched call per layout (heads, inputs, a q bias or none, causal
    or not, another width) give what each block gives alone."""
    g = torch.Generator().manual_seed(5)

    def block(h, d_h, d, t, causal, bias):
        w = [torch.randn(h, d_h, d, generator=g, dtype=torch.float64) / math.sqrt(d) for _ in range(2)]
        bq = 0.3 * torch.randn(h, d_h, generator=g, dtype=torch.float64) if bias else None
        return (*w, torch.randn(3, t, d, generator=g, dtype=torch.float64), causal, bq)

    blocks = [block(4, 8, 32, 10, False, False), block(4, 8, 32, 10, True, True), block(4, 8, 32, 10, True, False),
              block(2, 8, 16, 40, False, True), block(4, 8, 32, 10, False, False)]
    alone = [Q.entropy_lower_bounds([b], by_squaring)[0] for b in blocks]
    calls = []
    top = spectral.top_eigenvalue_upper
    monkeypatch.setattr(spectral, "top_eigenvalue_upper", lambda c: calls.append(c.shape) or top(c))
    together = Q.entropy_lower_bounds(blocks, by_squaring)
    for a, b in zip(alone, together):
        assert torch.allclose(a, b, rtol=1e-12) and a.shape == (b.shape[0],)
    # four layouts, the first and last blocks' one: a call for their cores (each block's four
    # heads') and one for their input Grams (each block's three sequences'), and a second Gram
    # call for a layout with a q bias
    assert calls[0] == (2, 4, 8, 8) and len(calls) == 4 + (6 if by_squaring else 0)
    if by_squaring:
        assert calls[1] == (2, 3, 10, 10)


def test_entropy_bounds_dispatch_as_many_ops_for_twelve_blocks_as_for_two():
    """On a GPU each op of the probe pass is a launch: blocks of one layout (a GPT's, a ViT's)
    are stacked, so their bounds cost the host the same whatever their number."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(6)
    block = (torch.randn(4, 8, 32, generator=g), torch.randn(4, 8, 32, generator=g),
             torch.randn(3, 10, 32, generator=g), True, None)
    counts = []
    for n in (2, 12):
        with Count() as count:
            Q.entropy_lower_bounds([block] * n, by_squaring=True)
        counts.append(count.ops)
    assert counts[1] - counts[0] <= 10 * 3, counts  # the stacking copies and each block's result


def test_huge_weights_keep_their_spectral_norms():
    """A diverging run's weights (entries ~1e10, products ~1e20) overflow fp32 norms inside the
    power iteration; the pass must still report sigma1 (scaled), never 0."""
    blocks = [_block("blocks.0", 0, 24, 3, 48)]
    scale = 1e10
    big = [b._replace(**{f: getattr(b, f) * scale for f in ("wq", "wk", "wv", "wo", "w1", "w2")}) for b in blocks]
    small = Q.stacked_weight_metrics(blocks, **EXACT)
    got = Q.stacked_weight_metrics(big, **EXACT)
    for q in POWER:
        key = N.metric(N.SIGMA1, "blocks.0", q)
        power = 2 if q in (N.W2_W1, N.WQ_T_WK_FULL, N.WO_WV_FULL) else 1
        assert got[key] == pytest.approx(small[key] * scale**power, rel=1e-5), key


def test_huge_weights_in_the_per_block_reference():
    b = _block("blocks.0", 0, 24, 3, 48)
    scale = 1e10
    big = b._replace(**{f: getattr(b, f) * scale for f in ("wq", "wk", "wv", "wo", "w1", "w2")})
    small, got = _reference(b), _reference(big)
    for q in POWER:
        key = N.metric(N.SIGMA1, "blocks.0", q)
        power = 2 if q in (N.W2_W1, N.WQ_T_WK_FULL, N.WO_WV_FULL) else 1
        assert got[key] == pytest.approx(small[key] * scale**power, rel=1e-5), key
