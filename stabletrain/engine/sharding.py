"""Activation checkpointing and FSDP2 for the trainer (``activation_checkpointing``, ``parallel=fsdp``).

Both act on the transformer blocks, which :mod:`stabletrain.build` finds and passes in (the
engine imports no models/). Neither renames a module or a state_dict key:

- Activation checkpointing re-classes each block (as Swin's blocks are re-classed) to a
  subclass whose ``forward`` runs the block's own under
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` while training with grad
  enabled; eval and ``torch.no_grad`` run it plainly. Forward pre-hooks (the monitors') still
  see the block input, and a deep copy (the EMA) is checkpointed too. The RNG state is saved and
  replayed on recomputation, so dropout / drop path masks are the same as without.
- FSDP2: ``fully_shard`` on each block, then on the root (one all-gather per block in forward
  and backward, a reduce-scatter of its gradients), on a 1-D mesh over every rank; with bf16, a
  ``MixedPrecisionPolicy`` (bf16 parameters in compute, fp32 gradient reduction). Checkpoints go
  through ``torch.distributed.checkpoint`` into ``checkpoints/last_dcp/`` (see :func:`save_dcp`);
  a ring checkpoint ``step_N.pt`` has its ``step_N_dcp/``, hard links to that step's files.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

DCP_DIR = "last_dcp"  # beside last.pt: the sharded model and optimizer of the same step
_CHECKPOINTED: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if cls not in _CHECKPOINTED:
        def forward(self, *args, **kwargs):
            inner = super(sub, self).forward
            if self.training and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                return checkpoint(inner, *args, use_reentrant=False, **kwargs)
            return inner(*args, **kwargs)

        sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, "activation_checkpointed": True})
        _CHECKPOINTED[cls] = sub
    return _CHECKPOINTED[cls]


def apply_activation_checkpointing(blocks) -> int:
    """Re-class every block of ``blocks`` (``(name, module)`` pairs) so that its forward is
    checkpointed in training; returns how many. Idempotent."""
    n = 0
    for _, blk in blocks:
        if not getattr(blk, "activation_checkpointed", False):
            blk.__class__ = _checkpointed_class(type(blk))
        n += 1
    return n


def shard_model(model: nn.Module, blocks, bf16: bool, device: torch.device) -> nn.Module:
    """FSDP2 ``fully_shard`` on each block of ``blocks``, then on ``model``; in place (the
    parameters become DTensors sharded on dim 0). Call before the optimizer is built."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))
    kw = {"mesh": mesh}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for _, blk in blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    return model


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2's ``no_sync``: without sync the gradients of a micro-batch stay unreduced (accumulated)."""
    model.set_requires_gradient_sync(sync)


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor (e.g. a total norm over sharded gradients) as the plain tensor it stands for."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (sharing its storage), or ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def gathered(modules, differentiable: bool = False):
    """The FSDP2-sharded parameters of ``modules`` (and their submodules) swapped for their whole
    tensors for the duration, so that reading a weight gives what it gives unsharded: a
    parametrization (sigmaReparam's) runs on the whole raw weight and gains, in their own dtype
    (not a mixed-precision ``param_dtype``). Each parameter is one all-gather: every rank must
    enter with the same modules in the same order. No forward may run inside (FSDP's hooks
    expect their own parameters); on exit the sharded parameters are back and the copies freed.

    ``differentiable``: the whole tensors are ``full_tensor()`` with grad, whose backward hands
    each rank the slice of the gradient that is its shard, accumulated into the sharded ``.grad``
    (see :func:`with_whole_weights`); otherwise they are gathered under ``no_grad``."""
    from torch.distributed.tensor import DTensor

    swapped = []
    try:
        with contextlib.nullcontext() if differentiable else torch.no_grad():
            for top in modules:
                for mod in top.modules():
                    for name, p in list(mod._parameters.items()):
                        if isinstance(p, DTensor):
                            mod._parameters[name] = p.full_tensor()
                            swapped.append((mod, name, p))
        yield
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p


def with_whole_weights(module: nn.Module, fn):
    """``fn(module)`` computed on ``module``'s whole weights, differentiably: how a loss term that
    reads weights (LocAteR's qkv) runs under FSDP2, one module at a time.

    The gradient of ``fn``'s result reaches each sharded parameter as this rank's slice, added to
    its ``.grad`` outside FSDP2's reduce-scatter, which then adds the averaged task gradient to it
    (or this adds to FSDP2's, whichever comes first). Every rank computes the same value, so the
    slice counts once, as under DDP, where each rank adds the same gradient and the all-reduce
    averages. With grad enabled the gather is checkpointed (non-reentrant): the graph keeps only
    ``fn``'s result, and backward gathers the module again (the same collectives in the same
    order on every rank), so at most one module's whole weights (and their gradient) are held
    at a time, at the cost of a second all-gather of them."""

    def run():
        with gathered([module], differentiable=True):
            return fn(module)

    if not torch.is_grad_enabled():
        return run()
    from torch.utils.checkpoint import checkpoint

    return checkpoint(run, use_reentrant=False)


def all_finite_everywhere(verdict: torch.Tensor) -> bool:
    """A rank's finite-check verdict, AND-ed over the ranks (each checked only its shards)."""
    flag = torch.tensor([1 if bool(verdict) else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_gloo())
    return bool(flag.item())


def _gloo():
    from stabletrain.engine import distributed as D

    return D._cpu_group


def sharded_state(model: nn.Module, optimizer, ema: nn.Module | None = None) -> dict:
    """``{"model", "optim"}`` of this rank (FQN-keyed, DTensor values), as DCP saves and loads
    them, and ``"ema"``: the weight average's model, sharded like ``model``, when given.

    ``optimizer=None`` leaves the optimizer out: DCP's state dict of an optimizer that has not
    stepped yet is made by a step with zero gradients and lr 0, which would count a step
    (Adam's bias correction) and draw from the RNG; a checkpoint at step 0 saves the model alone."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    if ema is not None:
        state["ema"] = get_model_state_dict(ema)
    return state


def save_dcp(ckpt_dir: Path, model: nn.Module, optimizer, step: int, ema: nn.Module | None = None) -> None:
    """Every rank writes its shards into ``ckpt_dir/.last_dcp.tmp``; rank 0 then swaps it into
    ``ckpt_dir/last_dcp``, the previous one moved to ``.last_dcp.old``. That one is the shards of
    the ``last.pt`` still in place until the caller has written the new last.pt and called
    :func:`drop_previous_dcp`: a kill anywhere in between leaves a last.pt whose shards are one of
    the two (``Checkpointer`` resumes from the one of its step). The step is saved with the shards, to tell which."""
    import torch.distributed.checkpoint as dcp

    ckpt_dir = Path(ckpt_dir)
    tmp, final, old = ckpt_dir / f".{DCP_DIR}.tmp", ckpt_dir / DCP_DIR, previous_dcp(ckpt_dir)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=_gloo())
    state = sharded_state(model, optimizer, ema)
    state["step"] = torch.tensor(step)
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier(group=_gloo())
    if dist.get_rank() == 0:
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
    dist.barrier(group=_gloo())


def previous_dcp(ckpt_dir: Path) -> Path:
    return Path(ckpt_dir) / f".{DCP_DIR}.old"


def drop_previous_dcp(ckpt_dir: Path) -> None:
    """After last.pt of the new shards is in place, the previous shards are no checkpoint's (rank 0)."""
    shutil.rmtree(previous_dcp(ckpt_dir), ignore_errors=True)


def load_dcp(path: Path, model: nn.Module, optimizer, ema: nn.Module | None = None) -> int:
    """Load ``path`` (a ``*_dcp`` directory) into the sharded model, the optimizer (unless None:
    saved without one) and, when given, the weight average's model on every rank; returns the
    step it was saved at. Any world size that DCP can reshard to works."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = sharded_state(model, optimizer, ema)
    state["step"] = torch.tensor(-1)
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if ema is not None:
        set_model_state_dict(ema, state["ema"])
    return int(state["step"])
