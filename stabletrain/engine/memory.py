"""The least host memory a training step needs, checked before a CPU run starts.

A GPU out of memory raises an error the run reports; a CPU process out of memory is killed
by the kernel with no message, after it has spent minutes allocating. So on a CPU the run
first measures what a forward of a micro-batch keeps for the backward (every tensor saved for
the backward, each storage once, parameters aside) and refuses a run whose activations cannot
fit in the memory the machine has free, with the model already built. The forward runs on fake
tensors (shapes, no data): it takes a moment and no memory whatever the size. A model whose
forward fake tensors cannot run (it reads a value, ``.item()``) is measured by real forwards of
one and two samples instead, scaled to the micro-batch. Gradients, optimizer state and
temporaries come on top: the figure is a lower bound, so a refusal is certain, and a run that
passes may still be tight. A compiled model is only warned: inductor may save less than the
eager forward measured here.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from stabletrain.errors import ConfigError



def size(nbytes: float) -> str:
    """``120.9 GB``, ``8.2 MB``."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _kept_bytes(model: nn.Module, params, forward: Callable) -> int:
    """Bytes ``forward()`` keeps for the backward, each storage once and ``params`` aside, plus
    its output in fp32, which the cross-entropy keeps as its log-probabilities. In training mode
    (activation checkpointing acts only there), the model's own mode put back after."""
    skip = {p.untyped_storage()._cdata for p in params}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in skip:
            kept[storage._cdata] = storage.nbytes()
        return t

    was_training = model.training
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
    finally:
        model.train(was_training)
    # a model returning more than its logits is refused at the first step, in one line (loop.py)
    return sum(kept.values()) + sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)) * 4


def traced_bytes(model: nn.Module, x: torch.Tensor, micro: int, autocast: Callable) -> int:
    """:func:`saved_bytes` of ``micro`` copies of ``x``'s first sample, traced on fake tensors:
    no data is computed or allocated, and the model's parameters and buffers are left as they are."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state = {n: mode.from_tensor(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
        batch = mode.from_tensor(x[:1].clone()).expand(micro, *x.shape[1:]).contiguous()  # x's storage, not x's

        def forward():
            with autocast():
                return torch.func.functional_call(model, state, (batch,))

        return _kept_bytes(model, [state[n] for n, _ in model.named_parameters()], forward)


def saved_bytes(model: nn.Module, x: torch.Tensor, autocast: Callable) -> int:
    """:func:`_kept_bytes` of a real forward of ``x``, on a forked RNG and with the buffers put
    back, so that neither the model nor the run's random stream changes."""
    buffers = [(b, b.clone()) for b in model.buffers()]

    def forward():
        with torch.random.fork_rng(devices=[]), autocast():
            return model(x.clone())

    try:
        return _kept_bytes(model, model.parameters(), forward)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def activation_bytes(model: nn.Module, x: torch.Tensor, micro: int, autocast: Callable) -> int:
    """What a forward of ``micro`` samples keeps for the backward: traced on fake tensors, or
    where the model's forward cannot be, from real forwards of one and two samples of ``x``: the
    difference is what each sample adds, the rest is kept once whatever the batch (sigmaReparam's
    ``W / sigma``, autocast's bf16 copies of the weights)."""
    try:
        return traced_bytes(model, x, micro, autocast)
    except Exception:  # an operator without a fake kernel, a value read (.item()): measured for real
        pass
    one = saved_bytes(model, x[:1], autocast)
    if len(x) < 2:
        return one * micro
    each = saved_bytes(model, x[:2], autocast) - one
    return max(0, one - each) + each * micro


def available_bytes() -> int | None:
    """Free memory: /proc/meminfo's MemAvailable plus free swap, capped by a cgroup v2 limit
    (a container, a SLURM job); None where neither can be read (not Linux)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = (int(info["MemAvailable"].split()[0]) + int(info.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            used = int((cgroup / "memory.current").read_text()) - int(stat.get("inactive_file", 0))
            free = min(free, int(limit) - used)  # the page cache counts as used there, yet is given back
    except (OSError, ValueError):
        pass
    return free


def check_host_memory(model: nn.Module, x: torch.Tensor, micro: int, autocast: Callable, compiled: bool = False,
                      dry_run: bool = False, available: int | None = None) -> str | None:
    """Refuse a step that cannot fit: the activations of ``micro`` samples, times the processes
    on this machine (torchrun's ``LOCAL_WORLD_SIZE``), against the memory free now, with the
    weights already allocated. A ``compiled`` model may save less than the eager forward
    measured here (inductor recomputes cheap operations in the backward), and a ``dry_run``
    trains nothing (a GPU recipe looked at on a laptop): both get a warning, returned, instead.
    ``x`` holds two samples or more (one works, and counts every saved tensor per sample)."""
    free = available_bytes() if available is None else available
    if free is None:
        return None
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    acts = activation_bytes(model, x, micro, autocast)
    if acts * procs <= free:
        return None
    each = f" in each of {procs} processes" if procs > 1 else ""
    checkpointed = any(getattr(m, "activation_checkpointed", False) for m in model.modules())
    what = (f"{size(acts * procs)} more memory (the activations of a micro-batch of {micro} samples{each}), more "
            f"than the {size(free)} free here; lower batch_size, set micro_batch_size to accumulate smaller "
            f"micro-batches, {'' if checkpointed else 'set activation_checkpointing=true, '}or train on a GPU")
    if compiled:
        return f"warning: uncompiled, a training step would need at least {what}"
    if dry_run:
        return f"warning: a training step would need at least {what}"
    raise ConfigError(f"a training step needs at least {what}")
