"""The training loop: one process on CPU or one GPU, or one rank of a DDP job.

The hot path per optimizer step is: the step's micro-batches (no host sync), forward and
backward under autocast, optional clipping, the optimizer, the step hooks (sigmaReparam's
power iteration). Losses stay on the device and are read back every ``logger.log_every``
steps, where divergence is checked step by step, so a healthy run does not sync every step.

The trainer receives built objects (:mod:`stabletrain.build` turns a config into them) and
imports nothing of models/, data/ or optim/.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from stabletrain.engine import distributed as D
from stabletrain.engine.checkpoint import (
    all_finite,
    dcp_dir,
    drop_ring_after,
    last_checkpoint,
    load_checkpoint,
    ring_checkpoints,
    rng_state,
    save_checkpoint,
    save_to_ring,
    set_rng_state,
)
from stabletrain.engine.divergence import DivergenceWatch
from stabletrain.engine.guard import StepGuard
from stabletrain.errors import ConfigError
from stabletrain.metrics import write_json
from stabletrain.monitor import names as N



def _optim_name(config_yaml: str) -> str | None:
    """``optim.name`` of a resolved config's yaml (a checkpoint's, or this run's)."""
    if not config_yaml:
        return None
    name = OmegaConf.select(OmegaConf.create(config_yaml), "optim.name", default=None)
    return None if name is None else str(name)


def _read_summary(path: Path) -> dict | None:
    """A run's summary.json, or None when there is none or it is unreadable (a torn write)."""
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def _last_logged(path: Path, key: str, step: int) -> float:
    """The value of ``key`` logged at ``step`` in metrics.jsonl (NaN when absent)."""
    from stabletrain.metrics import read_records

    vals = [r[key] for r in read_records(path) if r.get("step") == step and key in r]
    return float(vals[-1]) if vals else float("nan")


# keys a resumed run may change: how it is run and recorded, not what it trains
RESUME_MAY_CHANGE = ("resume", "resume_allow_changes", "logger", "monitor", "eval_every", "eval_batches", "ckpt_every",
                     "ckpt", "steps", "epochs", "name", "device", "compile", "dist_timeout", "dry_run",
                     "activation_checkpointing",
                     "ema")  # a weight average added on resume starts from the resumed weights


def changed_keys(saved_yaml: str, mine_yaml: str) -> list[str]:
    """The dotted keys whose values differ between two resolved configs, outside RESUME_MAY_CHANGE."""
    def flat(node, prefix=""):
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                out.update(flat(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: node}

    a, b = (flat(OmegaConf.to_container(OmegaConf.create(y))) for y in (saved_yaml, mine_yaml))
    return sorted(k for k in set(a) | set(b)
                  if a.get(k) != b.get(k) and k.split(".")[0] not in RESUME_MAY_CHANGE)


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
    title: str = "model"  # the start line's name for the model
    flops_per_sample: float = 0.0  # training FLOPs of one sample (sequence or image), for MFU
    ckpt_keep: int = 0  # ring checkpoints (checkpoints/step_NNNNNN.pt) besides last.pt
    rollback_on_alert: bool = False  # the monitors' stop request rolls back (divergence.action=rollback)
    nan_at_step: int | None = None  # fault injection (debug.*): the loss of this 1-based step times NaN
    spike_at_step: int | None = None  # ... times spike_factor
    spike_factor: float = 1e4
    sharded: bool = False  # the model is FSDP2-sharded (parallel=fsdp): no DDP wrap, DCP checkpoints


class Trainer:
    """One process's training: on CPU or one GPU, or one rank of a DDP job.

    It receives the model, its optimizer and ``schedule`` (``schedule(optimizer, step)`` sets
    the step's rates and returns the lr), the data and this rank's ``shard`` of each batch, the
    task ``criterion`` (``(logits, y) -> loss``, after ``mixup`` when given), extra
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
        self.lr_at = schedule.lr_at
        self.total_steps, self.steps_per_epoch = settings.total_steps, settings.steps_per_epoch
        self.bf16 = settings.bf16
        self.params = [p for p in model.parameters() if p.requires_grad]
        # each loss term's share of the logged loss, summed over a log interval (on the device)
        self.term_sums = torch.zeros(len(self.loss_terms), device=device)
        self.train_model: nn.Module = model
        self.objective = self._objective
        if settings.compile:
            # The loss is compiled too: for a GPT, an fp32 copy of the logits (and of their gradient)
            # would otherwise be written to memory, the largest activation of the step.
            # Runs of a sweep share a process (Hydra's basic launcher). Without a reset, a run would
            # reuse what earlier runs compiled: a swept size or constant then comes back as a dynamic
            # shape or symbol (other kernels, other roundings), so a run would not compute what it does alone.
            torch._dynamo.reset()
            if settings.sharded:
                self._allow_a_compile_per_block(model)
            self.train_model = torch.compile(model)
            self.objective = torch.compile(self._objective)
        self.sharded = settings.sharded
        if self.info.enabled and not self.sharded:  # an FSDP2 model reduces its own gradients
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [device.index] if device.type == "cuda" else None
            self.train_model = DDP(self.train_model, device_ids=ids)
        self.stop_signal: int | None = None
        self.step = 0
        self.notes: list[str] = list(messages)  # said once the metrics sink exists
        self.diverged_at: int | None = None
        self.on_start: list = []  # called once fit() has resumed (or not), before the first step
        self.step_time: float | None = None  # smoothed seconds per step, for the progress line's ETA
        self.intervals_logged = 0
        # surviving a spike: skipped steps, and rollbacks (saved in checkpoints under "survival")
        self.guard = StepGuard(model, optimizer, ema) if self.divergence.skip_nonfinite else None
        self.data_offset = 0  # the batch of step s is the stream's position s + data_offset
        self.lr_scale = 1.0  # divergence.lr_scale_on_rollback, compounded per rollback
        self.rollbacks: list[dict] = []
        self.trigger: tuple[int, str] | None = None  # (onset step, kind) of the last stop reason

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

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def loss_on(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The task loss plus every loss term; each term's share is added to ``term_sums``."""
        with self.autocast():
            out = model(x)
        loss, terms = self.objective(self.model, out, x, y)
        if self.weight_terms:
            from stabletrain.engine.sharding import with_whole_weights

            extra = torch.stack([t(self.model, out, x, y, whole_weights=with_whole_weights)
                                 for t in self.weight_terms])
            loss = loss + extra.sum()
            terms = extra.detach() if terms is None else torch.cat([terms, extra.detach()])
        if terms is not None:
            self.term_sums += terms / self.shard.accum
        return loss

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

    def _inject(self, loss: torch.Tensor) -> torch.Tensor:
        """debug.nan_at_step / debug.spike_at_step: a fault in this step's loss, before backward.

        The fault belongs to the batch (the stream position ``K - 1``, step K of a run that never
        rolled back), as bad data would: a rollback that skips that batch skips the fault."""
        done = self.step + self.data_offset + 1  # 1-based, like diverged_at
        if done == self.settings.nan_at_step:
            loss = loss * float("nan")  # a product, so the gradients are NaN too
        if done == self.settings.spike_at_step:
            loss = loss * self.settings.spike_factor
        return loss

    def train_step(self, micro_batches, want_grad_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over this rank's micro-batches; the loss stays on the device.

        With ``divergence.skip_nonfinite`` a step whose gradient norm is not finite changes
        nothing (engine/guard.py); ``self.last_skipped`` is then 1 (a device tensor, no sync)."""
        self.schedule(self.optimizer, self.step)
        if self.lr_scale != 1.0:
            for g in self.optimizer.param_groups:
                g["lr"] *= self.lr_scale
        self.train_model.train()
        guard = self.guard
        if guard is not None:
            guard.begin()
        inject = self.step + self.data_offset + 1 in (self.settings.nan_at_step, self.settings.spike_at_step)
        total = torch.zeros((), device=self.device)
        n = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            x, y = self._to_device(x, y)
            if self.mixup is not None:
                x, y = self.mixup(x, y)
            sync = i == n - 1 or not self.info.enabled
            if self.sharded:  # FSDP2: reduce-scatter only after the last micro-batch
                from stabletrain.engine.sharding import set_gradient_sync

                set_gradient_sync(self.model, sync)
                ctx = contextlib.nullcontext()
            else:
                ctx = contextlib.nullcontext() if sync else self.train_model.no_sync()
            with ctx:
                loss = self.loss_on(self.train_model, x, y)
                if inject:
                    loss = self._inject(loss)
                (loss / n).backward()
            total += loss.detach() / n
        grad_norm = None  # before clipping; computed only when clipping or logging needs it
        if self.settings.grad_clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.grad_clip, foreach=True)
        elif want_grad_norm or guard is not None:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None],
                                                      foreach=True)
        if self.sharded and grad_norm is not None:  # a DTensor over sharded gradients: the whole norm
            from stabletrain.engine.sharding import full

            grad_norm = full(grad_norm)

        def update():
            self.optimizer.step()
            for hook in self.step_hooks:
                hook()
            if self.ema is not None:
                self.ema.after_step(self.model, self.step)

        if guard is None:
            update()
            self.last_skipped = None
        else:
            finite = torch.isfinite(grad_norm)  # the same on every rank: the grads are all-reduced
            guard.step(finite, update)
            self.last_skipped = (~finite).float()
        self.optimizer.zero_grad(set_to_none=True)
        return total, grad_norm

    # --- evaluation -----------------------------------------------------------------

    def evaluate(self) -> dict:
        """``val/*`` of the live model, and ``val_ema/*`` of the weight average when ``ema.decay`` is set."""
        out = self._score(self.model, N.VAL)
        if self.ema is not None:
            out.update(self._score(self.ema.for_eval(), N.VAL_EMA))
        return out

    @torch.no_grad()
    def _score(self, model: nn.Module, prefix: str) -> dict:
        model.eval()
        # The same global eval batches whatever the world size; each rank scores its slice.
        bs = min(self.settings.batch_size, 256)
        r, w = self.info.rank, self.info.world
        # (loss sum, correct, count) summed on the device: one host sync per evaluation, not per batch
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
        loss_sum, correct, count = stats.tolist()
        loss = loss_sum / max(count, 1)
        if self.data.kind == "text":
            return {N.scored(prefix, "loss"): loss, N.scored(prefix, "ppl"): math.exp(min(loss, 50.0))}
        return {N.scored(prefix, "loss"): loss, N.scored(prefix, "acc"): correct / max(count, 1)}

    # --- logging --------------------------------------------------------------------

    def _log_interval(self, pending, samples: int, dt: float, lr: float, last_vals: dict) -> str | None:
        """Read the interval's losses back (the one host sync), check divergence step by step,
        and log. Under DDP the losses are the global batch's and the monitors' stop request is
        shared, so every rank reaches the same verdict at the same step. Returns the reason to
        stop, or None."""
        stop = 1.0 if self.monitor is not None and self.monitor.stop_reason else 0.0
        k, n = len(self.loss_terms), len(pending)
        guarded = self.guard is not None
        # the skip flags are the same on every rank (from the all-reduced gradients): averaging keeps them
        flags = [torch.stack([p[4] for p in pending])] if guarded else []
        values = torch.cat([torch.stack([p[1] for p in pending]), *flags, self.term_sums,
                            torch.tensor([stop], device=self.device)])
        self.term_sums = torch.zeros(k, device=self.device)
        if self.info.enabled:
            torch.distributed.all_reduce(values)
            values[:-1] /= self.info.world
        values = values.tolist()
        losses, values = values[:n], values[n:]
        skipped = [v > 0.5 for v in values[:n]] if guarded else [False] * n
        values = values[n:] if guarded else values
        terms, stop = values[:k], values[-1]
        reason = None
        self.trigger = None
        for p, value, skip in zip(pending, losses, skipped):
            s = p[0]
            reason = self.divergence.update(s + 1, value, skip)  # steps done, as everywhere else
            if reason:
                self.diverged_at = self.divergence.onset if skip else s + 1  # the first non-finite step
                self.trigger = (self.divergence.onset or s + 1, "divergence")
                break
        if reason is None and stop > 0:
            reason = self.monitor.stop_reason if self.monitor is not None and self.monitor.stop_reason \
                else "entropy collapse (on rank 0)"
            self.trigger = (self.step, "alert")
        healthy = [v for v, skip in zip(losses, skipped) if not skip]  # a skipped step's loss is nan
        self.last_train_loss = sum(healthy) / len(healthy) if healthy else float("nan")
        rec = {N.LOSS: self.last_train_loss, N.LR: lr, N.STEP_TIME: dt / len(pending)}
        if guarded:
            rec[N.SKIPPED_STEPS] = sum(skipped)
        if k:
            rec[N.LOSS_PENALTY] = sum(terms) / len(pending)
        if k > 1:
            rec.update({N.loss_term(t.name): v / len(pending) for t, v in zip(self.loss_terms, terms)})
        unit = self.data.seq_len or 1
        per_s = samples * unit / dt
        rec[N.throughput("tokens" if self.data.kind == "text" else "samples")] = per_s
        mfu = self._mfu(samples / dt)
        if mfu is not None:
            rec[N.MFU] = mfu
        gnorm = pending[-1][2]
        if gnorm is not None:
            rec[N.GRAD_NORM] = float(gnorm)
        bad = self.data.bad_samples() if hasattr(self.data, "bad_samples") else 0
        if bad:
            rec[N.BAD_SAMPLES] = bad
        if self.device.type == "cuda":
            rec[N.PEAK_MEMORY] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if hasattr(self.optimizer, "telemetry"):
            tel = self.optimizer.telemetry()
            # per-tensor curves every monitor.adamw2_every steps (App. M: one point per 50), at
            # the log step of the interval that holds such a step
            every = self.settings.adamw2_every
            if not any((s + 1) % every == 0 for s, *_ in pending) and self.step != self.total_steps:
                tel = {key: v for key, v in tel.items() if key == N.FRAC_BOUNDED}
            rec.update(tel)
        self.metrics.log(self.step, rec)
        # validation only on the line of the step that evaluated it (last_vals is empty otherwise)
        shown = {key: v for key, v in last_vals.items() if key.startswith((N.VAL + "/", N.VAL_EMA + "/"))}
        step_s = dt / len(pending)
        # The first interval of a process carries the warm-up (torch.compile, the allocator, kernel
        # autotuning): the second replaces it instead of being averaged with it, or a compiled run's
        # ETA would stay minutes too long for a dozen log lines.
        fresh = self.step_time is None or self.intervals_logged == 1
        self.step_time = step_s if fresh else 0.7 * self.step_time + 0.3 * step_s
        self.intervals_logged += 1
        speed = {"tok/s" if self.data.kind == "text" else "img/s": _si(per_s), "s/step": f"{step_s:.3g}",
                 **({"mfu": f"{mfu:.1%}"} if mfu is not None else {}),
                 "eta": _duration((self.total_steps - self.step) * self.step_time)}
        self.metrics.progress(self.step, self.total_steps, {N.LOSS: self.last_train_loss, N.LR: lr, **shown, **speed})
        return reason

    def _mfu(self, samples_per_s: float) -> float | None:
        """Model FLOPs utilisation on CUDA: the model's training FLOPs per sample (nanoGPT's
        count, ``settings.flops_per_sample``) times samples per second over the device's dense
        bf16 peak; None on a CPU or an unknown GPU."""
        if self.device.type != "cuda" or not self.settings.flops_per_sample:
            return None
        peak = peak_flops(torch.cuda.get_device_name(self.device))
        return None if peak is None else self.settings.flops_per_sample * samples_per_s / (peak * self.info.world)

    # --- checkpoints ----------------------------------------------------------------

    def checkpoint_payload(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "rng": rng_state(),
            "divergence": self.divergence.state_dict(),
            "config": self.settings.config_yaml,
            "monitor": self.monitor.state_dict() if self.monitor is not None else {},
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "survival": self.survival_state(),
        }

    def survival_state(self) -> dict:
        """What a rollback changed: the data offset, the lr scale, the rollbacks so far."""
        return {"data_offset": self.data_offset, "lr_scale": self.lr_scale, "rollbacks": list(self.rollbacks)}

    def load_survival_state(self, s: dict | None) -> None:
        s = s or {}
        self.data_offset, self.lr_scale = int(s.get("data_offset", 0)), float(s.get("lr_scale", 1.0))
        self.rollbacks = list(s.get("rollbacks", []))

    def save(self) -> bool:
        """Write last.pt unless the weights or optimizer state hold a NaN/inf (a finite loss
        does not prove them finite): a finite last.pt is never replaced by a non-finite one.
        Returns False, with ``nonfinite_reason`` set, when the save was skipped for that."""
        if self.sharded:
            return self._save_sharded()
        ok = True
        if self.info.is_main:
            payload = self.checkpoint_payload()
            # one fused reduction on the device, read back with the sync the save makes anyway
            ok = bool(all_finite(payload["model"], payload["optimizer"]["state"]))
            if ok:
                payload["optim_name"] = self.optim_name
                save_checkpoint(self.run_dir / "checkpoints" / "last.pt", payload)
        return self._saved(D.broadcast_object(ok, self.info))

    def _saved(self, ok: bool) -> bool:
        """After a save on every rank: a refused (non-finite) state ends the run as diverged."""
        if not ok:
            self.nonfinite_reason = (f"non-finite weights or optimizer state at step {self.step} (the loss was "
                                     f"still finite): checkpoint not written, last.pt keeps the previous one")
            self.diverged_at = self.diverged_at or self.step
        D.barrier(self.info)
        return ok

    def _save_sharded(self) -> bool:
        """parallel=fsdp: every rank checks its shards and writes them through
        torch.distributed.checkpoint into ``checkpoints/last_dcp/``; rank 0 then writes the rest
        of the payload (step, RNG, divergence, config...) into last.pt, which names that directory."""
        from stabletrain.engine import sharding as S

        local = [S.local(t) for t in self.model.state_dict().values() if torch.is_tensor(t)]
        local += [S.local(v) for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        ok = S.all_finite_everywhere(all_finite(local))
        if ok:
            ckpt_dir = self.run_dir / "checkpoints"
            stepped = bool(self.optimizer.state)  # before its first step an optimizer has nothing to save
            S.save_dcp(ckpt_dir, self.model, self.optimizer if stepped else None, self.step, self._ema_module)
            if self.info.is_main:
                payload = self.checkpoint_payload_rest()
                payload.update(dcp=S.DCP_DIR, dcp_optim=stepped, optim_name=self.optim_name)
                save_checkpoint(ckpt_dir / "last.pt", payload)
        return self._saved(ok)

    def checkpoint_payload_rest(self) -> dict:
        """The payload of last.pt without the model and optimizer (saved sharded, beside it)."""
        return {"step": self.step, "rng": rng_state(), "divergence": self.divergence.state_dict(),
                "config": self.settings.config_yaml,
                "monitor": self.monitor.state_dict() if self.monitor is not None else {},
                "ema": self.ema.counters() if self.ema is not None else None, "survival": self.survival_state()}

    @property
    def _ema_module(self) -> nn.Module | None:
        return self.ema.module if self.ema is not None else None

    def _load_weights(self, pt: Path, ck: dict) -> None:
        """The model and optimizer of checkpoint ``pt`` (loaded as ``ck``): from ``ck``, or from
        its DCP directory when sharded (with the weight average's model)."""
        if not self.sharded:
            self.model.load_state_dict(ck["model"])
            self.optimizer.load_state_dict(ck["optimizer"])
            return
        from stabletrain.engine.sharding import load_dcp

        # a weight average added on resume has none saved: it starts from the loaded weights
        ema = self._ema_module if ck.get("ema") is not None else None
        stepped = ck.get("dcp_optim", True)
        saved_step = load_dcp(dcp_dir(pt), self.model, self.optimizer if stepped else None, ema)
        if not stepped:  # saved before the first step: the optimizer starts afresh, as it did then
            self.optimizer.load_state_dict({"state": {}, "param_groups": self.optimizer.state_dict()["param_groups"]})
        if saved_step != ck["step"]:
            raise ValueError(f"{dcp_dir(pt).name}/ holds step {saved_step}, {pt.name} step {ck['step']}")

    @property
    def optim_name(self) -> str:
        """The optimizer's name in the config (``optim.name``), stored in each checkpoint."""
        return _optim_name(self.settings.config_yaml) or type(self.optimizer).__name__

    def maybe_resume(self) -> int | None:
        """Load ``resume`` (auto: the run dir's last.pt) on every rank; returns its step.

        Under SLURM or submitit a run resumes by itself when its run dir holds a checkpoint
        of the same config: that is how a requeued job continues (docs/distributed.md).
        """
        r = self.settings.resume
        requeued = r is None and D.may_be_requeued()
        if r is None and not requeued:
            return None
        path = last_checkpoint(self.run_dir) if r in (None, "auto") else Path(r)
        path = D.broadcast_object(path, self.info)  # rank 0's view of the shared filesystem decides
        if path is None:
            if r == "auto":
                self.notes.append(f"resume=auto: no checkpoint in {self.run_dir / 'checkpoints'}, starting "
                                  f"from step 0 (to continue a run, pass its directory as hydra.run.dir)")
            return None
        try:
            ck = load_checkpoint(path, map_location=self.device)
        except Exception as e:  # a directory, a file that is no checkpoint, a torn write
            raise ConfigError(f"resume={path}: not a readable checkpoint ({type(e).__name__}); "
                              f"pass a last.pt written by a run, or resume=auto") from None
        if requeued:
            saved, mine = (OmegaConf.to_container(OmegaConf.create(y))
                           for y in (ck["config"], self.settings.config_yaml))
            if {**saved, "resume": None} != {**mine, "resume": None}:
                raise ConfigError(f"{path} was written by a run with another config; pass resume=auto to "
                                  f"continue it anyway, or give this run its own hydra.run.dir")
        # checked before anything is loaded or cut (metrics.jsonl is truncated only after this returns)
        theirs, mine = ck.get("optim_name") or _optim_name(ck.get("config", "")), self.optim_name
        if theirs is not None and mine is not None and theirs != mine:
            raise ConfigError(f"{path} was written with optim={theirs}, this run uses optim={mine}: an optimizer's "
                              f"state does not carry over; resume with optim={theirs} or start a new run")
        if r == "auto" and not self.settings.resume_allow_changes and ck.get("config") and self.settings.config_yaml:
            changed = changed_keys(ck["config"], self.settings.config_yaml)
            if changed:
                raise ConfigError(f"resume=auto would change the resumed run's {', '.join(changed[:8])}"
                                  f"{' ...' if len(changed) > 8 else ''}: drop those overrides, or pass "
                                  f"resume_allow_changes=true to continue with them")
        if bool(ck.get("dcp")) != self.sharded:
            raise ConfigError(f"{path} was written with parallel={'fsdp' if ck.get('dcp') else 'ddp'}, this run uses "
                              f"parallel={'fsdp' if self.sharded else 'ddp'}: resume it with the parallel it was "
                              f"written with") from None
        try:
            self._load_weights(path, ck)
        except (RuntimeError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0][:200]
            raise ConfigError(f"{path} does not fit this run's model or optimizer ({first}); resume it with "
                              f"the config it was written with ({path.parent.parent / 'config.yaml'})") from None
        self.divergence.load_state_dict(ck["divergence"])
        self.load_survival_state(ck.get("survival"))
        set_rng_state(ck["rng"])
        if self.monitor is not None and ck.get("monitor"):
            self.monitor.load_state_dict(ck["monitor"])
        if self.ema is not None:
            self.ema.load_state_dict(ck.get("ema"), self.model)
        self.step = ck["step"]
        return self.step

    # --- surviving a spike: the checkpoint ring and rollbacks -------------------------

    def save_ring(self) -> None:
        """last.pt, just written by :meth:`save`, joins the ring of ``ckpt.keep`` checkpoints (rank 0)."""
        if self.info.is_main and self.settings.ckpt_keep > 0:
            save_to_ring(self.run_dir, self.step, self.settings.ckpt_keep, sharded=self.sharded)

    def survive(self, reason: str) -> str | None:
        """``divergence.action=rollback``: restore the newest ring checkpoint from before the
        trouble began, skip the data from there to the trouble (at least ``skip_window`` steps),
        scale the lr, and go on; returns None then. Returns the reason to stop otherwise.

        Every rank comes here at the same step with the same reason (it was reached through the
        all-reduce of :meth:`_log_interval`); rank 0 picks the checkpoint. metrics.jsonl keeps one
        consistent history: the records after the restored step are dropped, as on a resume."""
        w = self.divergence
        onset, kind = self.trigger or (self.step, "divergence")
        if w.action != "rollback" or (kind == "alert" and not self.settings.rollback_on_alert):
            return reason
        if len(self.rollbacks) >= w.max_rollbacks:
            return f"{reason}; divergence.max_rollbacks={w.max_rollbacks} reached"
        found = None
        if self.info.is_main:
            before = [(s, p) for s, p in ring_checkpoints(self.run_dir) if s < onset]
            found = before[-1] if before else None
        found = D.broadcast_object(found, self.info)
        if found is None:
            return f"{reason}; no ring checkpoint before step {onset} to roll back to"
        restored, path = found
        ck = load_checkpoint(path, map_location=self.device)
        self._load_weights(path, ck)
        self.divergence.load_state_dict(ck["divergence"])
        set_rng_state(ck["rng"])
        if self.monitor is not None:
            if ck.get("monitor"):
                self.monitor.load_state_dict(ck["monitor"])
            self.monitor.stop_reason = None
        if self.ema is not None:
            self.ema.load_state_dict(ck.get("ema"), self.model)
        detected = self.step
        skipped = max(onset - restored, w.skip_window)
        self.data_offset = int((ck.get("survival") or {}).get("data_offset", 0)) + skipped
        self.lr_scale *= w.lr_scale_on_rollback
        self.step = restored
        self.diverged_at = None
        entry = {"trigger_step": onset, "detected_step": detected, "restored_step": restored,
                 "skipped_steps": skipped, "reason": reason}
        self.rollbacks.append(entry)
        m = self.metrics
        if self.info.is_main:
            drop_ring_after(self.run_dir, restored)
            if m.enabled:
                m.truncate_after(restored)
        m.log(restored, {N.rollback("restored_step"): restored, N.rollback("skipped_steps"): skipped,
                         N.rollback("trigger_step"): onset, N.rollback("reason"): reason})
        m.message(f"rollback {len(self.rollbacks)}/{w.max_rollbacks} at step {detected}: {reason}; restored step "
                  f"{restored} ({path.name}), skipping the data of {skipped} step(s)"
                  + (f", lr x{self.lr_scale:.4g}" if self.lr_scale != 1.0 else ""))
        self.save()  # last.pt and the ring now hold the restored state with its new data offset
        self.save_ring()
        return None

    # --- the run --------------------------------------------------------------------

    def _install_signals(self):
        def handler(signum, _frame):
            self.stop_signal = signum

        # SIGUSR1 is the usual preemption warning of a plain sbatch script (--signal=USR1@90),
        # SIGUSR2 submitit's; SIGTERM comes from torchrun, SLURM's kill and scancel.
        old = {}
        for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGUSR1", None), getattr(signal, "SIGUSR2", None)):
            if s is not None:
                try:
                    old[s] = signal.signal(s, handler)
                except ValueError:  # not the main thread
                    pass
        return old

    def fit(self) -> dict:
        cfg = self.settings
        resumed = self.maybe_resume()
        for hook in self.on_start:  # run.py writes config.yaml here: only once a resume has succeeded
            hook()
        main = self.info.is_main
        self.metrics = self.open_sink(resumed)
        if self.monitor is not None:
            self.monitor.attach(self.metrics)
        m = self.metrics
        nparams = sum(p.numel() for p in self.model.parameters())
        m.message(f"{cfg.title}: {nparams / 1e6:.2f}M params on {self.device}"
                  f"{' (bf16)' if self.bf16 else ''}, {self.total_steps} steps of {cfg.batch_size} "
                  f"({self.shard.accum} micro-batch(es) of {self.shard.micro} x {self.info.world} rank(s)); "
                  f"run dir {self.run_dir}")
        warm = self.schedule.warmup_steps
        if warm >= self.total_steps:
            m.message(f"warning: the warmup ({warm} steps) is as long as the run ({self.total_steps} steps): the "
                      f"learning rate never reaches its peak; shorten warmup or train longer")
        for note in self.notes:
            m.message(note)
        if resumed is not None:
            m.message(f"resumed from step {resumed}")
            done = self.run_dir / "summary.json"
            previous = _read_summary(done) if self.step >= self.total_steps else None
            if previous is not None and previous.get("status") == "completed":
                m.message(f"the checkpoint is at step {self.step} of {self.total_steps}: nothing to train; "
                          f"{done} stays as it is")
                m.close()
                return previous
            if self.step >= self.total_steps:  # e.g. a signal during the last step: finish the run
                m.message(f"the checkpoint is at step {self.step} of {self.total_steps} but the run has no completed "
                          f"summary: running the final evaluation")
        if self.monitor is not None and resumed is None:
            self.monitor.after_step(-1)  # the step-0 snapshot: the baseline for growth alerts
        old_handlers = self._install_signals()
        status, reason = "completed", None
        if self.divergence.action == "rollback" and resumed is None:
            self.save()  # step 0 in the ring: a rollback is possible from the first step
            self.save_ring()
        stream = self.data.train_iter(self.step + self.data_offset, self.shard)
        log_every = max(1, cfg.log_every)
        pending: list[tuple[int, torch.Tensor, torch.Tensor | None, float, torch.Tensor | None]] = []
        t_last, samples = time.perf_counter(), 0
        last_vals: dict = {}
        train_loss = float("nan")
        def flush(lr: float, t_end: float, fresh: dict) -> str | None:
            """Log the steps since the last log (the one host sync) and check them; ``fresh`` is
            this step's evaluation, if it had one."""
            nonlocal pending, samples, t_last, train_loss
            reason = self._log_interval(pending, samples, t_end - t_last, lr, fresh)
            train_loss = self.last_train_loss
            pending, samples, t_last = [], 0, time.perf_counter()
            return reason

        try:
            while self.step < self.total_steps:
                step = self.step
                lr = self.lr_at(step) * self.lr_scale  # what train_step sets, for the log line
                save_due = (step + 1) % cfg.ckpt_every == 0 or step + 1 == self.total_steps
                eval_due = (step + 1) % cfg.eval_every == 0 or step + 1 == self.total_steps
                # a checkpoint is written only after its steps' losses were checked; an evaluation
                # is shown on the log line of its own step
                log_now = (step + 1) % log_every == 0 or save_due or eval_due
                loss, gnorm = self.train_step(next(stream), want_grad_norm=log_now)
                pending.append((step, loss, gnorm, lr, self.last_skipped))
                samples += cfg.batch_size
                self.step = step + 1
                if self.monitor is not None:
                    self.monitor.after_step(step, last=self.step == self.total_steps)
                t_end = time.perf_counter()  # the interval's time excludes evaluation
                fresh = {}
                if eval_due:
                    last_vals = fresh = self.evaluate()  # before the log line, which shows it
                    m.log(self.step, last_vals)
                if log_now:
                    reason = flush(lr, t_end, fresh)
                    if reason:
                        reason = self.survive(reason)
                        if reason is None:  # rolled back: the step counter and the data stream moved
                            stream = self.data.train_iter(self.step + self.data_offset, self.shard)
                            continue
                        status = "diverged"
                        break
                # A signal landing during the agreement counts at the next step, on every rank.
                agreed = D.agree_on_signal(self.stop_signal, self.info)
                if agreed is not None:
                    reason = flush(lr, time.perf_counter(), {}) if pending else None
                    if reason:
                        status = "diverged"
                        break
                    self.stop_signal = agreed
                    status = "interrupted"
                    reason = f"signal {signal.Signals(self.stop_signal).name} at step {self.step}"
                    if not self.save():
                        status, reason = "diverged", self.nonfinite_reason
                    break
                # no checkpoint inside a run of skipped (non-finite) steps, but for the last one
                if save_due and (self.divergence.skips == 0 or self.step == self.total_steps):
                    if not self.save():  # non-finite weights: last.pt and the ring keep the last finite
                        status, reason = "diverged", self.nonfinite_reason
                        break
                    self.save_ring()
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
        if status == "completed" and not last_vals and resumed is not None and resumed >= self.total_steps:
            last_vals = self.evaluate()  # the final evaluation a run ended during its last step may lack
            if math.isnan(_last_logged(self.run_dir / "metrics.jsonl", next(iter(last_vals)), self.step)):
                m.log(self.step, last_vals)  # once: a signal after the evaluation has logged it already
            if math.isnan(train_loss):
                train_loss = _last_logged(self.run_dir / "metrics.jsonl", N.LOSS, self.step)
        summary = {
            "status": status,
            "step": self.step,
            "total_steps": self.total_steps,
            "reason": reason,
            "final": {"loss": train_loss, **last_vals},
            "params": nparams,
        }
        if status == "diverged":
            summary["diverged_at"] = self.diverged_at or self.step  # may precede the step it was seen at
        if status == "interrupted":
            summary["signal"] = int(self.stop_signal)
        if self.divergence.action == "rollback":
            summary["rollbacks"] = self.rollbacks
        if self.monitor is not None:
            summary.update(self.monitor.summary(status))
        if main:
            write_json(self.run_dir / "summary.json", summary)
            m.message(f"{status} at step {self.step}" + (f": {reason}" if reason else "")
                      + "".join(f" | {k} {v:.4g}" for k, v in last_vals.items()))
        m.close()
        return summary


# Dense bf16 peak FLOP/s by device name (the vendors' datasheets, no sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12,
             "4090": 165e12, "3090": 71e12}


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named like ``NVIDIA H100 80GB HBM3``; None if unknown."""
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


def _si(x: float) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"
