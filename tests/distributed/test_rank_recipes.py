"""FSDP2 wrapping and the rank helpers (device choice, stop-signal agreement, the errors that say a
peer rank went away, the finite verdict of sharded checkpoints) against what docs/distributed.md
says, on gloo ranks."""

import signal

import pytest
import torch
from torch import nn


# --- FSDP2 wrapping and the rank helpers (one gloo rank in this process) --------------------------


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bf16", [True, False])
def test_shard_model_wraps_each_block_then_the_root_with_the_bf16_policy(one_rank, bf16):
    """docs/distributed.md: ``fully_shard`` on each block, then on the root; with bf16 the policy is
    bf16 parameters in compute (a bf16 output) and fp32 gradient reduction; in fp32 there is none."""
    from torch.distributed.fsdp import FSDPModule

    from stabletrain.engine.sharding import shard_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    shard_model(model, [("0", model[0]), ("2", model[2])], bf16, torch.device("cpu"))
    assert all(isinstance(m, FSDPModule) for m in (model, model[0], model[2]))  # one unit per block
    assert not isinstance(model[1], FSDPModule)
    out = model(torch.randn(3, 4))
    assert out.dtype == (torch.bfloat16 if bf16 else torch.float32)
    for m in (model, model[0], model[2]):
        policy = m._get_fsdp_state()._mp_policy
        dtypes = (torch.bfloat16, torch.float32) if bf16 else (None, None)
        assert (policy.param_dtype, policy.reduce_dtype) == dtypes
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_agree_on_signal_hands_back_the_signal_it_ranked(one_rank):
    """agree_on_signal all-reduces signal_rank(s) = priority * 256 + s and decodes the low byte:
    every rank gets back the signal itself (one rank here, told the job has two so that it reduces)."""
    from stabletrain.engine import distributed as D

    info = D.DistInfo(rank=0, world=2, local_rank=0)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        assert D.agree_on_signal(sig, info) == sig
    assert D.agree_on_signal(None, info) is None


def test_cuda_device_is_the_local_rank_modulo_the_visible_gpus(monkeypatch):
    """``device=cuda`` picks cuda:(local_rank mod #GPUs), not the global rank: rank 6 of a job whose
    node shows 4 GPUs, at local rank 1, trains on cuda:1 (not cuda:2)."""
    from stabletrain.engine import distributed as D

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    assert D.pick_device("cuda", D.DistInfo(rank=6, world=8, local_rank=1)) == torch.device("cuda:1")
    assert D.pick_device("cuda", D.DistInfo(rank=9, world=16, local_rank=7)) == torch.device("cuda:3")


def test_a_peer_gone_is_gloos_and_nccls_wording_of_a_collective_only():
    """is_peer_gone reads gloo's 'Connection closed by peer' (what a SIGKILLed rank leaves its
    peers) and NCCL's remote error, of a collective's error only: a broken pipe of this process's
    own stdout is no other rank's death."""
    from stabletrain.engine.distributed import is_peer_gone

    assert is_peer_gone(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                                     "[127.0.0.1]:60412"))
    assert is_peer_gone(RuntimeError("NCCL error: remote process exited or there was a network error, "
                                     "NCCL version 2.21.5 ncclRemoteError"))
    assert not is_peer_gone(BrokenPipeError(32, "Broken pipe"))
    assert not is_peer_gone(RuntimeError("CUDA out of memory"))


_TWO_RANKS = """
import json, signal, sys
import torch, torch.distributed as dist
from stabletrain.engine import distributed as D
from stabletrain.engine.sharding import all_finite_everywhere

rank = int(sys.argv[1])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 2), rank=rank, world_size=2)
info = D.DistInfo(rank=rank, world=2, local_rank=rank)
out = {
    "finite_one_bad": all_finite_everywhere(torch.tensor(rank == 0)),
    "finite_all_good": all_finite_everywhere(torch.tensor(True)),
    "signal_one_rank": D.agree_on_signal(signal.SIGUSR1 if rank == 1 else None, info),
    "signal_usr1_over_term": D.agree_on_signal(signal.SIGUSR1 if rank == 1 else signal.SIGTERM, info),
}
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_two_ranks_and_their_finite_verdicts_and_stop_signals(tmp_path):
    """Two gloo ranks: a checkpoint is finite only if every rank's shards are (an AND over ranks: one
    rank's non-finite shard makes both refuse it), and a stop signal caught by one rank reaches both,
    a preemption warning (SIGUSR1) outranking another rank's SIGTERM."""
    import json
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(r), store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    expect = {"finite_one_bad": False, "finite_all_good": True, "signal_one_rank": int(signal.SIGUSR1),
              "signal_usr1_over_term": int(signal.SIGUSR1)}
    assert results == [expect, expect]
