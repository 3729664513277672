"""AdamW² with FSDP2 / HSDP sharded parameters (gloo on CPU, two ranks under torchrun)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.common import TORCHRUN, clean_env, run
from tests.helpers import ROOT


def test_sharded_adamw2_takes_the_whole_models_steps_and_resumes(tmp_path):
    out = run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(ROOT / "tests/distributed/fsdp_adamw2.py")],
              cwd=tmp_path, env=clean_env(PYTHONPATH=str(ROOT)))
    assert "fsdp adamw2 ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_adamw2_refuses_shardings_it_cannot_reassemble():
    """Tensor parallelism splits columns (Shard(1)); the matrix's sigma1 would need another
    reduction, so AdamW2 says so in one line instead of bounding the wrong thing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from stabletrain.optim import AdamW2

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        AdamW2([torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))])  # FSDP's: fine
        w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(1)]))
        with pytest.raises(TypeError, match=r"only from dim-0 shards \(FSDP2, HSDP\).*Shard\(dim=1\)"):
            AdamW2([w])
    finally:
        dist.destroy_process_group()
