"""The least host memory a training step needs, checked before a CPU run starts.

A GPU out of memory raises an error the run reports; a CPU process out of memory is killed
by the kernel with no message, after it has spent minutes allocating. So on a CPU the run
first measures what the forward of one sample keeps for the backward (every tensor saved for
the backward, each storage once, parameters aside), scales it to a micro-batch, adds the
weights, and refuses a run that cannot fit in the memory the machine has free. Gradients,
optimizer state and temporaries come on top: the figure is a lower bound, so a refusal is
certain, and a run that passes may still be tight. A compiled model is only warned: inductor
may save less than the eager forward measured here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from stabletrain.errors import ConfigError



def size(nbytes: float) -> str:
    """``120.9 GB``, ``8.2 MB``."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def saved_bytes_per_sample(model: nn.Module, x: torch.Tensor, autocast: Callable) -> int:
    """Bytes the forward of ``x[:1]`` keeps for the backward, plus its output in fp32, which
    the cross-entropy keeps as its log-probabilities. In training mode (activation checkpointing
    acts only there), on a forked RNG and with the buffers put back, so that neither the model
    nor the run's random stream changes."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    buffers = [(b, b.clone()) for b in model.buffers()]
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=[]), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                autocast():
            out = model(x[:1].clone())
        return sum(kept.values()) + out.numel() * 4
    finally:
        model.train(was_training)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def available_bytes() -> int | None:
    """Free memory: /proc/meminfo's MemAvailable plus free swap, capped by a cgroup v2 limit
    (a container, a SLURM job); None where neither can be read (not Linux)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = (int(info["MemAvailable"].split()[0]) + int(info.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def check_host_memory(model: nn.Module, x: torch.Tensor, micro: int, autocast: Callable, shards: int = 1,
                      compiled: bool = False, dry_run: bool = False, available: int | None = None) -> str | None:
    """Refuse a step that cannot fit: ``micro`` samples' saved activations and the weights
    (their ``1 / shards`` under FSDP2), times the processes on this machine (torchrun's
    ``LOCAL_WORLD_SIZE``), against the free memory. A ``compiled`` model may save less than
    the eager forward measured here (inductor recomputes cheap operations in the backward), and
    a ``dry_run`` trains nothing (a GPU recipe looked at on a laptop): both get a warning,
    returned, instead."""
    free = available_bytes() if available is None else available
    if free is None:
        return None
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    acts = saved_bytes_per_sample(model, x, autocast) * micro
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) // shards
    need = (acts + weights) * procs
    if need <= free:
        return None
    each = f" for each of {procs} processes" if procs > 1 else ""
    checkpointed = any(getattr(m, "activation_checkpointed", False) for m in model.modules())
    what = (f"{size(need)} of memory (activations of a micro-batch of {micro} samples {size(acts)} + weights "
            f"{size(weights)}{each}), more than the {size(free)} free here; lower batch_size, set micro_batch_size "
            f"to accumulate smaller micro-batches, {'' if checkpointed else 'set activation_checkpointing=true, '}"
            f"or train on a GPU")
    if compiled:
        return f"warning: uncompiled, a training step would need at least {what}"
    if dry_run:
        return f"warning: a training step would need at least {what}"
    raise ConfigError(f"a training step needs at least {what}")
