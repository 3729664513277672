"""sigmaReparam on FSDP2-sharded weights against the same model unsharded, step by step.

Run by tests/distributed/test_fsdp.py as ``torchrun --nproc_per_node=2 fsdp_reparam.py``
(gloo, CPU, float64 weights; ``u, v`` are fp32 buffers, so they agree to fp32 summation
order). The fused ``qkv`` has 15 rows, split 8 + 7 by FSDP, so a rank boundary
falls inside the key slice; the other linear has 5 rows (3 + 2) and the conv 4. For each
``qkv`` layout and ``power_iters`` in 1, 2 the sharded power iteration must leave every
``u, v`` where the unsharded one does, the forward (gathered weights, sigma from the
replicated vectors) must give the same output, and SGD steps through ``W / sigma`` the same
weights. Prints "fsdp reparam ok" on success.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stabletrain.layers.reparam import PowerStep, apply_reparam, sigma_reparams
from tests.distributed.common import finish


class Attn(nn.Module):
    def __init__(self, d: int = 5):
        super().__init__()
        self.num_heads = 1
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = torch.softmax(q @ k.transpose(-1, -2), -1)
        return x + self.proj(a @ v)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 2, stride=2)  # 4 rows of 8
        self.blocks = nn.ModuleList([Attn(), Attn()])

    def forward(self, img):
        x = self.conv(img).flatten(2).transpose(1, 2)  # (B, 4 tokens, 4)
        x = torch.nn.functional.pad(x, (0, 1))  # d = 5
        for blk in self.blocks:
            x = blk(x)
        return x


def main():
    dist.init_process_group("gloo")
    compare(dist.get_world_size())
    finish("fsdp reparam ok")


def compare(world: int) -> None:
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (world,))
    for apply_to, split, iters in (("all", "joint", 1), ("all", "q_k_v", 2), ("qk", "qk_v", 1), ("all", "qk_v", 3)):
        cfg = SimpleNamespace(name="sigma", apply_to=apply_to, qkv_split=split, gamma_init="one", power_iters=iters)
        torch.manual_seed(1)
        whole = apply_reparam(Net(), cfg)
        sharded = copy.deepcopy(whole)
        for blk in sharded.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        hooks = PowerStep(whole), PowerStep(sharded)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (whole, sharded)]
        img = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(2))
        for _ in range(3):
            outs = []
            for m, opt, hook in zip((whole, sharded), opts, hooks):
                out = m(img)
                out.square().mean().backward()
                opt.step()
                opt.zero_grad()
                hook()
                outs.append(out.detach())
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
            for (w_a, rep_a), (w_b, rep_b) in zip(sigma_reparams(whole), sigma_reparams(sharded)):
                torch.testing.assert_close(w_b.full_tensor(), w_a.detach(), rtol=1e-5, atol=1e-6)
                for pa, pb in zip(rep_a.parts, rep_b.parts):
                    torch.testing.assert_close(pb.u, pa.u, rtol=1e-5, atol=1e-6)
                    torch.testing.assert_close(pb.v, pa.v, rtol=1e-5, atol=1e-6)
                    assert not torch.equal(pa.u, torch.zeros_like(pa.u))


if __name__ == "__main__":
    main()
