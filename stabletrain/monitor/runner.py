"""Monitors wired to the trainer: weight-side every ``weight_every`` steps, the probe pass
every ``probe_every`` steps, health alerts, and crash forensics for ``summary.json``.

Monitors change nothing in training: they read weights under ``no_grad``, take gradients of
the probe loss with ``torch.autograd.grad`` (never ``.grad``), run the probe in eval mode (no
dropout), and restore the RNG state afterwards. They compute and log on rank 0 only. Under
DDP the other ranks do nothing; under FSDP2 (``parallel=fsdp``) every rank takes part in
each pass, because reading a weight and running a forward need every rank's shards: the
weight pass gathers one chunk of blocks at a time (:func:`quantities.block_chunks`), the probe
forward and backward run on every rank with the same probe batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stabletrain.layers.reparam import raw_weight
from stabletrain.losses.zloss import log_z
from stabletrain.models.registry import transformer_blocks
from stabletrain.monitor import names as N
from stabletrain.monitor.alerts import HealthWatch, _BlockState, first_nonfinite, growth_summary
from stabletrain.monitor.quantities import (block_chunks, block_probe_values, bound_bytes, bound_heads,
                                            entropy_lower_bounds, model_weight_metrics, readable_block, runs_under,
                                            to_floats)

HISTORY = 64  # weight snapshots kept for forensics
REMEDIES = "a learning-rate warmup, optim=adamw2, reparam=sigma or attention=qknorm"


def _qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W_q, W_k, W_v rows of the fused projection (effective weights under sigmaReparam)."""
    return attn.qkv.weight.detach().float().chunk(3, 0)


@dataclass(frozen=True)
class Sharding:
    """What the runner needs of an FSDP2-sharded model (build.py gives engine/sharding.py's; monitor/
    imports no engine/): ``gathered(modules)``, a context in which their parameters are whole, entered
    by every rank alike; ``local(t)``, this rank's shard of a parameter; ``all_ranks(flag)``, a rank's
    boolean verdict AND-ed over the ranks."""

    gathered: Callable
    local: Callable
    all_ranks: Callable


class MonitorRunner:
    """The monitors of one model.

    ``probe_batch`` is a held-out ``(x, y)``; ``autocast`` the context the model trains under;
    ``with_bound``: log the sigmaReparam paper's Theorem 3.1 entropy bound where it holds, which
    each block's attention says (``entropy_bound_applies``: logits
    ``x W_q^h^T W_k^h x^T / sqrt(d_h)`` of raw q, k; normalised q/k change the logits it bounds).
    ``active`` is false on ranks > 0, where nothing is computed or logged; with ``sharding`` (an
    FSDP2-sharded model) those ranks still run each pass's gathers and forward.
    Messages and records go to ``sink`` (``message(text)``, ``log(step, values)``), given with
    :meth:`attach` once the run's metrics sink is open.
    """

    def __init__(self, model: nn.Module, cfg, probe_batch: tuple[torch.Tensor, torch.Tensor], *,
                 device: torch.device, autocast=contextlib.nullcontext, with_bound: bool = True,
                 active: bool = True, sharding: Sharding | None = None):
        for key in ("weight_every", "probe_every"):  # train.py's config check says the same
            if getattr(cfg, key) < 1:
                raise ValueError(f"MonitorRunner: monitor.{key}={getattr(cfg, key)} must be >= 1")
        self.model, self.cfg, self.device, self.autocast = model, cfg, torch.device(device), autocast
        # read once: after_step runs every step, and an OmegaConf read costs dozens of Python calls
        self.weight_every, self.probe_every = int(cfg.weight_every), int(cfg.probe_every)
        self.active, self.with_bound = active, with_bound
        self.sharding = sharding
        self.sharded = sharding is not None  # every rank takes part in the passes
        # the probe reads blocks whose attention is stabletrain's (it captures the probabilities);
        # the weight pass any block of timm's layout (fused qkv, proj, fc1, fc2): a timm ViT of one's
        # own gets its sigma1 and SEC, not its entropy (:meth:`coverage`)
        found = transformer_blocks(model)
        self.blocks = [(n, b) for n, b in found if hasattr(b.attn, "probe")]
        self.weight_blocks = [(n, b) for n, b in found if hasattr(b.attn, "probe") or readable_block(b)]
        self.found = len(found)
        self.watch = HealthWatch.from_config(self.cfg)
        self.warm: dict = {}  # power-iteration vectors between weight passes (model_weight_metrics)
        self.history: list[dict] = []
        self.weight_step: int | None = None  # of the last weight pass, on every rank
        self.alerts: list[dict] = []
        self.stop_reason: str | None = None
        self.stop_onset: int | None = None
        self.probe_batch = probe_batch
        self.sink = None

    def coverage(self) -> str | None:
        """What the monitors cannot read of this model, for the start of the run; None: every block."""
        if not self.found:
            return ("monitor: the model has no transformer blocks (modules with norm1, attn and mlp), so only "
                    "its output's logits/log_z is monitored")
        probed, weighed, others = len(self.blocks), len(self.weight_blocks), self.found - len(self.blocks)
        if others:
            line = (f"monitor: {others} of {self.found} blocks have an attention that is not stabletrain's "
                    f"(stabletrain/layers/attention.py): the probe pass (attention entropy, token similarity, the "
                    f"alerts) skips them")
            if weighed == self.found:
                return line + "; the weight pass (sigma1, SEC) reads them"
            if weighed > probed:
                return line + (f"; the weight pass (sigma1, SEC) reads {weighed - probed} of them, those with "
                               f"timm's layout (attn.qkv fused, attn.proj, mlp.fc1, mlp.fc2)")
            return line + ", and so does the weight pass (no fused attn.qkv, attn.proj, mlp.fc1, mlp.fc2 to read)"
        return None

    def reads(self) -> tuple[str, ...]:
        """What the passes read of this model: ``weight`` (sigma1, SEC: blocks of timm's layout),
        ``entropy`` (the probe pass's attention entropy: stabletrain's attention), and the output's
        log Z, which every probe pass reads."""
        return ("weight",) * bool(self.weight_blocks) + ("entropy",) * bool(self.blocks) + ("log_z",)

    def attach(self, sink) -> None:
        self.sink = sink

    def _probe_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.probe_batch
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    @contextlib.contextmanager
    def _isolated(self):
        """No RNG draw, no autocast surprise, and the model's mode restored afterwards."""
        dev = [self.device] if self.device.type == "cuda" else []
        was_training = self.model.training
        with torch.random.fork_rng(devices=dev):
            try:
                yield
            finally:
                self.model.train(was_training)

    # --- cadence --------------------------------------------------------------------

    def after_step(self, step: int, last: bool = False) -> None:
        """The passes due after optimizer step ``step`` (0-based; -1 is the initial snapshot).
        ``last``: the run's final step, where both passes run whatever the cadence, so a run
        shorter than ``probe_every`` still ends with a probe."""
        done = step + 1
        weight_due = done % self.weight_every == 0 or last
        probe_due = done % self.probe_every == 0 or last
        if not ((self.active or self.sharded) and (weight_due or probe_due)):
            return  # most steps: nothing to do, and nothing to set up
        if self.active and self.sink is None:
            raise RuntimeError("MonitorRunner: call attach(sink) before after_step; sink has message(text) "
                               "and log(step, values)")
        rec: dict[str, float] = {}
        with self._isolated():
            if weight_due:
                self.weight_step = done
                rec.update(self.weight_metrics())
                if self.active:
                    self.history = (self.history + [{"step": done, **rec}])[-HISTORY:]
            if probe_due:
                rec.update(self.probe_metrics())
        if not (rec and self.active):
            return
        for alert in self.watch.update(done, rec) if self.cfg.alerts else []:
            self.alerts.append(alert)
            rec[f"alert/{alert['layer']}"] = 1.0
            # the console says what to try; summary.json keeps the finding alone
            self.sink.message("WARNING " + alert["message"] + f" (what the papers do against it: {REMEDIES})")
            if self.cfg.stop_on_alert and self.stop_reason is None:
                self.stop_reason = f"entropy collapse at {alert['layer']} (step {done})"
                self.stop_onset = alert.get("onset")  # where a rollback must go back before
        self.sink.log(done, rec)

    # --- the two sides --------------------------------------------------------------

    @torch.no_grad()
    def weight_metrics(self) -> dict[str, float]:
        """All blocks in one batched pass with one device-to-host copy (quantities.stacked_weight_metrics);
        a block with non-finite weights reports ``sigma1/<block>/nonfinite_weights = 1.0`` only.

        Sharded: the chunks that pass stacks anyway, each gathered whole on every rank in turn
        and computed on rank 0, so the values are the unsharded ones and the extra memory is one
        chunk's weights (less than ``STACK_BUDGET_BYTES``, or one block), not the model's.
        Returns {} on other ranks."""
        if not self.sharded:
            return model_weight_metrics(self.weight_blocks, per_head=self.cfg.per_head, warm=self.warm)
        out: dict[str, float] = {}
        for chunk in block_chunks(self.weight_blocks):
            with self.sharding.gathered([blk for _, blk in chunk]):
                if self.active:
                    out.update(model_weight_metrics(chunk, per_head=self.cfg.per_head, warm=self.warm))
        return out

    def probe_metrics(self) -> dict[str, float]:
        model = self.model
        model.eval()
        inputs: dict[str, torch.Tensor] = {}
        hooks = []
        for name, blk in self.blocks:
            blk.attn.probe = {}
            hooks.append(blk.register_forward_pre_hook(
                lambda _m, args, name=name: inputs.__setitem__(name, args[0])))
        x, y = self._probe_inputs()
        try:
            if not self._weights_finite():
                return {}
            with torch.enable_grad():
                logits = self._probe_logits(model, x)
                loss = self._loss_of(logits, y)
                names = list(inputs)
                grads = torch.autograd.grad(loss, [inputs[n] for n in names], allow_unused=True) if names else ()
            # logits/log_z: mean over positions (GPT tokens, images) of logsumexp of the output logits
            out: dict[str, torch.Tensor | float] = {N.LOG_Z: log_z(logits.detach()).mean()}
            grad_of = dict(zip(names, grads))
            # Theorem 3.1's bound where it applies, the blocks' norms batched in runs under a memory
            # budget (W_q, W_k gathered on every rank alike: the probe batch, so the runs, are the same)
            bounded = [(name, blk) for name, blk in self.blocks if self.with_bound and blk.attn.entropy_bound_applies
                       and not (blk.attn.probe or {}).get("logit_bias")]  # a float mask's values move the logits
            sizes = [bound_bytes(_shape(blk.attn.probe.get("x")), raw_weight(blk.attn.qkv).shape,
                                 blk.attn.qkv.bias is not None) for _, blk in bounded]
            bounds: dict[str, torch.Tensor] = {}
            for run in runs_under(sizes):
                part = [bounded[i] for i in run]
                heads = [bound_heads(*self._qk_weights(blk), blk.attn.num_heads) for _, blk in part]
                if self.active:
                    ready = [(name, blk, h) for (name, blk), h in zip(part, heads)
                             if blk.attn.probe.get("probs") is not None and blk.attn.probe.get("x") is not None]
                    bounds.update(zip([name for name, _, _ in ready], entropy_lower_bounds(
                        [(wq, wk, blk.attn.probe["x"], _is_causal(blk), bq, blk.attn.probe.get("key_mask"))
                         for _, blk, (wq, wk, bq) in ready])))
            if not self.active:
                return {}
            for name, blk in self.blocks:
                cap = blk.attn.probe or {}
                xin, g = inputs.get(name), grad_of.get(name)
                out.update(block_probe_values(
                    name, probs=cap.get("probs"), bound=bounds.get(name), block_input=_tokens(xin),
                    block_input_grad=_tokens(g), mask=cap.get("key_mask"), causal=_is_causal(blk),
                    per_head=self.cfg.per_head, logit_max=cap.get("logit_max")))
            return to_floats(out)  # the pass's one read: the device runs while the host queues the blocks
        finally:
            for h in hooks:
                h.remove()
            for _, blk in self.blocks:
                blk.attn.probe = None

    def _weights_finite(self) -> bool:
        """Whether every weight is finite; sharded, each rank checks its shards and all agree."""
        params = list(self.model.parameters())
        local = self.sharding.local if self.sharded else (lambda p: p)
        verdict = torch.stack([torch.isfinite(local(p)).all() for p in params]).all()  # one sync, not one per tensor
        return self.sharding.all_ranks(verdict) if self.sharded else bool(verdict)

    def _qk_weights(self, blk: nn.Module) -> tuple[torch.Tensor | None, ...]:
        """W_q, W_k of ``blk`` (effective) and b_q (None without a bias); sharded, gathered on
        every rank."""
        with self.sharding.gathered([blk.attn.qkv]) if self.sharded else contextlib.nullcontext():
            bias = blk.attn.qkv.bias
            return (*_qkv(blk.attn)[:2], None if bias is None else bias.detach().float().chunk(3, 0)[0])

    def _probe_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The sum over the probe samples of each one's own loss, so that ``dL/dx_i`` is sample
        ``i``'s gradient (docs/methods.md §7: per sample, then the mean over the batch). It is the
        held-out loss on hard labels, whatever the training criterion (mixup's soft targets,
        label smoothing): the probe batch comes from the validation split."""
        return self._loss_of(self._probe_logits(model, x), y)

    def _probe_logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's output logits on the probe batch, in fp32."""
        with self.autocast():
            return model(x).float()

    @staticmethod
    def _loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if out.dim() == 3:  # (B, T, vocab): a sample's loss is the mean over its tokens
            return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum") / y.shape[1]
        return F.cross_entropy(out, y, reduction="sum")

    # --- results --------------------------------------------------------------------

    def summary(self, status: str, step: int | None = None) -> dict:
        """``step``: the step the run stopped at. A diverged run whose weights are still finite there
        (its last steps were skipped, or it stopped on a spike or an alert between weight passes) gets
        one more weight pass at that step, so that the forensics describe the weights it ended with,
        not the last scheduled pass, which may be step 0."""
        out: dict = {"alerts": self.alerts}
        if status == "diverged" and (self.active or self.sharded):
            forensics: dict = {}
            # decided alike on every rank (a sharded pass is collective): rank 0 alone keeps the history
            if step is not None and self.weight_step != step and self._weights_finite():
                with self._isolated():
                    rec = self.weight_metrics()
                if self.active and rec:
                    self.history = (self.history + [{"step": step, **rec}])[-HISTORY:]
            finite = [h for h in self.history if not any(k.endswith("/nonfinite_weights") for k in h)]
            if finite:
                forensics["last_finite_snapshot"] = finite[-1]
                growth = growth_summary(self.history)
                if growth:
                    forensics["growth"] = growth
            x, y = self._probe_inputs()
            with self._isolated(), torch.no_grad():  # sharded: a forward on every rank
                self.model.eval()
                bad = first_nonfinite(self.model, lambda m: self._probe_loss(m, x, y))
            if bad:
                forensics["first_nonfinite"] = f"first non-finite: {bad}"
            out["forensics"] = forensics
        return out

    def state_dict(self) -> dict:
        """Alerts, the alert watch, the snapshots kept for forensics and the power-iteration
        vectors the next weight pass starts from, so a resumed run logs what the whole run would."""
        return {"alerts": self.alerts,
                "watch": {b: asdict(s) for b, s in self.watch.blocks.items()},
                "history": self.history,
                "warm": [(key, [t.detach().cpu() for t in vecs]) for key, vecs in self.warm.items()
                         if vecs is not None]}

    def load_state_dict(self, state: dict) -> None:
        self.alerts = list(state.get("alerts", []))
        self.watch.blocks = {b: _BlockState.restore(s) for b, s in state.get("watch", {}).items()}
        self.history = list(state.get("history", []))
        dev = self.device
        self.warm = {(key if isinstance(key, str) else tuple(key)): tuple(t.to(dev) for t in vecs)
                     for key, vecs in state.get("warm", [])}


def _tokens(v: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T, d) from a block input; Swin's (B, H, W, C) maps become token lists."""
    return None if v is None else v.detach().float().reshape(v.shape[0], -1, v.shape[-1])


def _shape(v: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if v is None else tuple(v.shape)


def _is_causal(blk: nn.Module) -> bool:
    """Whether the probe's forward attended causally (the call's ``is_causal`` or the layer's own)."""
    return bool((blk.attn.probe or {}).get("causal", getattr(blk.attn, "causal", False)))
