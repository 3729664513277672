"""spectral.py's shapes and power iteration against exact SVD."""

import pytest
import torch

from stabletrain.spectral import as_matrix, matrix_shape, power_iteration, random_unit, sigma1_exact


@pytest.mark.parametrize("shape, expect", [
    ((1, 197, 768), (197, 768)),  # timm pos_embed
    ((1, 1, 768), (768,)),  # cls_token: a vector, whose sigma1 is its norm
    ((64, 3, 16, 16), (64, 768)),  # conv patch embedding
    ((2304, 768), (2304, 768)),
    ((768,), (768,)),
    ((), ()),
])
def test_matrix_shape_and_as_matrix(shape, expect):
    assert matrix_shape(shape) == expect
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    m = as_matrix(t)
    assert m.shape == expect and torch.equal(m.flatten(), t.flatten())


def test_batched_power_iteration_reaches_the_exact_sigma1():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 12, 7, generator=g, dtype=torch.float64)
    u, v = random_unit(5, 12, dtype=torch.float64), random_unit(5, 7, dtype=torch.float64)
    sigma, u, v = power_iteration(w, u, v, iters=200)
    exact = torch.stack([sigma1_exact(m) for m in w])
    torch.testing.assert_close(sigma, exact, rtol=1e-10, atol=0)
    torch.testing.assert_close(torch.einsum("bm,bmn,bn->b", u, w, v), exact, rtol=1e-10, atol=0)  # u^T W v
    assert torch.allclose(u.norm(dim=-1), torch.ones(5, dtype=torch.float64))


def test_process_group_form_computes_the_same_iteration():
    """With one rank holding all rows, the all-reduce form is the plain iteration (the two-rank
    split is tested in tests/distributed/test_fsdp.py)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        w = torch.randn(3, 9, 4, dtype=torch.float64)
        u, v = random_unit(3, 9, dtype=torch.float64), random_unit(3, 4, dtype=torch.float64)
        plain = power_iteration(w, u, v, iters=3)
        grouped = power_iteration(w, u, v, iters=3, group=dist.group.WORLD)
        for a, b in zip(plain, grouped):
            torch.testing.assert_close(a, b, rtol=1e-14, atol=0)
    finally:
        dist.destroy_process_group()
