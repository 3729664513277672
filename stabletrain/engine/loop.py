"""The training loop: one process on CPU or one GPU, or one rank of a DDP or FSDP2 job.

The hot path per optimizer step is: the step's micro-batches, forward and backward under
autocast, the gradient norm when clipping, skipping or logging needs it, the optimizer, the
step hooks (sigmaReparam's power iteration), the weight average. Nothing in it reads a device
value on the host: the losses, the skip flags and the gradient norm stay on the device and are
read back together every ``logger.log_every`` steps, where divergence is checked step by step.
Under torchrun the ranks agree on a stop signal after every step (a host-side all-reduce of one
integer on a gloo group, which never waits for the GPU).

The trainer receives built objects (:mod:`stabletrain.build` turns a config into them) and
imports nothing of models/, data/ or optim/. Where checkpoints are and how they are written and
read back is :class:`~stabletrain.engine.checkpoint.Checkpointer`'s; which one a run resumes and
what the resume changed, :mod:`stabletrain.engine.resume`'s; when to write one, and what resuming
or rolling back to one means for the step counter and the data stream, the trainer's. The lines a
run prints are worded by :mod:`stabletrain.engine.progress`.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from stabletrain.engine import distributed as D
from stabletrain.engine import resume as R
from stabletrain.engine.checkpoint import Checkpointer, RunDirGone, load_checkpoint, records_of, ring_checkpoints
from stabletrain.engine.divergence import DivergenceWatch, record_spikes, with_open_spike
from stabletrain.engine.guard import StepGuard
from stabletrain.engine.progress import Pace, end_line, interval_fields
from stabletrain.engine.rundir import continue_with
from stabletrain.errors import ConfigError, StoppedAtOnce, first_line
from stabletrain.metrics import StartNote, logged_value, param_count, peak_flops, read_json, write_json
from stabletrain.monitor import names as N


class StepResult(NamedTuple):
    """What :meth:`Trainer.train_step` returns: device tensors, read back at the next log step."""

    loss: torch.Tensor  # the step's loss, the mean over its micro-batches
    grad_norm: torch.Tensor | None  # before clipping; None when nothing needed it
    skipped: torch.Tensor | None  # 1.0 when divergence.skip_nonfinite skipped the step; None without the guard
    lr: float  # the rate the step ran at


class _Interval(NamedTuple):
    """The values of the steps since the last log, read back on the host (under DDP: averaged over the
    ranks; the bad samples and the stop request summed)."""

    losses: list[float]
    skipped: list[bool]  # divergence.skip_nonfinite skipped the step
    terms: list[float]  # each loss term, summed over the steps
    grad_norm: float | None  # the largest finite one when every step computed one, else the last step's
    bad: int  # unreadable image files replaced so far
    stop: bool  # the monitors asked to stop


EVAL_BATCH_CAP = 256  # evaluation batches are the training batch, at most this (the forward needs no grads)


@dataclass
class LoopSettings:
    """The few values the loop itself reads; everything else arrives built."""

    total_steps: int
    batch_size: int  # global, per optimizer step
    steps_per_epoch: int = 1
    grad_clip: float | None = None
    eval_every: int = 100
    eval_batches: int = 20
    ckpt_every: int = 500
    log_every: int = 10
    adamw2_every: int = 50  # AdamW²'s per-tensor curves at the log steps holding a multiple of this
    resume: str | None = None  # auto | a checkpoint path
    resume_allow_changes: bool = False  # resume=auto with a changed model/optim/data/seed
    bf16: bool = False
    compile: bool = False
    config_yaml: str = ""  # the resolved config: saved in checkpoints, compared when requeued
    # key -> values that configure the same run, for that comparison (data=auto and the data set it picks)
    equivalent: dict | None = None
    title: str = "model"  # the start line's name for the model
    flops_per_sample: float = 0.0  # training FLOPs of one sample (sequence or image), for MFU
    ckpt_keep: int = 0  # ring checkpoints (checkpoints/step_NNNNNN.pt) besides last.pt
    rollback_on_alert: bool = False  # the monitors' stop request rolls back (divergence.action=rollback)
    nan_at_step: int | None = None  # fault injection (debug.*): the loss of this 1-based step times NaN
    spike_at_step: int | None = None  # ... times spike_factor
    spike_factor: float = 1e4
    sharded: bool = False  # the model is FSDP2-sharded (parallel=fsdp): no DDP wrap, DCP checkpoints
    # the command line's overrides (None outside Hydra): saved, and named by the hints to continue
    overrides: tuple[str, ...] | None = None


def autocast_for(device: torch.device, bf16: bool):
    """The context a model trains and is scored under: bf16 autocast, or nothing."""
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


class Trainer:
    """One process's training: on CPU or one GPU, or one rank of a DDP or FSDP2 job.

    It receives the model, its optimizer and ``schedule`` (``schedule(optimizer, step, scale)``
    sets the step's rates and returns the lr), the data and this rank's ``shard`` of each batch,
    the task ``criterion`` (``(logits, y) -> loss``, after ``mixup`` when given), extra
    ``loss_terms`` (``(model, logits, x, y) -> loss``, each with a ``name``), ``step_hooks``
    called after every optimizer step (sigmaReparam's power iteration), a weight ``ema``, a
    ``monitor``, and ``open_sink(resume_step)``, which opens the run's metrics sink.
    """

    def __init__(self, *, model: nn.Module, optimizer, schedule, data, shard, criterion, settings: LoopSettings,
                 device: torch.device, run_dir: Path, open_sink, info: D.DistInfo | None = None,
                 loss_terms=(), step_hooks=(), mixup=None, ema=None, monitor=None,
                 divergence: DivergenceWatch | None = None, messages=()):
        self.model, self.optimizer, self.schedule, self.data, self.shard = model, optimizer, schedule, data, shard
        self.criterion, self.mixup, self.step_hooks = criterion, mixup, step_hooks
        # Under FSDP2 a term that reads weights runs outside the objective, on weights gathered whole
        # (sharding.with_whole_weights): eagerly, as the gather is no graph for torch.compile. It goes
        # last; the logs name each term.
        self.weight_terms = [t for t in loss_terms if settings.sharded and getattr(t, "reads_weights", False)]
        self.objective_terms = [t for t in loss_terms if t not in self.weight_terms]
        self.loss_terms = self.objective_terms + self.weight_terms
        self.ema, self.monitor, self.settings, self.device = ema, monitor, settings, device
        self.run_dir, self.open_sink, self.info = Path(run_dir), open_sink, info or D.DistInfo()
        self.divergence = divergence or DivergenceWatch()
        self.total_steps, self.steps_per_epoch = settings.total_steps, settings.steps_per_epoch
        self.bf16 = settings.bf16
        self.autocast = autocast_for(device, self.bf16)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # each loss term's share of the logged loss, summed over a log interval (on the device)
        self.term_sums = torch.zeros(len(self.loss_terms), device=device)
        self.sharded = settings.sharded
        if self.sharded:
            from stabletrain.engine import sharding

            self._sharding = sharding  # imported once: train_step uses it every micro-batch
        model.train()  # once: evaluation and the monitors restore the mode they found
        self.train_model: nn.Module = model
        self.objective = self._objective
        self.output_checked = False  # the first step checks the logits' shape (:meth:`_check_output`)
        if settings.compile:
            # The loss is compiled too: for a GPT, an fp32 copy of the logits (and of their gradient)
            # would otherwise be written to memory, the largest activation of the step.
            # Runs of a sweep share a process (Hydra's basic launcher). Without a reset, a run would
            # reuse what earlier runs compiled: a swept size or constant then comes back as a dynamic
            # shape or symbol (other kernels, other roundings), so a run would not compute what it does alone.
            torch._dynamo.reset()
            if self.sharded:
                self._allow_a_compile_per_block(model)
            self.train_model = torch.compile(model)
            self.objective = torch.compile(self._objective)
        if self.info.enabled and not self.sharded:  # an FSDP2 model reduces its own gradients
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [device.index] if device.type == "cuda" else None
            self.train_model = DDP(self.train_model, device_ids=ids)
        self.ckpt = Checkpointer(self.run_dir, self.info, device, model=model, optimizer=optimizer,
                                 divergence=self.divergence, ema=ema, monitor=monitor, sharded=self.sharded,
                                 keep=settings.ckpt_keep, config_yaml=settings.config_yaml,
                                 equivalent=settings.equivalent, overrides=settings.overrides)
        self.peak_flops = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.stop_signal: int | None = None
        # a signal held for the loop until it answers signals (run.py's preemption warning during the start)
        self.held_signal: Callable[[], int | None] = lambda: None
        self.after_step = False  # between a step's update and the next step: its evaluation, log, checkpoint
        self.signals_agreed = False  # this step's ranks have agreed on the stop signals (distributed.agree_on_signal)
        self.step = 0
        self.notes: list[str] = list(messages)  # said once the metrics sink exists
        self.diverged_at: int | None = None
        self.nonfinite_reason: str | None = None  # why the last save was refused
        # the mean loss of the last log interval's healthy steps (nan: none was healthy); None
        # before the first interval is logged, and then the summary has no final loss
        self.last_train_loss: float | None = None
        self.last_penalty: float | None = None  # the loss terms' share of it, where any is active
        self.on_start: list = []  # called once fit() has resumed (or not), before the first step
        self.pace = Pace()  # seconds per step, for the progress line's ETA
        # surviving a spike: skipped steps, and rollbacks (saved in checkpoints under "survival")
        self.guard = StepGuard(model, optimizer, ema) if self.divergence.skip_nonfinite else None
        self.data_offset = 0  # the batch of step s is the stream's position s + data_offset
        self.lr_scale = 1.0  # divergence.lr_scale_on_rollback, compounded per rollback
        self.rollbacks: list[dict] = []
        self.skipped_steps = 0  # non-finite steps skipped so far (divergence.skip_nonfinite)
        # loss spikes that passed, watched, not acted on: {step, steps}, and "warmup": true for those the
        # divergence warmup did not count
        self.spikes: list[dict] = []
        self.trigger: tuple[int, str] | None = None  # (onset step, kind) of the last stop reason
        self.resumed_elsewhere: Path | None = None  # resume=PATH of another run's checkpoint: PATH
        self.resume_changes: dict[str, str] = {}  # key -> "was -> now": the settings a resume changed
        self.saved_step: int | None = None  # of last.pt

    @staticmethod
    def _allow_a_compile_per_block(model: nn.Module) -> None:
        """Under FSDP2 the hooks between blocks split the compiled forward: each block's forward
        compiles on its own, and a block whose layers are parametrized (sigmaReparam) has classes
        of its own, so its guards fail on every other block. Past dynamo's recompile limit (8)
        the remaining blocks would silently run eagerly."""
        from torch.distributed.fsdp import FSDPModule

        sharded = sum(isinstance(m, FSDPModule) for m in model.modules())
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, sharded + 8)

    # --- the step -------------------------------------------------------------------

    def loss_on(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The task loss plus every loss term; each term's share is added to ``term_sums``."""
        with self.autocast():
            out = model(x)
        if not self.output_checked:
            self._check_output(out, x)
        loss, terms = self.objective(self.model, out, x, y)
        if self.weight_terms:
            extra = torch.stack([t(self.model, out, x, y, whole_weights=self._sharding.with_whole_weights)
                                 for t in self.weight_terms])
            loss = loss + extra.sum()
            terms = extra.detach() if terms is None else torch.cat([terms, extra.detach()])
        if terms is not None:
            self.term_sums += terms / self.shard.accum
        return loss

    def _check_output(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Once: logits of the shape the loss needs. A model of one's own whose head ignores
        model.num_classes (or model.vocab_size) would otherwise fail inside the loss, as an index
        error on a CPU and a device-side assert on a GPU."""
        if not isinstance(out, torch.Tensor):  # a tuple (logits, aux), a dict, an HF output
            raise ConfigError(f"the model returned a {type(out).__name__}, not a tensor of logits: the loss needs "
                              f"its forward to return the logits alone")
        d, shape = self.data, tuple(out.shape)
        if d.kind == "vision":
            ok, want = len(shape) == 2 and shape == (x.shape[0], d.num_classes), f"(batch, {d.num_classes})"
            fix = f"build its head with model.num_classes, which the data sets ({d.num_classes} classes)"
        else:
            ok = len(shape) == 3 and shape[:2] == tuple(x.shape[:2]) and shape[-1] >= d.vocab_size
            want = f"(batch, sequence, at least {d.vocab_size})"
            fix = f"build its output layer with model.vocab_size (the data's vocabulary is {d.vocab_size} ids)"
        if not ok:
            raise ConfigError(f"the model's output has shape {shape} for an input of {tuple(x.shape)}; the loss "
                              f"needs {want}: {fix}")
        self.output_checked = True

    def _objective(self, model: nn.Module, out: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
        """``(task loss + loss terms, the terms' values or None)`` of the logits ``out``; the
        weight terms of a sharded model are added by :meth:`loss_on`."""
        loss = self.criterion(out, y)
        if not self.objective_terms:
            return loss, None
        terms = torch.stack([term(model, out, x, y) for term in self.objective_terms])
        return loss + terms.sum(), terms.detach()

    def _to_device(self, x: torch.Tensor, y: torch.Tensor):
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _fault_due(self) -> int | None:
        """debug.nan_at_step / debug.spike_at_step: this step's 1-based number when a fault is due.

        The fault belongs to the batch (the stream position ``K - 1``, step K of a run that never
        rolled back), as bad data would: a rollback that skips that batch skips the fault."""
        done = self.step + self.data_offset + 1
        return done if done in (self.settings.nan_at_step, self.settings.spike_at_step) else None

    def _inject(self, loss: torch.Tensor, done: int) -> torch.Tensor:
        if done == self.settings.nan_at_step:
            loss = loss * float("nan")  # a product, so the gradients are NaN too
        if done == self.settings.spike_at_step:
            loss = loss * self.settings.spike_factor
        return loss

    def train_step(self, micro_batches, want_grad_norm: bool) -> StepResult:
        """One optimizer step over this rank's micro-batches; what it returns stays on the device.

        With ``divergence.skip_nonfinite`` a step whose gradient norm is not finite changes
        nothing (engine/guard.py) and returns ``skipped`` 1."""
        lr = self.schedule(self.optimizer, self.step, self.lr_scale)
        guard = self.guard
        if guard is not None:
            guard.begin()
        fault = self._fault_due()
        # a skipped step's loss terms count no more than its loss does (the interval's healthy steps' mean)
        terms_before = self.term_sums.clone() if guard is not None and len(self.loss_terms) else None
        losses = []
        n = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            x, y = self._to_device(x, y)
            if self.mixup is not None:
                x, y = self.mixup(x, y)
            sync = i == n - 1 or not self.info.enabled
            if self.sharded:  # FSDP2: reduce-scatter only after the last micro-batch
                self._sharding.set_gradient_sync(self.model, sync)
                ctx = contextlib.nullcontext()
            else:
                ctx = contextlib.nullcontext() if sync else self.train_model.no_sync()
            with ctx:
                loss = self.loss_on(self.train_model, x, y)
                if fault is not None:
                    loss = self._inject(loss, fault)
                (loss if n == 1 else loss / n).backward()
            losses.append(loss.detach())
        total = losses[0] if n == 1 else torch.stack(losses).mean()
        grad_norm = None  # before clipping; computed only when clipping, skipping or logging needs it
        if self.settings.grad_clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.grad_clip, foreach=True)
        elif want_grad_norm or guard is not None:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None],
                                                      foreach=True)
        if self.sharded and grad_norm is not None:  # a DTensor over sharded gradients: the whole norm
            grad_norm = self._sharding.full(grad_norm)

        def update():
            self.optimizer.step()
            for hook in self.step_hooks:
                hook()
            if self.ema is not None:
                self.ema.after_step(self.model, self.step)

        skipped = None
        if guard is None:
            update()
        else:
            finite = torch.isfinite(grad_norm)  # the same on every rank: the grads are all-reduced
            skipped = guard.step(finite, update)
            if terms_before is not None:
                self.term_sums = torch.where(finite, self.term_sums, terms_before)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(total, grad_norm, skipped, lr)

    # --- evaluation -----------------------------------------------------------------

    def evaluate(self) -> dict:
        """``val/*`` of the live model, and ``val_ema/*`` of the weight average when ``ema.decay`` is set."""
        out = self._score(self.model, N.VAL)
        if self.ema is not None:
            out.update(self._score(self.ema.for_eval(), N.VAL_EMA))
        return out

    @torch.no_grad()
    def _score(self, model: nn.Module, prefix: str) -> dict:
        was_training = model.training
        model.eval()
        try:
            stats = self._eval_sums(model)
        finally:
            model.train(was_training)
        loss_sum, correct, count = stats.tolist()
        loss = loss_sum / max(count, 1)
        if self.data.kind == "text":
            # inf past float range (exp(709)), not a cap that reads as a measured value
            ppl = math.exp(loss) if loss < 709 else math.inf
            return {N.scored(prefix, "loss"): loss, N.scored(prefix, "ppl"): ppl}
        return {N.scored(prefix, "loss"): loss, N.scored(prefix, "acc"): correct / max(count, 1)}

    def _eval_sums(self, model: nn.Module) -> torch.Tensor:
        """(loss sum, correct, count) over the validation batches, summed on the device and over
        the ranks: one host sync per scored model, not one per batch."""
        # The same global eval batches whatever the world size; each rank scores its slice.
        bs = min(self.settings.batch_size, EVAL_BATCH_CAP)
        r, w = self.info.rank, self.info.world
        stats = torch.zeros(3, dtype=torch.float64, device=self.device)
        for x, y in self.data.val_batches(bs, self.settings.eval_batches):
            x, y = self._to_device(x[r::w], y[r::w])
            if len(y) == 0 and not self.sharded:  # an FSDP2 forward needs every rank: run it empty
                continue
            with self.autocast():
                out = model(x)
            stats[0] += F.cross_entropy(out.float().flatten(0, -2), y.flatten(), reduction="sum")
            if self.data.kind != "text":
                stats[1] += (out.argmax(-1) == y).sum()
            stats[2] += y.numel()
        if self.info.enabled:
            torch.distributed.all_reduce(stats)
        return stats

    # --- logging --------------------------------------------------------------------

    def _log_interval(self, pending: list[tuple[int, StepResult]], dt: float, last_vals: dict) -> str | None:
        """Check the steps since the last log for divergence, step by step, and log them; under DDP
        the values are the global batch's, so every rank reaches the same verdict at the same step.
        Returns the reason to stop, or None."""
        got = self._read_back([r for _, r in pending])
        steps = [s for s, _ in pending]
        reason, passed, early = self._verdict(steps, got)
        passed = record_spikes(self.spikes, early, passed)
        rec = self._record(steps, got, dt, lr=pending[-1][1].lr)
        for s, skip in zip(steps, got.skipped):  # the figures mark each where it happened, not at the log step
            if skip:
                self.metrics.log(s + 1, {N.SKIPPED_STEP: 1})
        self.metrics.log(self.step, rec)
        self._progress(rec, steps, got.skipped, passed, reason, last_vals)
        return reason

    @property
    def _throughput(self) -> str:
        return N.throughput("tokens" if self.data.kind == "text" else "samples")

    def _read_back(self, results: list[StepResult]) -> _Interval:
        """The interval's losses, skip flags, loss terms and gradient norm in one device-to-host
        copy (and, under DDP, one all-reduce)."""
        n, k = len(results), len(self.loss_terms)
        guarded = self.guard is not None
        gnorm = results[-1].grad_norm
        if all(r.grad_norm is not None for r in results):
            # every step computed one (divergence.skip_nonfinite): the interval's largest finite one, so
            # that a spike between two log steps shows; a skipped step's is not finite, and said apart
            g = torch.stack([r.grad_norm.float().reshape(()) for r in results])
            g = torch.where(torch.isfinite(g), g, torch.full_like(g, -math.inf)).max()
            gnorm = torch.where(torch.isinf(g), torch.full_like(g, math.nan), g)
        stop = 1.0 if self.monitor is not None and self.monitor.stop_reason else 0.0
        bad = self.data.bad_samples() if hasattr(self.data, "bad_samples") else 0
        # averaged over the ranks: the losses, the skip flags and the gradient norm (the same on
        # every rank: the gradients are all-reduced) and the terms; summed: the bad samples and the stop request
        mean = [torch.stack([r.loss for r in results])]
        if guarded:
            mean.append(torch.stack([r.skipped for r in results]))
        mean.append(self.term_sums)
        if gnorm is not None:
            mean.append(gnorm.reshape(1).float())
        values = torch.cat([*mean, torch.tensor([bad, stop], dtype=torch.float32, device=self.device)])
        self.term_sums = torch.zeros(k, device=self.device)
        if self.info.enabled:
            torch.distributed.all_reduce(values)
            values[:-2] /= self.info.world
        values = values.tolist()
        losses, values = values[:n], values[n:]
        skipped = [v > 0.5 for v in values[:n]] if guarded else [False] * n
        values = values[n:] if guarded else values
        terms, values = values[:k], values[k:]
        return _Interval(losses, skipped, terms, values[0] if gnorm is not None else None,
                         int(values[-2]), values[-1] > 0)

    def _verdict(self, steps: list[int], got: _Interval) -> tuple[str | None, list[tuple[int, int]], list[int]]:
        """Feed the losses to the divergence watch step by step; returns the reason to stop (a
        divergence, one unresolved at the last step, or the monitors' stop request), the (first
        step, length) of the loss spikes that ended in the interval and the steps of the spikes the
        divergence warmup did not count."""
        reason = None
        self.trigger = None
        passed, early = [], []
        for s, value, skip in zip(steps, got.losses, got.skipped):
            over, start = self.divergence.over, self.divergence.spike_from
            reason = self.divergence.update(s + 1, value, skip)  # steps done, as everywhere else
            if self.divergence.uncounted is not None and self.divergence.uncounted[0] == s + 1:
                early.append(s + 1)
            if over and not self.divergence.over and not skip:
                passed.append((start if start is not None else s + 1 - over, over))
            if reason:
                self.diverged_at = self.divergence.onset if skip else s + 1  # the first non-finite step
                self.trigger = (self.divergence.onset or s + 1, "divergence")
                break
        if reason is None and self.step == self.total_steps:
            reason = self.divergence.unresolved_at_end(self.step)
            if reason:
                self.diverged_at = self.divergence.onset
                self.trigger = (self.divergence.onset, "divergence")
        if reason is None and got.stop:
            reason = self.monitor.stop_reason if self.monitor is not None and self.monitor.stop_reason \
                else "entropy collapse (on rank 0)"
            # rank 0's monitor found it (the others learnt of it through the all-reduce): its onset for all,
            # or the ranks would skip different data after the rollback
            onset = D.broadcast_object(getattr(self.monitor, "stop_onset", None), self.info)
            self.trigger = (min(onset, self.step) if onset is not None else self.step, "alert")
        return reason, passed, early

    def _record(self, steps: list[int], got: _Interval, dt: float, lr: float) -> dict:
        """The interval's metrics record: the mean loss of its healthy steps, the last lr, the time per
        step, throughput and MFU, the loss terms, the gradient norm, and AdamW²'s telemetry."""
        n, k = len(steps), len(self.loss_terms)
        healthy = [v for v, skip in zip(got.losses, got.skipped) if not skip]  # a skipped step's loss is nan
        self.last_train_loss = sum(healthy) / len(healthy) if healthy else float("nan")
        rec = {N.LOSS: self.last_train_loss, N.LR: lr, N.STEP_TIME: dt / n}
        if self.guard is not None:
            rec[N.SKIPPED_STEPS] = sum(got.skipped)
            self.skipped_steps += sum(got.skipped)
        if k:  # summed over the healthy steps alone (train_step)
            m = len(healthy) or float("nan")
            rec[N.LOSS_PENALTY] = self.last_penalty = sum(got.terms) / m
        if k > 1:
            rec.update({N.loss_term(t.name): v / m for t, v in zip(self.loss_terms, got.terms)})
        samples = n * self.settings.batch_size
        rec[self._throughput] = samples * (self.data.seq_len or 1) / dt
        mfu = self._mfu(samples / dt)
        if mfu is not None:
            rec[N.MFU] = mfu
        if got.grad_norm is not None:
            rec[N.GRAD_NORM] = got.grad_norm
        if got.bad:
            rec[N.BAD_SAMPLES] = got.bad
        if self.device.type == "cuda":
            rec[N.PEAK_MEMORY] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if hasattr(self.optimizer, "telemetry"):
            # per-tensor curves every monitor.adamw2_every steps (App. M: one point per 50), at
            # the log step of the interval that holds such a step
            every = self.settings.adamw2_every
            per_tensor = any((s + 1) % every == 0 for s in steps) or self.step == self.total_steps
            rec.update(self.optimizer.telemetry(per_tensor=per_tensor))
        return rec

    def _progress(self, rec: dict, steps: list[int], skipped: list[bool], passed: list[tuple[int, int]],
                  reason: str | None, last_vals: dict) -> None:
        """The interval's progress line: the loss, skipped steps, a spike under watch or passed, the
        lr, validation (on its own step's line only), speed, MFU and the time left."""
        step_time = self.pace.add(rec[N.STEP_TIME])
        self.metrics.progress(self.step, self.total_steps, interval_fields(
            rec, steps, skipped, passed, reason, last_vals, watch=self.divergence, step=self.step,
            total_steps=self.total_steps, text=self.data.kind == "text", step_time=step_time, spikes=self.spikes))

    def _mfu(self, samples_per_s: float) -> float | None:
        """Model FLOPs utilisation on CUDA: the model's training FLOPs per sample (nanoGPT's
        count, ``settings.flops_per_sample``) times samples per second over the device's dense
        bf16 peak; None on a CPU or an unknown GPU."""
        if self.peak_flops is None or not self.settings.flops_per_sample:
            return None
        return self.settings.flops_per_sample * samples_per_s / (self.peak_flops * self.info.world)

    # --- checkpoints ----------------------------------------------------------------

    def survival_state(self) -> dict:
        """What a rollback changed: the data offset, the lr scale, the rollbacks so far."""
        return {"data_offset": self.data_offset, "lr_scale": self.lr_scale, "rollbacks": list(self.rollbacks),
                "skipped_steps": self.skipped_steps, "spikes": list(self.spikes)}

    def load_survival_state(self, s: dict | None) -> None:
        s = s or {}
        self.data_offset, self.lr_scale = int(s.get("data_offset", 0)), float(s.get("lr_scale", 1.0))
        self.rollbacks = list(s.get("rollbacks", []))
        self.skipped_steps = int(s.get("skipped_steps", 0))
        self.spikes = list(s.get("spikes", []))

    def save(self, ring: bool = False) -> bool:
        """Checkpoint this step (and with ``ring`` add it to the ring). A state holding a NaN/inf
        is not written: then returns False, and the run is to end as diverged, for
        ``nonfinite_reason``."""
        ok = self.ckpt.save(self.step, self.survival_state(), ring=ring)
        if ok:
            self.saved_step = self.step
        else:
            self.nonfinite_reason = (f"non-finite weights or optimizer state at step {self.step} (the loss was "
                                     f"still finite): checkpoint not written, last.pt keeps the previous one")
            self.diverged_at = self.diverged_at or self.step
        return ok

    def going_back_note(self, path: Path, step: int, would: bool = False) -> str | None:
        """A resume from ``path``, a checkpoint of this run older than its newest: what it drops."""
        if path.absolute().parent != self.ckpt.dir.absolute():
            return None
        later = [s for s, _ in ring_checkpoints(self.run_dir) if s > step]
        if not later:
            return None
        be = "would be " if would else ""
        return (f"resume={path.name} {'would go' if would else 'goes'} back to step {step}: this run's history after "
                f"it (to step {max(later)} at least) {be or 'is '}abandoned, its records dropped and its {len(later)} "
                f"later checkpoint(s) removed")

    def maybe_resume(self) -> int | None:
        """Load ``resume`` (auto: the run dir's last.pt) on every rank; returns its step.

        Under SLURM or submitit a run resumes by itself when its run dir holds a checkpoint
        of the same config: that is how a requeued job continues (docs/distributed.md).
        """
        found = self.resume_source()
        if found is None:
            return None
        path, ck = found
        note = self.ckpt.restore(path, ck)
        if note:
            self.notes.append(note)
        self.load_survival_state(ck.get("survival"))
        self.step = self.saved_step = ck["step"]
        self.notes += self.resume_notes(path, ck)
        self.resume_changes = R.changes_of(self.ckpt, ck)
        if path.absolute().parent == self.ckpt.dir.absolute():
            # this run's checkpoint: the history after it is abandoned, so no rollback may restore
            # a checkpoint of it and no resume=auto may continue it (after last.pt, that is what a
            # rollback killed before its clean-up left)
            if note := self.going_back_note(path, self.step):
                self.notes.append(note)
            self.ckpt.drop_after(self.step)
        else:  # another run's checkpoint: what this directory holds is no history of it
            self.resumed_elsewhere = path
            R.set_aside_earlier_run(self.ckpt, self.notes)
        if path.absolute() != (self.ckpt.dir / "last.pt").absolute():
            self.save()
        return self.step

    def resume_source(self) -> tuple[Path, dict] | None:
        """The checkpoint ``resume`` names, loaded and checked (:func:`stabletrain.engine.resume.resume_source`)."""
        return R.resume_source(self.ckpt, self.settings, self.notes)

    def resume_notes(self, path: Path, ck: dict) -> list[str]:
        """What resuming ``ck`` changes that the user may not expect
        (:func:`stabletrain.engine.resume.resume_notes`)."""
        return R.resume_notes(self.ckpt, self.settings, self.schedule.lr_at, path, ck)

    def _no_checkpoint_before(self, onset: int, kind: str) -> str:
        """Why no rollback: what the ring holds, and the ckpt.keep that would have kept the last
        checkpoint from before ``onset`` (the ring's steps every ckpt_every, from the run's start)."""
        held = D.broadcast_object([s for s, _ in ring_checkpoints(self.run_dir)] if self.info.is_main else None,
                                  self.info)
        where = ", where the collapse began," if kind == "alert" else ""
        line = (f"no ring checkpoint before step {onset}{where} to roll back to: the ring holds "
                f"{'step(s) ' + ', '.join(map(str, held)) if held else 'none'} (ckpt.keep={self.settings.ckpt_keep})")
        every = self.settings.ckpt_every
        wanted = (onset - 1) // every * every  # the last ring step before the onset (the start's is step 0)
        if held and wanted < held[0]:
            line += f"; ckpt.keep={(held[-1] - wanted) // every + 1} would have kept step {wanted}"
        return line

    def survive(self, reason: str, refused_save: bool = False) -> str | None:
        """``divergence.action=rollback``: restore the newest ring checkpoint from before the
        trouble began, skip the data from there to the trouble (at least ``skip_window`` steps),
        scale the lr, and go on; returns None then. Returns the reason to stop otherwise.

        Every rank comes here at the same step with the same reason (it was reached through the
        all-reduce of :meth:`_log_interval`); rank 0 picks the checkpoint. metrics.jsonl keeps one
        consistent history: the records after the restored step are dropped, as on a resume."""
        w = self.divergence
        if refused_save:  # the state went non-finite after the last checkpoint, which is finite
            self.trigger = (self.step, "divergence")  # what the run's last lines say goes past it
        onset, kind = self.trigger or (self.step, "divergence")
        if w.action != "rollback" or (kind == "alert" and not self.settings.rollback_on_alert):
            return reason
        if len(self.rollbacks) >= w.max_rollbacks:
            return f"{reason}; divergence.max_rollbacks={w.max_rollbacks} reached"
        found = self.ckpt.ring_before(onset)
        if found is None:  # one from inside the trouble would restore it
            return f"{reason}; {self._no_checkpoint_before(onset, kind)}"
        again = self.rollbacks and found[0] == self.rollbacks[-1]["restored_step"]
        if again and (earlier := self.ckpt.ring_before(found[0])) is not None:
            found = earlier  # the state restored last time went wrong again: it may hold the trouble's start
        restored, path = found
        ck = load_checkpoint(path, map_location=self.device)
        # the alerts are a record of the run, not state to restore; those of the history this
        # rollback abandons (after the restored step) are marked so, for they are no longer on any curve
        fired = [{**a, "rolled_back": True} if a.get("step", restored + 1) > restored else a
                 for a in self.monitor.alerts] if self.monitor is not None else []
        self.ckpt.restore(path, ck)
        if self.monitor is not None:
            self.monitor.stop_reason, self.monitor.stop_onset = None, None
            self.monitor.alerts = fired
        detected = self.step
        # the data from the restored state's stream position to the trouble's. The trouble's step ran at
        # the offset of the newest ring checkpoint before it, except when the "again" rule went one further
        # back, past the last rollback's restored step: it ran after that rollback, at the present offset
        was = int((ck.get("survival") or {}).get("data_offset", 0))
        met = self.data_offset if again else was
        skipped = max(onset - restored + met - was, w.skip_window)
        self.data_offset = was + skipped
        self.lr_scale *= w.lr_scale_on_rollback
        self.spikes = [sp for sp in self.spikes if sp["step"] <= restored]  # those of the history abandoned: gone
        self.step = restored
        self.diverged_at = None
        # the summary's final values come from the history kept: an evaluation after the restored step,
        # and the loss of the interval the trouble was found in, are of the history abandoned
        if self.last_vals_step is not None and self.last_vals_step > restored:
            self.last_vals, self.last_vals_step = {}, None
        self.last_train_loss = self.last_penalty = None
        entry = {"trigger_step": onset, "detected_step": detected, "restored_step": restored,
                 "skipped_steps": skipped, "reason": reason}
        self.rollbacks.append(entry)
        m = self.metrics
        # saved first: a kill from here on resumes the restored state (a resume drops the later
        # ring and records, as below); a kill before it resumes last.pt and meets the trouble again
        self.save(ring=True)  # last.pt and the ring now hold the restored state with its new data offset
        self.ckpt.drop_after(restored)
        if self.info.is_main and m.enabled:
            m.truncate_after(restored)
        m.log(restored, {N.rollback("restored_step"): restored, N.rollback("skipped_steps"): skipped,
                         N.rollback("trigger_step"): onset, N.rollback("reason"): reason})
        m.message(f"rollback {len(self.rollbacks)}/{w.max_rollbacks} at step {detected}: {reason}; restored step "
                  f"{restored} ({path.name}), skipping the data of {skipped} step(s)"
                  + (f", lr x{self.lr_scale:.4g}" if self.lr_scale != 1.0 else ""))
        return None

    # --- the run --------------------------------------------------------------------

    def _install_signals(self):
        def handler(signum, _frame):
            if signum == signal.SIGINT and self.stop_signal is not None:
                # a second Ctrl-C, or one after a SIGTERM: a step (or an evaluation) that hangs can still be left
                raise KeyboardInterrupt
            if signum == signal.SIGINT and self.stop_signal is None and self.info.is_main:
                # a step may take minutes on a CPU: say at once that the Ctrl-C was heard
                # the step whose end is awaited: the next one once this step's ranks have agreed on the signals
                at = self.step if self.after_step and not self.signals_agreed else self.step + 1
                what = ("the last step is done: the run completes after its evaluation and checkpoint"
                        if self.after_step and self.step >= self.total_steps else
                        f"stopping after step {at}, with a checkpoint" if at < self.total_steps else
                        f"step {at} is the last: the run completes after it")
                # torchrun's workers run in a session of their own: a second Ctrl-C ends torchrun alone
                wait = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
                again = (f"; torchrun kills the workers {wait} s after a Ctrl-C (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and "
                         f"a second one ends torchrun alone" if os.environ.get("TORCHELASTIC_RUN_ID") else
                         " (Ctrl-C again to stop at once, without one)")
                print(f"\nCtrl-C: {what}{again}", file=sys.stderr, flush=True)
            if D.signal_rank(signum) >= D.signal_rank(self.stop_signal):
                self.stop_signal = signum  # a SIGTERM after a preemption warning must not cancel its requeue

        # SIGUSR1 is the usual preemption warning of a plain sbatch script (--signal=USR1@90),
        # SIGUSR2 submitit's; SIGTERM comes from torchrun, SLURM's kill and scancel.
        old = {}
        for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGUSR1", None), getattr(signal, "SIGUSR2", None)):
            if s is not None:
                try:
                    old[s] = signal.signal(s, handler)
                except ValueError:  # not the main thread
                    pass
        held = self.held_signal()  # read once this loop's handlers answer: none falls between the two
        if held is not None and D.signal_rank(held) >= D.signal_rank(self.stop_signal):
            self.stop_signal = held
        return old

    def fit(self) -> dict:
        resumed = self.maybe_resume()
        if resumed is None:  # before config.yaml is written: the earlier run's goes aside with its records
            R.set_aside_earlier_run(self.ckpt, self.notes)
        for hook in self.on_start:  # run.py writes config.yaml here: only once a resume has succeeded
            hook()
        # a run resumed from elsewhere starts its own records (and wandb run), with the history
        # that led to its checkpoint
        self.metrics = self.open_sink(None if self.resumed_elsewhere is not None else resumed)
        history = records_of(self.resumed_elsewhere) if self.resumed_elsewhere is not None else None
        if history is not None and self.metrics.begin_with(history, resumed):
            self.notes.append(f"the records up to step {resumed} are copied from {history}")
        if self.monitor is not None:
            self.monitor.attach(self.metrics)
        # from here to the last record: a signal is answered at the next step, or ignored once
        # the steps are done; a second Ctrl-C stops at once
        old_handlers = self._install_signals()
        try:
            previous = self._start(resumed)
            if previous is not None:
                return previous
            status, reason = self._train()
            return self._finish(status, reason, self.last_vals)
        except KeyboardInterrupt:
            last, first = self.saved_step, self.stop_signal
            # none heard before: Python's own handler raised it (this loop's were not installed)
            what = ("a Ctrl-C" if first is None else "a second Ctrl-C" if first == signal.SIGINT else
                    f"a Ctrl-C after {signal.Signals(first).name}")
            self.stop_signal = first or signal.SIGINT
            reason = (f"{what} at step {self.step}, without a checkpoint"
                      + (f" (last.pt holds step {last})" if last is not None else ""))
            self._finish("interrupted", reason, {}, quiet=True)
            raise StoppedAtOnce(reason, last) from None
        except Exception as e:
            if isinstance(e, RunDirGone):  # nowhere to say it but the last line
                raise
            # a crash (out of memory, a bug, a rank that stopped answering) still leaves a
            # summary.json saying where and why
            self._finish("failed", f"{type(e).__name__}: {first_line(e)}", {}, quiet=True)
            raise
        finally:
            self.metrics.close()
            for sig, h in old_handlers.items():
                signal.signal(sig, h)

    def headline(self) -> str:
        """What is trained, where, how long: the first line of a run and of a dry run."""
        cfg = self.settings
        nparams = sum(p.numel() for p in self.model.parameters())
        traits = [word for word, on in (("bf16", self.bf16), ("compiled", cfg.compile)) if on]
        steps = f"{self.total_steps} step" + "s" * (self.total_steps != 1)
        return (f"{cfg.title}: {param_count(nparams)} params on {self.device}"
                + (f" ({', '.join(traits)})" if traits else "") + f", {steps} of {cfg.batch_size} "
                f"{'sequences' if self.data.kind == 'text' else 'images'} "
                f"({self.shard.accum} micro-batch(es) of {self.shard.micro} x {self.info.world} rank(s))")

    def data_line(self) -> str:
        d = self.data
        what = "tokens" if d.kind == "text" else "samples"
        return (f"data: {d.source or d.kind}, {d.n_train} training {what}" + (f" ({d.n_val} val)" if d.n_val else "")
                + f", {self.steps_per_epoch} step{'s' * (self.steps_per_epoch != 1)} per epoch, "
                  f"{self.total_steps / self.steps_per_epoch:.3g} epochs"
                + (d.loader_words() if hasattr(d, "loader_words") else ""))

    def _start(self, resumed: int | None) -> dict | None:
        """The start lines; a resumed run that already completed returns its summary instead."""
        m = self.metrics
        m.message(f"{self.headline()}; run dir {self.run_dir}")
        m.message(self.data_line())
        for note in self.notes:  # some depend on where a resumed run starts (the passes still to come)
            if text := (note.at(self.step) if isinstance(note, StartNote) else note):
                m.message(text)
        self.last_vals: dict = {}
        self.last_vals_step: int | None = None  # the step last_vals were evaluated at
        if resumed is None:
            if self.monitor is not None:
                self.monitor.after_step(-1)  # the step-0 snapshot: the baseline for growth alerts
            return None
        m.message(f"resumed from step {resumed}")
        if self.step < self.total_steps:
            # where the curves continue (the figures mark it), and what the run changed there: config.yaml
            # is rewritten with this run's values
            m.log(self.step, {N.RESUMED_AT: self.step,
                              **({N.RESUME_CHANGES: ", ".join(f"{k}: {v}" for k, v in self.resume_changes.items())}
                                 if self.resume_changes else {})})
            if self.info.is_main:  # an earlier stop's summary would describe a run that is going on
                ahead = R.divergence_ahead(read_json(self.run_dir / "summary.json"), self.step,
                                           self.divergence.action == "rollback", self.resume_changes)
                if ahead:
                    m.message(ahead)
                (self.run_dir / "summary.json").unlink(missing_ok=True)
            return None
        done = self.run_dir / "summary.json"
        previous = read_json(done)
        if (previous is not None and previous.get("status") == "completed"
                and (previous.get("step"), previous.get("total_steps")) == (self.step, self.total_steps)):
            m.message(f"the checkpoint is at step {self.step} of {self.total_steps}: nothing to train; "
                      f"{done} stays as it is")
            return previous
        # e.g. a signal during the last step: finish the run
        m.message(f"the checkpoint is at step {self.step} of {self.total_steps} but the run has no completed "
                  f"summary: running the final evaluation")
        self.last_vals, self.last_vals_step = self.evaluate(), self.step
        metrics_file = self.run_dir / "metrics.jsonl"
        if math.isnan(logged_value(metrics_file, next(iter(self.last_vals)), self.step)):
            m.log(self.step, self.last_vals)  # once: a signal after the evaluation has logged it already
        # resumed from another run's last step: its loss came with that run's records
        self.last_train_loss = logged_value(metrics_file, N.LOSS, self.step)
        penalty = logged_value(metrics_file, N.LOSS_PENALTY, self.step)
        self.last_penalty = None if math.isnan(penalty) else penalty
        return None

    def _train(self) -> tuple[str, str | None]:
        """The steps, until the last one, a divergence that cannot be survived, or a signal;
        returns the run's status and the reason it stopped early."""
        cfg, m = self.settings, self.metrics
        if self.divergence.action == "rollback" and self.ckpt.ring_before(self.step + 1) is None:
            self.save(ring=True)  # the start (step 0, or the resumed step) in the ring: a rollback is possible at once
        stream = self.data.train_iter(self.step + self.data_offset, self.shard)
        pending: list[tuple[int, StepResult]] = []
        t_last = time.perf_counter()

        def flush(t_end: float, fresh: dict) -> str | None:
            """Log the steps since the last log and check them; ``fresh`` is this step's
            evaluation, if it had one."""
            reason = self._log_interval(pending, t_end - t_last, fresh)
            pending.clear()
            return reason

        while self.step < self.total_steps:
            self.after_step = self.signals_agreed = False
            step = self.step
            save_due = (step + 1) % cfg.ckpt_every == 0 or step + 1 == self.total_steps
            eval_due = (step + 1) % cfg.eval_every == 0 or step + 1 == self.total_steps
            # a checkpoint is written only after its steps' losses were checked; an evaluation
            # is shown on the log line of its own step
            log_now = (step + 1) % cfg.log_every == 0 or save_due or eval_due
            pending.append((step, self.train_step(next(stream), want_grad_norm=log_now)))
            self.step, self.after_step = step + 1, True
            if self.monitor is not None:
                self.monitor.after_step(step, last=self.step == self.total_steps)
            t_end = time.perf_counter()  # the interval's time excludes evaluation and checkpoints
            fresh = {}
            if eval_due:
                self.last_vals = fresh = self.evaluate()  # before the log line, which shows it
                self.last_vals_step = self.step
                m.log(self.step, fresh)
            reason = flush(t_end, fresh) if log_now else None
            # every step, on every rank: a signal landing during the agreement counts at the next step
            held = self.stop_signal
            self.signals_agreed = True  # a signal from here on is agreed on at the next step
            agreed = D.agree_on_signal(held, self.info)
            if agreed is not None and pending:
                reason = flush(time.perf_counter(), {})
            rolled_back = False
            if reason:
                reason = self.survive(reason)
                if reason is not None and self.step == self.total_steps and (self.trigger or (0, ""))[1] == "alert":
                    return "completed", None  # it trained every step: the alert is on record, in summary.json
                if reason is not None:
                    return "diverged", reason
                # rolled back, and saved: the step counter and the data stream moved
                stream = self.data.train_iter(self.step + self.data_offset, self.shard)
                rolled_back = True
            # no checkpoint inside a run of skipped (non-finite) steps, but for the last one; none
            # into the ring during a spike not yet confirmed (it would push out the states before it),
            # nor in the divergence warmup, where a spike is watched but not counted
            save_now = save_due and not rolled_back and (self.divergence.skips == 0 or self.step == self.total_steps)
            ring = save_now and not self.divergence.above  # above: over > 0, or a spike in the warmup
            if agreed is not None and self.step < self.total_steps:  # at the last step: the run ends anyway
                self.stop_signal = agreed
                if not rolled_back and not self.save(ring=ring):
                    reason = self.survive(self.nonfinite_reason, refused_save=True)
                    if reason is not None:
                        return "diverged", reason
                return "interrupted", f"signal {signal.Signals(agreed).name}"  # the step: the status line's
            if save_now and not self.save(ring=ring):  # non-finite weights: last.pt and the ring keep the last finite
                reason = self.survive(self.nonfinite_reason, refused_save=True)
                if reason is not None:
                    return "diverged", reason
                stream = self.data.train_iter(self.step + self.data_offset, self.shard)
            if not pending:
                t_last = time.perf_counter()  # the next interval starts after this one's evaluation and saves
        return "completed", None

    def _finish(self, status: str, reason: str | None, last_vals: dict, quiet: bool = False) -> dict:
        """The run's summary, written atomically to summary.json by rank 0 and returned."""
        summary = {
            "status": status,
            "step": self.step,
            "total_steps": self.total_steps,
            "reason": reason,
            "final": {**({"loss": self.last_train_loss} if self.last_train_loss is not None else {}),
                      # what runs with and without loss terms share: the task's loss
                      **({"task_loss": self.last_train_loss - self.last_penalty}
                         if self.last_penalty is not None and self.last_train_loss is not None else {}),
                      **last_vals},
            "params": sum(p.numel() for p in self.model.parameters()),
        }
        if last_vals:
            summary["eval_step"] = self.last_vals_step  # earlier than "step" when stopped between evaluations
        if self.guard is not None:
            summary["skipped_steps"] = self.skipped_steps
        if status == "diverged":
            summary["diverged_at"] = self.diverged_at or self.step  # may precede the step it was seen at
        if status == "interrupted":
            summary["signal"] = int(self.stop_signal)
        spikes = self.spikes if status == "diverged" else with_open_spike(self.spikes, self.divergence, self.step)
        if spikes:
            summary["spikes"] = spikes
        if self.divergence.action == "rollback":
            summary["rollbacks"] = self.rollbacks
            summary["lr_scale"] = self.lr_scale  # divergence.lr_scale_on_rollback, compounded
        if self.monitor is not None and not quiet:
            summary.update(self.monitor.summary(status, self.step))
        if self.info.is_main:
            try:
                write_json(self.run_dir / "summary.json", summary)
            except OSError:
                if not quiet:
                    raise
            if not quiet:
                alerts = self.monitor.alerts if self.monitor is not None else []
                at = summary.get("diverged_at", self.step)
                self.metrics.message(end_line(summary, alerts=alerts, last_vals=last_vals,
                                              eval_step=self.last_vals_step))
                if status == "interrupted" and not D.may_be_requeued():  # a line of its own, to copy
                    self.metrics.message(f"continue it with: {continue_with(self.run_dir, self.settings.overrides)}")
                onset = self.trigger[0] if self.trigger is not None else at  # a spike's first step: a rollback's aim
                ring = [s for s, _ in ring_checkpoints(self.run_dir)]
                if status == "diverged" and self.divergence.action != "rollback" and self.trigger is not None \
                        and self.trigger[1] == "divergence" and any(s < onset for s in ring):
                    # the same command would meet the same data and state again: what goes past it
                    self.metrics.message(
                        f"to go past it: {continue_with(self.run_dir, self.settings.overrides)} "
                        f"divergence.action=rollback (back to a checkpoint before step {onset}, skipping the data "
                        f"from there; divergence.lr_scale_on_rollback=0.5 also halves the lr)")
        return summary
