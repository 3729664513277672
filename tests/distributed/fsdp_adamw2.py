"""AdamW² on FSDP2-sharded parameters against AdamW² on the whole model, step by step.

Run by tests/distributed/test_fsdp.py as ``torchrun --nproc_per_node=2 fsdp_adamw2.py``
(gloo, CPU, float64), on a 1-D mesh (FSDP2) and a (1, 2) mesh (HSDP's placements). Every
rank sees the same batches, so FSDP's averaged, reduce-scattered gradients are the whole
model's; from the same RNG state both optimizers start their power iterations from the same
vectors, so with the default three iterations they must take the same steps up to summation
order, although each rank holds only some rows of each matrix (uneven ones among them) and
one matrix lives on rank 0 alone. A resume from per-rank state dicts, or through
torch.distributed.checkpoint, continues bit for bit. Prints "fsdp adamw2 ok" on success.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from stabletrain.optim import AdamW2
from tests.distributed.common import finish


class Mixed(nn.Module):
    """Matrices that FSDP splits evenly (8 rows), unevenly (5 rows: 3 + 2), a conv kernel, a
    (1, 5, 6) table that as_matrix squeezes (dim 0 has size 1: rank 0 holds all of it), a
    bounded gain and a free bias."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def spiked(rows, cols):
            a, b = torch.randn(rows, 1, generator=g), torch.randn(1, cols, generator=g)
            return torch.randn(rows, cols, generator=g) / 3 + 2 * (a / a.norm()) @ (b / b.norm())

        self.w1 = nn.Parameter(spiked(8, 6))
        self.w2 = nn.Parameter(spiked(8, 6))
        self.w3 = nn.Parameter(spiked(5, 8))
        self.conv = nn.Parameter(spiked(4, 8).reshape(4, 2, 2, 2))
        self.table = nn.Parameter(spiked(5, 6)[None])
        self.gain = nn.Parameter(1 + torch.randn(5, generator=g) / 10)
        self.bias = nn.Parameter(torch.randn(8, generator=g) / 3)

    def forward(self, x):
        h = torch.tanh(x @ self.w1.T + self.bias) * torch.sigmoid(x @ self.w2.T)
        h = torch.cat([h @ self.w3.T, h @ self.conv.reshape(4, 8).T], -1)  # 9
        return (h[:, :5] * self.gain + (x @ self.table[0].T) + h[:, 5:].sum(-1, keepdim=True)).sin()


def groups(model):
    named = dict(model.named_parameters())
    mats = ["w1", "w2", "w3", "conv", "table"]
    return [
        {"params": [named[n] for n in mats], "names": mats},
        {"params": [named["gain"]], "names": ["gain"], "bound": True, "weight_decay": 0.0},
        {"params": [named["bias"]], "names": ["bias"], "weight_decay": 0.0},
    ]


def check(mesh_shape):
    """FSDP2 on a 1-D mesh, or HSDP on a (replicate, shard) mesh, against the whole model."""
    rank = dist.get_rank()

    def mesh():
        names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
        return init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)

    torch.manual_seed(0)  # the same global RNG on every rank, as a seeded job has
    whole = Mixed().double()
    sharded = copy.deepcopy(whole)
    fully_shard(sharded, mesh=mesh())
    for p in sharded.parameters():
        assert isinstance(p, DTensor) and len(p.placements) == len(mesh_shape) and p.placements[-1].is_shard(0)
    local_rows = {n: p.to_local().shape[0] for n, p in sharded.named_parameters()}
    assert local_rows["w3"] == (3 if rank == 0 else 2) and local_rows["table"] == 1 - rank

    kw = {"lr": 0.05, "betas": (0.9, 0.95), "weight_decay": 0.1, "tau": 0.01}  # power_iters 3
    ref, opt = AdamW2(groups(whole), **kw), AdamW2(groups(sharded), **kw)
    g = torch.Generator().manual_seed(1)
    mean = torch.randn(1, 6, generator=g, dtype=torch.float64)
    data = [(0.3 * torch.randn(16, 6, generator=g, dtype=torch.float64) + mean,
             torch.randn(16, 5, generator=g, dtype=torch.float64)) for _ in range(8)]

    def train(model, o, x, y):
        model.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        o.step()

    hit = []
    for step, (x, y) in enumerate(data):
        if step == 4:  # what each rank would save in a checkpoint of its own
            saved = copy.deepcopy((sharded.state_dict(), opt.state_dict()))
        torch.manual_seed(step)  # the same RNG state for both: the same fresh start vectors
        train(whole, ref, x, y)
        torch.manual_seed(step)
        train(sharded, opt, x, y)
        got, want = opt.bound_stats(), ref.bound_stats()
        hit.append(want["bound_fraction"])
        assert got["bound_fraction"] == want["bound_fraction"], (step, got, want)
        for name, lr_eff in want["lr_eff"].items():
            assert abs(got["lr_eff"][name] - lr_eff) <= 1e-12 * lr_eff, (step, name, got["lr_eff"][name], lr_eff)
        for (name, p), q in zip(sharded.named_parameters(), whole.parameters()):
            torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-12, atol=1e-14, msg=f"step {step} {name}")
    assert min(hit) > 0.5, hit  # the bound binds: the sharded sigma1 really decides the steps
    state = opt.state[dict(sharded.named_parameters())["w3"]]
    assert isinstance(state["exp_avg"], DTensor) and isinstance(state["w_u"], DTensor)
    assert state["w_u"].shape == (5, 1) and state["w_u"].to_local().shape == (local_rows["w3"], 1)
    table = opt.state[dict(sharded.named_parameters())["table"]]["w_u"]  # rank 0 holds all 5 rows
    assert table.shape == (1, 5) and table.to_local().shape == (1 - rank, 5)

    # resume from step 4 on a fresh sharded model, from the per-rank state dicts and through
    # torch.distributed.checkpoint (saved from them): the same numbers, bit for bit
    ckpt = f"dcp_{len(mesh_shape)}d"
    dcp.save({"model": saved[0], "optim": _fqn_optim_state(sharded, saved[1])}, checkpoint_id=ckpt)
    for source in ("per-rank", "dcp"):
        resumed = Mixed().double()
        fully_shard(resumed, mesh=mesh())
        opt2 = AdamW2(groups(resumed), **kw)
        if source == "per-rank":
            resumed.load_state_dict(saved[0])
            opt2.load_state_dict(saved[1])
        else:
            lr = [g["lr"] for g in opt2.param_groups]
            for g in opt2.param_groups:
                g["lr"] = 0.0
            train(resumed, opt2, *data[0])  # creates the state that DCP loads into (lr 0: no change)
            for g, r in zip(opt2.param_groups, lr):
                g["lr"] = r
            state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, opt2)}
            dcp.load(state, checkpoint_id=ckpt)
            set_model_state_dict(resumed, state["model"])
            set_optimizer_state_dict(resumed, opt2, state["optim"])
        for x, y in data[4:]:
            train(resumed, opt2, x, y)
        for (name, p), q in zip(resumed.named_parameters(), sharded.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), (source, name)


def _fqn_optim_state(model, state_dict):
    """A per-rank optimizer state dict in the FQN-keyed form torch.distributed.checkpoint uses."""
    probe = AdamW2(groups(model))
    probe.load_state_dict(state_dict)
    return get_optimizer_state_dict(model, probe)


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    check((world,))  # FSDP2
    check((1, world))  # HSDP: the rows are split along the mesh's second dim
    finish("fsdp adamw2 ok")


if __name__ == "__main__":
    main()
