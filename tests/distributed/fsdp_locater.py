"""LocAteR's gradient on FSDP2-sharded weights against the same model unsharded.

Run by tests/distributed/test_fsdp.py as ``torchrun --nproc_per_node=2 fsdp_locater.py`` (gloo,
CPU, float64). The model is fsdp_reparam.py's: each ``qkv`` has 15 rows, split 8 + 7, so a rank
boundary falls inside the key slice; plain and under sigmaReparam (whose gain, one row, is all on
rank 0). Each rank takes two micro-batches, FSDP2 reduce-scattering after the second only, and
adds the penalty read through ``with_whole_weights`` to each micro-batch's loss, as the trainer
does; also with the penalty's backward run before, and after, the task's (so FSDP2's reduced
gradient is added to the penalty's, or the penalty's to it). Every sharded gradient must be the
unsharded model's, of the mean task loss over all micro-batches of both ranks plus the penalty
once. Prints "fsdp locater ok" on success.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stabletrain.engine.sharding import set_gradient_sync, with_whole_weights
from stabletrain.layers.reparam import apply_reparam
from stabletrain.losses.locater import Locater, LocaterParams
from tests.distributed.common import finish
from tests.distributed.fsdp_reparam import Net

MICRO = 2  # micro-batches per rank


def main():
    dist.init_process_group("gloo")
    compare(dist.get_rank(), dist.get_world_size())
    finish("fsdp locater ok")


def compare(rank: int, world: int) -> None:
    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (world,))
    term = Locater(LocaterParams(scale_coef=1.0, mean_coef=1.0))
    imgs = torch.randn(world * MICRO, 3, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    for reparam in ("none", "sigma"):
        torch.manual_seed(1)
        whole = Net()
        if reparam == "sigma":
            apply_reparam(whole, SimpleNamespace(name="sigma", apply_to="all", qkv_split="joint", gamma_init="one",
                                                 power_iters=1))
        (sum(whole(img).square().mean() for img in imgs) / len(imgs) + term(whole, None, None, None)).backward()
        for order in ("one backward", "penalty first", "penalty last"):
            sharded = copy.deepcopy(whole)
            sharded.zero_grad(set_to_none=True)
            for blk in sharded.blocks:
                fully_shard(blk, mesh=mesh)
            fully_shard(sharded, mesh=mesh)
            for i, img in enumerate(imgs[rank * MICRO:(rank + 1) * MICRO]):
                set_gradient_sync(sharded, i == MICRO - 1)
                task = sharded(img).square().mean() / MICRO
                penalty = term(sharded, None, None, None, whole_weights=with_whole_weights) / MICRO
                if order == "one backward":
                    (task + penalty).backward()
                else:
                    for part in ((penalty, task) if order == "penalty first" else (task, penalty)):
                        part.backward()
            for (name, p), ref in zip(sharded.named_parameters(), whole.parameters()):
                where = f"{reparam}, {order}: {name}"
                torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=1e-6, atol=1e-9,
                                           msg=lambda m, where=where: f"{where}: {m}")
                if order == "penalty first" and name.endswith(("qkv.weight", "qkv.parametrizations.weight.original")):
                    # the penalty's .grad (FSDP2 added to it in place): this slice, not a view of the whole
                    mine = p.grad.to_local()
                    assert mine.untyped_storage().nbytes() == mine.numel() * mine.element_size(), where


if __name__ == "__main__":
    main()
