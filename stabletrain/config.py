"""The typed schema of every config key (Hydra structured configs).

``configs/train.yaml`` starts from ``train_schema`` (registered below), so every group's yaml
merges onto a typed node: a misspelt key, a wrong type or a value outside an enum fails at
composition. Range checks that a type cannot express (a negative lr, alpha outside [0, 0.5])
live in :func:`validate`, which raises :class:`ConfigError` with one line naming the key and
the fix. Option names follow docs/methods.md; each decision there is a documented field here.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from stabletrain.errors import ConfigError


# --- enums: allowed values of the choice-like keys -------------------------------------


class Placement(str, Enum):
    pre = "pre"
    post = "post"


class EpsMode(str, Enum):
    sqrt = "sqrt"  # x / sqrt(||x||^2 + eps), the StableNorm text (004)
    add = "add"  # x / (||x|| + eps), the StableNorm demo (004)


class ApplyTo(str, Enum):
    all = "all"  # every linear layer and the patch embedding
    qk = "qk"  # query/key projections only


class GammaInit(str, Enum):
    one = "one"
    svd = "svd"


class QKVSplit(str, Enum):
    joint = "joint"
    qk_v = "qk_v"
    q_k_v = "q_k_v"


class QKVInit(str, Enum):
    slices = "slices"
    matrix = "matrix"


class DeescPlacement(str, Enum):
    block = "block"  # end of each block, after its second norm (002)
    ffn = "ffn"  # at each FFN input (002)


class Unit(str, Enum):
    steps = "steps"
    epochs = "epochs"


class MonitorName(str, Enum):
    standard = "standard"
    full = "full"
    off = "off"


class Precision(str, Enum):
    auto = "auto"  # bf16 autocast on CUDA, fp32 on CPU
    bf16 = "bf16"
    fp32 = "fp32"


class WandbMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


# --- groups ----------------------------------------------------------------------------


@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = MISSING  # vit | swin | gpt: a builder registered in stabletrain.models
    # vit / swin
    img_size: int = 224
    in_chans: int = 3  # vision data sets set this (and num_classes) from their images
    patch_size: int = 16
    num_classes: int = 1000  # vision data sets override this with their class count
    drop_path: float = 0.0
    qkv_bias: bool = True
    class_token: bool = True
    act: str = "gelu"  # gelu | gelu_tanh (GPT-2's own) | relu (the de-escalation CIFAR ViT uses ReLU, 002)
    init_std: float = 0.02  # ViT family init: trunc_normal std of Linear weights (timm's 0.02)
    patch_embed_std: Optional[float] = None  # ViT: trunc_normal std of the patch conv; None = torch's
    # vit / gpt
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    mlp_hidden: Optional[int] = None  # overrides mlp_ratio (e.g. the deep CIFAR ViT's 384)
    # swin
    depths: list[int] = field(default_factory=lambda: [2, 2, 6, 2])
    stage_heads: list[int] = field(default_factory=lambda: [3, 6, 12, 24])
    window_size: int = 7
    # gpt
    vocab_size: int = 50304
    block_size: int = 1024
    bias: bool = False  # nanoGPT: no biases in LayerNorm and Linear
    dropout: float = 0.0
    # a family registered outside stabletrain (``imports``): its own arguments, as timm's train.py
    # --model-kwargs; stabletrain's families take theirs as the keys above
    kwargs: dict[str, Any] = field(default_factory=dict)



# The model.* keys each built-in family reads (its registration's keys=), kept beside the schema so
# that what reads a run's directory without torch (the sweep table, compare.png's labels) knows them
FAMILY_KEYS = {
    "gpt": ("vocab_size", "block_size", "bias", "dropout", "embed_dim", "depth", "num_heads", "mlp_ratio",
            "mlp_hidden", "act"),
    "vit": ("img_size", "in_chans", "patch_size", "num_classes", "drop_path", "qkv_bias", "class_token", "act",
            "init_std", "patch_embed_std", "embed_dim", "depth", "num_heads", "mlp_ratio", "mlp_hidden"),
    "swin": ("img_size", "in_chans", "patch_size", "num_classes", "drop_path", "qkv_bias", "act", "embed_dim",
             "depths", "stage_heads", "window_size", "mlp_ratio"),
}

@dataclass
class NormConfig:
    name: str = "layernorm"  # a norm registered in stabletrain.layers.norm
    placement: Placement = Placement.pre
    alpha: float = 0.5  # StableNorm exponent in [0, 0.5]; 0.5 is RMSNorm (004 Eq. 2)
    eps: Optional[float] = None  # None: 1e-5 (eps_mode sqrt, and rmsnorm), 1e-8 (eps_mode add, the demo)
    eps_mode: EpsMode = EpsMode.sqrt
    kwargs: dict[str, Any] = field(default_factory=dict)  # a norm of your own (imports): its arguments


@dataclass
class AttentionConfig:
    name: str = "softmax"  # registered in stabletrain.layers.attention
    c: float = 1.618  # StableAtten tau = c * log2(N) (004 Eq. 3)
    seq_len: Optional[int] = None  # N; None = the model's sequence length (tokens incl. cls)
    alpha: Optional[float] = None  # StableAtten q/k norm exponent; None = norm.alpha
    eps: Optional[float] = None  # q/k norms; None: the default of norm.eps_mode (1e-5 sqrt, 1e-8 add)
    kwargs: dict[str, Any] = field(default_factory=dict)  # an attention variant of your own: its arguments


@dataclass
class ReparamConfig:
    name: str = "none"  # registered in stabletrain.layers.reparam
    apply_to: ApplyTo = ApplyTo.all  # every linear layer, or the query/key rows only (reparam=sigma_qk)
    gamma_init: GammaInit = GammaInit.one  # svd: the vision recipe; diverged outside vision (001)
    power_iters: int = 1
    qkv_split: QKVSplit = QKVSplit.joint
    gamma_lr_mult: float = 1.0
    attn_fp32: bool = False  # attention logits and softmax in fp32 (001)
    kwargs: dict[str, Any] = field(default_factory=dict)  # a reparametrisation of your own: its arguments


@dataclass
class InitConfig:
    name: str = "family"  # registered in stabletrain.layers.init
    gain: float = 1.0  # StableInit: E[sigma_max(W)] <= gain (004 Eq. 1)
    fused_qkv: QKVInit = QKVInit.slices  # a fused qkv as three d x d slices, or as one 3d x d matrix (the demo)
    kwargs: dict[str, Any] = field(default_factory=dict)  # an init of your own: its arguments


@dataclass
class DeescConfig:
    name: str = "none"  # none | deescalate: registered in stabletrain.layers.deescalate
    placement: DeescPlacement = DeescPlacement.block
    lambda_: float = 1.0  # 0 none, 1 complete (002 Eq. 21); 1.0 is our guess, see docs/methods.md
    learnable: bool = False
    causal: Optional[bool] = None  # None = the model's own (prefix mean for GPT)
    kwargs: dict[str, Any] = field(default_factory=dict)  # a de-escalation of your own: its arguments


@dataclass
class Components:
    """What a model family asks for by name: its norm, attention, reparametrisation, init and
    de-escalation (the model builders get this, never the training config)."""

    norm: NormConfig = field(default_factory=NormConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    reparam: ReparamConfig = field(default_factory=ReparamConfig)
    init: InitConfig = field(default_factory=InitConfig)
    deescalate: DeescConfig = field(default_factory=DeescConfig)

    @classmethod
    def of(cls, cfg: Any) -> "Components":
        """The components of a composed training config."""
        return cls(cfg.norm, cfg.attention, cfg.reparam, cfg.init, cfg.deescalate)


@dataclass
class OptimConfig:
    name: str = "adamw2"  # registered in stabletrain.optim
    lr: float = 1e-3
    weight_decay: float = 0.05
    weight_decay_end: Optional[float] = None  # None: constant; else a half cosine to it over the run
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    # adamw2 (docs/methods.md §1)
    tau: Optional[float] = None  # None: the model family's (000 Table 2: 0.004 ViT and Swin, 0.01 GPT)
    eps_inside_sqrt: bool = False
    power_iters: int = 3
    warm_start: bool = True
    overlap_sigma_w: bool = False  # iterate sigma1(W_{t-1}) on a side CUDA stream during step t (same numbers)
    bound_norm_gains: bool = True  # trainer grouping: bound matrices and norm gains
    # sgd / lars
    momentum: float = 0.9
    nesterov: bool = False
    trust_coef: float = 0.001
    lr_scale_by_batch: bool = False  # lr * batch_size / 256
    fused: Optional[bool] = None  # torch AdamW fused kernel; None = fused on CUDA and CPU
    kwargs: dict[str, Any] = field(default_factory=dict)  # an optimizer of your own: its arguments


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # registered in stabletrain.optim.schedule
    unit: Unit = Unit.steps  # unit of warmup, milestones and epochs-based horizons
    min_lr: float = 0.0
    milestones: list[float] = field(default_factory=list)
    gamma: float = 0.1
    horizon: Optional[float] = None  # cosine length (in unit) if it differs from the run's
    kwargs: dict[str, Any] = field(default_factory=dict)  # a schedule of your own: its arguments


@dataclass
class DataConfig:
    name: str = "auto"  # auto (digits for vision, pytext for GPT) or one registered in stabletrain.data
    root: Optional[str] = None  # imagefolder: train/ and val/ class folders; cifar10/100: their python folder's parent
    path: Optional[str] = None  # tokens: a train .bin; val.bin and (optional) meta.json beside it
    img_size: Optional[int] = None  # None = the model's
    num_workers: int = 0
    val_fraction: float = 0.2  # embedded data's validation share: digits' (drawn at random); pytext's last half of it
    tokenizer: str = "byte"  # pytext: byte | gpt2 (tiktoken, cached files offline); tokens: unused (meta.json)
    # vision augmentation (timm)
    randaug: Optional[str] = None  # e.g. rand-m9-mstd0.5-inc1
    mixup: float = 0.0
    cutmix: float = 0.0
    label_smoothing: float = 0.0
    erasing: float = 0.0
    repeated_aug: int = 1  # each sample this many times per batch, augmented separately


@dataclass
class MonitorConfig:
    name: MonitorName = MonitorName.standard
    weight_every: int = 100  # weight-side quantities cadence (steps); ~1% of step time on ViT-B
    adamw2_every: int = 50  # AdamW² per-tensor actual-lr curves (App. M plots one point per 50 steps)
    probe_every: int = 200  # activation-side quantities on the probe batch (steps)
    probe_batch_size: int = 8
    per_head: bool = False  # log every head, not only max/mean
    alerts: bool = True
    stop_on_alert: bool = False  # sweeps: end an entropy-collapsed run as diverged
    rollback_on_alert: bool = False  # with stop_on_alert and divergence.action=rollback: roll back instead
    entropy_floor: float = 0.1  # nats; entropy below this with growing sigma1(QK) alerts
    qk_growth: float = 10.0  # sigma1(W_q^T W_k) growth factor within qk_window steps that alerts
    qk_window: int = 1000  # steps over which that growth is measured


@dataclass
class LoggerConfig:
    wandb: WandbMode = WandbMode.offline
    project: str = "stabletrain"
    entity: Optional[str] = None
    log_every: int = 10
    progress: bool = True


@dataclass
class EmaConfig:
    decay: Optional[float] = None  # EMA of the weights, evaluated as val_ema/*; null = off
    every: int = 1  # average every k-th step with decay**k (same horizon, 1/k of the cost)
    warmup: bool = False  # timm's decay warmup, 1 - (1 + n)^(-2/3) capped at decay


@dataclass
class DivergenceConfig:
    enabled: bool = True
    spike_factor: float = 4.0  # loss above spike_factor x its running mean ...
    window: int = 20  # ... for this many consecutive steps ends the run as diverged
    warmup_steps: int = 20  # running mean needs this many steps before spikes count
    ema: float = 0.98
    # Surviving a spike (README "Surviving a spike", docs/architecture.md):
    skip_nonfinite: bool = True  # a step whose gradients are non-finite changes no weight nor optimizer state
    max_skips: int = 10  # this many consecutive skipped steps count as a divergence
    action: str = "stop"  # stop | rollback: on a divergence, restore the newest ring checkpoint before it
    skip_window: int = 1  # a rollback skips at least this many steps of data (else: checkpoint..trigger)
    max_rollbacks: int = 3  # per run; one more divergence ends the run as diverged
    lr_scale_on_rollback: float = 1.0  # the lr is multiplied by this at each rollback (compounding)


@dataclass
class CkptConfig:
    keep: int = 3  # ring of checkpoints/step_NNNNNN.pt besides last.pt, written every ckpt_every steps


@dataclass
class DebugConfig:
    """Fault injection for tests and demos (steps are 1-based, like ``diverged_at``). The fault
    belongs to the batch of step K (stream position K - 1): a rollback that skips it skips the fault."""

    nan_at_step: Optional[int] = None  # the loss of this step is multiplied by NaN before backward (every rank)
    spike_at_step: Optional[int] = None  # the loss of this step is multiplied by spike_factor before backward
    spike_factor: float = 1e4


@dataclass
class TrainConfig:
    # the user's own modules (.py paths or module names), imported before the config is checked so
    # that the options they register (a model family, a norm, a loss term...) can be chosen
    imports: list[str] = field(default_factory=list)
    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    norm: NormConfig = field(default_factory=NormConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    reparam: ReparamConfig = field(default_factory=ReparamConfig)
    init: InitConfig = field(default_factory=InitConfig)
    deescalate: DeescConfig = field(default_factory=DeescConfig)
    # extra loss terms by name -> their parameters (``regularizer=[locater,zloss]``), each checked
    # against the parameters its term registers in stabletrain.losses
    regularizer: dict[str, Any] = field(default_factory=dict)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    steps: Optional[int] = None  # optimizer steps; overrides epochs when set
    epochs: Optional[float] = None
    warmup: float = 0.0  # in schedule.unit
    seed: int = 0
    resume: Optional[str] = None  # auto | a checkpoint path
    # a run's directory or checkpoint, or a saved state dict, whose weights start this run at step 0
    # (a fine-tune, a branch); the optimizer state, schedule and step count start afresh
    init_weights: Optional[str] = None
    # resume=auto refuses overrides that change the resumed run (its model, optim, data, seed...);
    # true continues with them anyway (cadences, steps, logger and device may always change)
    resume_allow_changes: bool = False
    batch_size: int = 64  # global, per optimizer step
    micro_batch_size: Optional[int] = None  # per device; None = batch_size / world size
    grad_clip: Optional[float] = None
    eval_every: int = 100
    eval_batches: int = 20
    ckpt_every: int = 500
    precision: Precision = Precision.auto
    compile: Optional[bool] = None  # null: on for a CUDA GPU (where triton is), off on a CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # ddp: every rank holds the whole model and optimizer state (DistributedDataParallel);
    # fsdp: FSDP2 fully_shard per transformer block and the root, parameters, gradients and
    # optimizer state split on dim 0 across the ranks (torchrun/srun only; docs/distributed.md)
    parallel: str = "ddp"
    # recompute each transformer block's activations in the backward pass instead of keeping
    # them (torch.utils.checkpoint, use_reentrant=False): less memory, ~one more forward of compute;
    # same numbers (dropout/drop path masks are replayed from the saved RNG state)
    activation_checkpointing: bool = False
    name: str = "run"
    dist_timeout: float = 900.0  # seconds a collective waits for the other ranks before the job ends
    dry_run: bool = False  # build model, optimizer and data, print the parameter table, train nothing


def _required(key: str):
    raise ConfigError(f"{key} is required by this recipe (the paper does not give it): set {key}=VALUE")


def _rank_zero_only(value: Any, others: Any = None) -> Any:
    """``value`` in rank 0 of a distributed job (or a plain process), ``others`` in the rest."""
    from stabletrain.topology import detect

    return value if detect().rank == 0 else others


def _register_resolvers() -> None:
    """``${required:KEY}`` and ``${rank_zero_only:VALUE}``.

    A recipe marks a value the papers leave open as ``${required:optim.lr}``: resolving it
    without a command-line value fails with one line naming the key. (A ``???`` cannot do
    this in a group file: merging it over an existing value keeps the old value.)
    ``hydra.output_subdir: ${rank_zero_only:.hydra}`` lets only rank 0 of a multi-task
    submitit job write ``.hydra/``, and the job log's file handler at level
    ``${rank_zero_only:0,100}`` (above CRITICAL) lets only rank 0 write ``<job>.log``. Hydra
    resolves them inside each task, which imports this module when it unpickles the task
    function, so the resolvers are registered on import.
    """
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("required", _required, replace=True)
    OmegaConf.register_new_resolver("rank_zero_only", _rank_zero_only, replace=True)


def register() -> None:
    """The schema for ``configs/train.yaml`` (and the resolvers)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    _register_resolvers()


_register_resolvers()


# --- validation ------------------------------------------------------------------------


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg: Any) -> None:
    """Range checks on a composed config; raises ConfigError with one line.

    The checks that need to know the options (names, what a model family or data set allows)
    are :func:`stabletrain.build.validate`'s, which runs these too."""
    _check_finite(cfg)
    o, m = cfg.optim, cfg.model
    _need(o.lr > 0, f"optim.lr={o.lr} must be > 0 (e.g. optim.lr=1e-3)")
    _need(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
    _need(o.weight_decay_end is None or o.weight_decay_end >= 0,
          f"optim.weight_decay_end={o.weight_decay_end} must be >= 0 or null")
    _need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
          f"optim.betas={list(o.betas)} must be two values in [0, 1)")
    _need(o.eps > 0, f"optim.eps={o.eps} must be > 0")
    _need(o.tau is None or o.tau > 0,
          f"optim.tau={o.tau} must be > 0, or null for the model family's (the AdamW² paper: 0.004 ViT, 0.01 GPT)")
    _need(o.power_iters >= 1, f"optim.power_iters={o.power_iters} must be >= 1")
    _need(o.warm_start or not o.overlap_sigma_w,
          "optim.overlap_sigma_w=true needs optim.warm_start=true (or set overlap_sigma_w=false)")
    _need(0 <= cfg.norm.alpha <= 0.5, f"norm.alpha={cfg.norm.alpha} must be in [0, 0.5] (0.5 is RMSNorm)")
    a = cfg.attention.alpha
    _need(a is None or 0 <= a <= 0.5, f"attention.alpha={a} must be in [0, 0.5] or null")
    _need(cfg.norm.eps is None or cfg.norm.eps > 0, f"norm.eps={cfg.norm.eps} must be > 0 or null")
    _need(cfg.attention.c > 0, f"attention.c={cfg.attention.c} must be > 0")
    _need(cfg.attention.eps is None or cfg.attention.eps > 0,
          f"attention.eps={cfg.attention.eps} must be > 0 or null")
    n = cfg.attention.seq_len
    _need(n is None or n >= 2, f"attention.seq_len={n} must be >= 2, or null for the model's own")
    _need(cfg.init.gain > 0, f"init.gain={cfg.init.gain} must be > 0")
    _need(cfg.reparam.gamma_lr_mult >= 0, f"reparam.gamma_lr_mult={cfg.reparam.gamma_lr_mult} must be >= 0")
    _need(cfg.deescalate.learnable or 0 <= cfg.deescalate.lambda_ <= 1,  # a parameter starts anywhere (methods.md)
          f"deescalate.lambda_={cfg.deescalate.lambda_} must be in [0, 1] (0 none, 1 complete), or set "
          "deescalate.learnable=true to start a learned one outside it")
    _need(cfg.reparam.power_iters >= 1, f"reparam.power_iters={cfg.reparam.power_iters} must be >= 1")
    _need(cfg.steps is None or cfg.steps > 0, f"steps={cfg.steps} must be > 0")
    _need(cfg.epochs is None or cfg.epochs > 0, f"epochs={cfg.epochs} must be > 0")
    _need(cfg.steps is not None or cfg.epochs is not None, "set steps=N or epochs=E")
    _need(cfg.warmup >= 0, f"warmup={cfg.warmup} must be >= 0 (0 disables it)")
    _need(cfg.batch_size > 0, f"batch_size={cfg.batch_size} must be > 0")
    mb = cfg.micro_batch_size
    if mb is not None and mb > 0 and cfg.batch_size % mb:
        divisors = [d for d in range(1, cfg.batch_size + 1) if cfg.batch_size % d == 0]
        near = sorted(divisors, key=lambda d: abs(d - mb))[:2]
        raise ConfigError(f"micro_batch_size={mb} must divide batch_size={cfg.batch_size}: "
                          f"e.g. micro_batch_size={' or '.join(map(str, sorted(near)))}")
    _need(mb is None or mb > 0, f"micro_batch_size={mb} must be > 0 or null")
    _need(cfg.grad_clip is None or cfg.grad_clip > 0, f"grad_clip={cfg.grad_clip} must be > 0 or null")
    e = cfg.ema
    _need(e.decay is None or 0 < e.decay < 1, f"ema.decay={e.decay} must be in (0, 1), e.g. 0.9999, or null (off)")
    _need(e.every >= 1, f"ema.every={e.every} must be >= 1")
    mon = cfg.monitor
    for key in ("weight_every", "probe_every", "adamw2_every", "probe_batch_size", "qk_window"):
        _need(getattr(mon, key) >= 1, f"monitor.{key}={getattr(mon, key)} must be >= 1")
    _need(mon.entropy_floor >= 0, f"monitor.entropy_floor={mon.entropy_floor} must be >= 0 (nats)")
    _need(mon.qk_growth > 1, f"monitor.qk_growth={mon.qk_growth} must be > 1 (a growth factor)")
    _need(m.init_std > 0, f"model.init_std={m.init_std} must be > 0")
    _need(m.patch_embed_std is None or m.patch_embed_std > 0, f"model.patch_embed_std={m.patch_embed_std} must be > 0")
    _need(m.depth >= 1, f"model.depth={m.depth} must be >= 1")
    _need(m.num_heads >= 1, f"model.num_heads={m.num_heads} must be >= 1")
    _need(m.embed_dim >= 1, f"model.embed_dim={m.embed_dim} must be >= 1 (e.g. model.embed_dim=384)")
    _need(m.mlp_ratio > 0, f"model.mlp_ratio={m.mlp_ratio} must be > 0 (e.g. 4.0)")
    if m.mlp_hidden is None and m.embed_dim >= 1 and int(m.embed_dim * m.mlp_ratio) < 1:
        least = next(r / 1e4 for r in itertools.count(math.ceil(1e4 / m.embed_dim)) if int(m.embed_dim * r / 1e4))
        _need(False, f"model.mlp_ratio={m.mlp_ratio:g} makes the MLP 0 wide at model.embed_dim={m.embed_dim}: "
                     f"raise it to {least:g} or more, or set model.mlp_hidden")
    _need(m.mlp_hidden is None or m.mlp_hidden >= 1, f"model.mlp_hidden={m.mlp_hidden} must be >= 1, or null "
                                                     f"(model.mlp_ratio x model.embed_dim)")
    _need(m.act in ("gelu", "gelu_tanh", "relu"), f"model.act={m.act} is not an option: use gelu, gelu_tanh, relu")
    for key in ("eval_every", "eval_batches", "ckpt_every"):
        _need(getattr(cfg, key) >= 1, f"{key}={getattr(cfg, key)} must be >= 1")
    _need(cfg.logger.log_every >= 1, f"logger.log_every={cfg.logger.log_every} must be >= 1")
    _need(cfg.schedule.min_lr >= 0, f"schedule.min_lr={cfg.schedule.min_lr} must be >= 0")
    _need(0 <= o.momentum < 1, f"optim.momentum={o.momentum} must be in [0, 1)")
    _need(o.trust_coef > 0, f"optim.trust_coef={o.trust_coef} must be > 0 (LARS: 0.001)")
    _need(_name(o) != "sgd" or not o.nesterov or o.momentum > 0,
          "optim.nesterov=true needs momentum: set optim.momentum > 0 (e.g. 0.9), or optim.nesterov=false")
    _need(cfg.resume in (None, "auto") or _exists(cfg.resume),
          f"resume={cfg.resume}: no such checkpoint (use resume=auto or a path to a .pt file)")
    _need(cfg.resume in (None, "auto") or not os.path.isdir(cfg.resume), _folder_resumed(str(cfg.resume)))
    dv = cfg.divergence
    _need(dv.action in ("stop", "rollback"), f"divergence.action={dv.action} is not an option: use stop or rollback")
    _need(dv.max_skips >= 1, f"divergence.max_skips={dv.max_skips} must be >= 1")
    _need(dv.skip_window >= 1, f"divergence.skip_window={dv.skip_window} must be >= 1")
    _need(dv.max_rollbacks >= 0, f"divergence.max_rollbacks={dv.max_rollbacks} must be >= 0")
    _need(dv.window >= 1, f"divergence.window={dv.window} must be >= 1")
    _need(dv.spike_factor > 1, f"divergence.spike_factor={dv.spike_factor} must be > 1 (a factor over the mean)")
    _need(0 < dv.lr_scale_on_rollback <= 1,
          f"divergence.lr_scale_on_rollback={dv.lr_scale_on_rollback} must be in (0, 1]")
    _need(cfg.ckpt.keep >= 0, f"ckpt.keep={cfg.ckpt.keep} must be >= 0")
    _need(dv.action != "rollback" or cfg.ckpt.keep >= 1,
          "divergence.action=rollback restores a ring checkpoint: set ckpt.keep >= 1 (e.g. 3)")
    _need(not mon.rollback_on_alert or (dv.action == "rollback" and mon.stop_on_alert),
          "monitor.rollback_on_alert=true needs divergence.action=rollback and monitor.stop_on_alert=true")
    dbg = cfg.debug
    for key in ("nan_at_step", "spike_at_step"):
        v = getattr(dbg, key)
        _need(v is None or v >= 1, f"debug.{key}={v} must be >= 1 (1-based) or null")
        _need(v is None or cfg.steps is None or v <= cfg.steps,
              f"debug.{key}={v} is past the run's steps={cfg.steps}: the fault would never happen")
    _need(dbg.spike_factor > 0, f"debug.spike_factor={dbg.spike_factor} must be > 0")
    _need(math.isfinite(cfg.dist_timeout) and cfg.dist_timeout > 0,
          f"dist_timeout={cfg.dist_timeout} must be > 0 seconds (e.g. 900)")
    d = cfg.data
    _need(d.repeated_aug >= 1, f"data.repeated_aug={d.repeated_aug} must be >= 1 (1 disables it)")
    _need(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction} must be in (0, 1)")
    _need(d.mixup >= 0 and d.cutmix >= 0, f"data.mixup={d.mixup} and data.cutmix={d.cutmix} must be >= 0 (0 is off)")
    _need(0 <= d.label_smoothing < 1, f"data.label_smoothing={d.label_smoothing} must be in [0, 1)")
    _need(m.block_size >= 1, f"model.block_size={m.block_size} must be >= 1")
    _need(m.patch_size >= 1, f"model.patch_size={m.patch_size} must be >= 1")
    _need(m.window_size >= 1, f"model.window_size={m.window_size} must be >= 1")
    _need(d.img_size is None or d.img_size >= 1,
          f"data.img_size={d.img_size} must be >= 1 (null: the model's, model.img_size={m.img_size})")
    _need(m.img_size >= 1, f"model.img_size={m.img_size} must be >= 1")
    _need(0 <= m.dropout < 1, f"model.dropout={m.dropout} must be in [0, 1)")
    _need(0 <= m.drop_path < 1, f"model.drop_path={m.drop_path} must be in [0, 1)")
    _need(0 <= cfg.seed <= 2**63 - 1, f"seed={cfg.seed} must be in [0, 2**63 - 1]")
    _need(re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(cfg.device)) is not None,
          f"device={cfg.device} is not an option: use auto, cpu, cuda or cuda:N")
    _need(cfg.parallel in ("ddp", "fsdp"), f"parallel={cfg.parallel} is not an option: use ddp or fsdp")
    sc = cfg.schedule
    _need(sc.horizon is None or sc.horizon > 0, f"schedule.horizon={sc.horizon} must be > 0 or null")
    # the cosine runs from the warmup's end to the horizon: one before it dropped from the peak to 0 in a step
    if sc.horizon is not None and sc.name == "cosine":
        _need(sc.horizon > cfg.warmup, f"schedule.horizon={sc.horizon:g} must be longer than warmup={cfg.warmup:g} "
                                       f"(both in schedule.unit): the cosine starts where the warmup ends")
    _need(sc.min_lr <= o.lr, f"schedule.min_lr={sc.min_lr} must be <= optim.lr={o.lr}")
    _need(0 < sc.gamma <= 1, f"schedule.gamma={sc.gamma} must be in (0, 1] (the factor of each step decay)")
    unit = getattr(sc.unit, "name", sc.unit)
    _need(all(x >= 0 for x in sc.milestones),
          f"schedule.milestones={list(sc.milestones)} must be >= 0 (in schedule.unit={unit} from the run's start)")


# keys that only some options read: key -> the options ("group=option") that read it
READ_BY = {
    "norm.alpha": ("norm=stablenorm", "attention=stable"),  # StableAtten's alpha when attention.alpha is null
    "norm.eps_mode": ("norm=stablenorm", "attention=stable"),
    "norm.eps": ("norm=stablenorm", "norm=rmsnorm"),
    **{f"attention.{k}": ("attention=stable",) for k in ("c", "seq_len", "alpha")},
    "attention.eps": ("attention=qknorm", "attention=stable"),
    **{f"optim.{k}": ("optim=adamw2",) for k in ("tau", "eps_inside_sqrt", "power_iters", "warm_start",
                                                  "overlap_sigma_w", "bound_norm_gains")},
    **{f"optim.{k}": ("optim=adamw", "optim=adamw2") for k in ("betas", "eps", "fused")},
    "optim.momentum": ("optim=sgd", "optim=lars"), "optim.nesterov": ("optim=sgd",),
    "optim.trust_coef": ("optim=lars",),
    "schedule.milestones": ("schedule=step",), "schedule.gamma": ("schedule=step",),
    "schedule.min_lr": ("schedule=cosine",), "schedule.horizon": ("schedule=cosine",),
}
# groups whose every key is unread under one option: group -> (its schema, that option, why, the
# keys read even then: that option's own yaml sets alerts; attn_fp32 works without sigmaReparam)
OFF = {"reparam": (ReparamConfig, "none", "reparametrises no layer", ("attn_fp32",)),
       "deescalate": (DeescConfig, "none", "adds no de-escalation", ()),
       "init": (InitConfig, "family", "keeps the model's own init", ()),
       "monitor": (MonitorConfig, "off", "measures nothing", ("alerts", "adamw2_every"))}
# keys that another key's setting leaves unread: key -> (read in this run?, what to set to use it)
READ_WHEN = {
    **{f"ema.{k}": (lambda c: c.ema.decay is not None, "the weight average is off (set ema.decay, e.g. 0.9999)")
       for k in ("every", "warmup")},
    **{f"divergence.{k}": (lambda c: c.divergence.enabled, "the spike check is off (divergence.enabled=false)")
       for k in ("spike_factor", "window", "warmup_steps", "ema")},
    **{f"divergence.{k}": (lambda c: c.divergence.action == "rollback",
                           "a divergence stops the run (set divergence.action=rollback to roll back)")
       for k in ("skip_window", "max_rollbacks", "lr_scale_on_rollback")},
    "divergence.max_skips": (lambda c: c.divergence.skip_nonfinite,
                             "no step is skipped (divergence.skip_nonfinite=false)"),
    "resume_allow_changes": (lambda c: c.resume is not None,
                             "this run resumes nothing (set resume=auto, or resume=PATH)"),
    **{f"logger.{k}": (lambda c: _value(c.logger.wandb) != "disabled",
                        "wandb is off (logger.wandb=disabled, as logger=none sets)") for k in ("project", "entity")},
    # (under monitor=off, OFF says it)
    **{f"monitor.{k}": (lambda c: c.monitor.alerts or _name(c.monitor) == "off",
                        "health alerts are off (monitor.alerts=false)")
       for k in ("stop_on_alert", "rollback_on_alert", "entropy_floor", "qk_growth", "qk_window")},
}


def _value(v: Any) -> str:
    return str(getattr(v, "value", v))  # an enum member's value


def _name(group_cfg: Any) -> str:
    return _value(group_cfg.name)


def unread_reasons(cfg: Any, own: Mapping[str, tuple[str, ...] | None] | tuple[str, ...] = ()) -> dict[str, str]:
    """Every key this config's choices leave unread, set or not, with why: the keys of options
    not chosen (READ_BY: ``norm.alpha`` with ``norm=layernorm``), every key of a group whose option
    is off (OFF) and the keys another key turns off (READ_WHEN). ``own``: the groups whose chosen
    option is the user's (``imports``), each with the keys it declared it reads (None, or ``own``
    a tuple of groups: it may read any key of its group, and none of theirs is here). The model
    family's are :func:`stabletrain.models.registry.model_unread_reasons`'."""
    out = {}
    declared = own if isinstance(own, Mapping) else dict.fromkeys(own)
    for key, readers in READ_BY.items():
        group, _, leaf = key.partition(".")
        if group in declared:
            # one's own option that declared its keys: the options' keys it did not declare are
            # unread, unless an option chosen in another group reads it (StableAtten's norm.alpha);
            # the keys the framework reads whatever the option (norm.placement, optim.lr) are not here
            reads = declared[group]
            if reads is None or leaf in reads or any(_name(cfg[r.split("=")[0]]) == r.split("=")[1]
                                                      for r in readers if r.split("=")[0] != group):
                continue
            out[key] = (f"{group}={_name(cfg[group])} is your own and reads only "
                        f"{', '.join(f'{group}.{k}' for k in reads) or f'no {group}.* key of an option'} "
                        f"(its register(keys=...))")
            continue
        if any(r.split("=")[0] in declared for r in readers):
            continue
        if not any(_name(cfg[r.split("=")[0]]) == r.split("=")[1] for r in readers):
            groups = dict.fromkeys(r.split("=")[0] for r in readers)
            only = " or ".join(f"{g}={'/'.join(r.split('=')[1] for r in readers if r.startswith(g + '='))}"
                               for g in groups)
            has = ", ".join(f"{g}={_name(cfg[g])}" for g in groups)
            out[key] = f"only {only} reads it, and this run has {has}"
    for group, (cls, off, why, keep) in OFF.items():
        if _name(cfg[group]) == off:
            for key in (f.name for f in fields(cls) if f.name not in ("name", *keep)):
                out[f"{group}.{key}"] = f"{group}={off} {why} (choose another {group} option)"
    for key, (is_read, why) in READ_WHEN.items():
        if key not in out and not is_read(cfg):
            out[key] = why
    return out


def unread_keys(cfg: Any, own: Mapping[str, tuple[str, ...] | None] | tuple[str, ...] = (),
                given: Collection[str] = ()) -> list[str]:
    """One note per key set away from its default, or ``given`` on the command line, that nothing
    reads in this run, because the option that reads it is not chosen (``norm.alpha=0.3`` with
    ``norm=layernorm``): a sweep may share such keys across options, so they are said, not refused
    (but a key a sweep varies that none of its points reads is: cli.check_overrides). A sweep's
    point at the key's default value is noted too: its results match the other values' there."""
    def value(key):
        group, _, leaf = key.partition(".")
        return cfg[group][leaf] if leaf else cfg[group]

    return [f"note: {key}={shown_value(value(key))} changes nothing: {why}"
            for key, why in unread_reasons(cfg, own).items()
            if key in given or differs(value(key), schema_default(key))]


def given_keys(overrides: Iterable[str] | None) -> set[str]:
    """The dotted keys of command-line overrides (``+norm.alpha=0.5`` -> ``norm.alpha``)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides or () if "=" in o}


def _schema_field(key: str) -> tuple[Any, Any]:
    """The typed schema's type hint and default of a dotted key; KeyError for a key it lacks."""
    import dataclasses
    import typing

    node: Any = TrainConfig
    hint: Any = TrainConfig
    for part in key.split("."):
        f = {f.name: f for f in fields(node)}.get(part) if dataclasses.is_dataclass(node) else None
        if f is None:
            raise KeyError(key)
        hint = typing.get_type_hints(node if isinstance(node, type) else type(node))[part]
        if f.default_factory is not dataclasses.MISSING:
            node = f.default_factory()
        elif dataclasses.is_dataclass(hint):  # model: MISSING in the schema, its fields' defaults below
            node = hint
        else:
            node = f.default
    return hint, node() if isinstance(node, type) else node


def schema_default(key: str) -> Any:
    """The typed schema's default of a dotted key (``optim.lr`` -> 0.001, ``model.depth`` -> 12);
    KeyError for a key the schema lacks."""
    return _schema_field(key)[1]


def is_bool_key(key: str) -> bool:
    """Whether the schema types ``key`` as a bool (``optim.nesterov``, ``compile``: Optional[bool])."""
    try:
        hint = _schema_field(key)[0]
    except KeyError:
        return False
    return hint is bool or hint == Optional[bool]


def differs(value: Any, default: Any) -> bool:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    return value != default


def shown_value(value: Any) -> str:
    from omegaconf import OmegaConf

    value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    if value is None or isinstance(value, bool):  # as it is written on the command line
        return "null" if value is None else str(value).lower()
    return str(getattr(value, "value", value)).replace(" ", "")


# float keys for which inf means something (no clipping, no growth alert, no spike check)
_INF_ALLOWED = {"grad_clip", "monitor.qk_growth", "divergence.spike_factor"}


def _check_finite(cfg: Any) -> None:
    """Every float value is finite: nan nowhere, inf only where it means something."""
    from omegaconf import OmegaConf

    if not OmegaConf.is_config(cfg):
        return

    for key, v in _leaves(OmegaConf.to_container(cfg, resolve=True)):
        if isinstance(v, float) and not math.isfinite(v):
            _need(math.isinf(v) and key in _INF_ALLOWED, f"{key}={v} must be a finite number")


def _leaves(node: Any, prefix: str = ""):
    """``(dotted key, value)`` of every leaf of a plain container: ``optim.lr``, ``optim.betas[0]``."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{prefix[:-1]}[{i}].")
    else:
        yield prefix[:-1], node


def _exists(p: str) -> bool:
    return os.path.exists(p)


def _folder_resumed(folder: str) -> str:
    """What ``resume=FOLDER`` should have said: resume takes a checkpoint file."""
    last = os.path.join(folder, "checkpoints", "last.pt")
    if os.path.isfile(last):
        return (f"resume={folder} is a run's folder, not a checkpoint: resume=auto hydra.run.dir={folder} continues "
                f"that run in it; resume={last} starts this run from its last checkpoint")
    return f"resume={folder} is a folder, not a checkpoint: pass a .pt file a run wrote (RUN/checkpoints/last.pt)"


# --- what a resumed run may change -------------------------------------------------------

# top-level keys a resumed run may change: how it is run and recorded, not what it trains
# (``ema``: a weight average added on resume starts from the resumed weights; ``init_weights``:
# where the weights started, which a resume replaces with its checkpoint's)
RESUME_MAY_CHANGE = ("resume", "resume_allow_changes", "init_weights", "logger", "monitor", "eval_every",
                     "eval_batches", "ckpt_every", "ckpt", "steps", "epochs", "name", "device", "compile",
                     "dist_timeout", "dry_run", "activation_checkpointing", "ema",
                     # how a run survives trouble, and the faults injected to show it: a run that
                     # diverged goes on with divergence.action=rollback, or without its injected fault
                     "divergence", "debug",
                     "data.num_workers",  # each image's augmentation is seeded by its place in the stream
                     "micro_batch_size")  # the same batch in other pieces: the fix an out-of-memory suggests


# of those, the settings that change how a run is recorded or run, not the state and data its steps
# meet: a run resumed with only these changed meets what it met before (a divergence included)
HOW_RECORDED = ("logger", "monitor", "eval_every", "eval_batches", "ckpt_every", "ckpt", "name", "device", "compile",
                "dist_timeout", "data.num_workers", "micro_batch_size", "activation_checkpointing")


def _plain(config_yaml: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(config_yaml)) if config_yaml else {}


def may_change(key: str, allowed=RESUME_MAY_CHANGE) -> bool:
    """Whether a resume may change dotted ``key``: its top-level key, or the key itself, is in ``allowed``."""
    return key in allowed or re.split(r"[.\[]", key)[0] in allowed


def changed_keys(saved_yaml: str, mine_yaml: str, allowed=RESUME_MAY_CHANGE,
                 equivalent: dict | None = None) -> list[str]:
    """The dotted keys whose values differ between two resolved configs (their yaml), but those
    :func:`may_change` under ``allowed``; two values of one ``equivalent[key]`` do not differ."""
    a, b = (leaf_values(y) for y in (saved_yaml, mine_yaml))
    same = equivalent or {}
    imports_same = _imported(a) == _imported(b)  # ./mine.py and mine.py, in any order: one module
    return sorted(k for k in set(a) | set(b)
                  if a.get(k) != b.get(k) and not may_change(k, allowed)
                  and not (imports_same and k.startswith("imports["))
                  and not {a.get(k), b.get(k)} <= set(same.get(k, ())))


def _imported(leaves: dict) -> set[str]:
    """The modules an ``imports`` list names: a path as the file it resolves to from here."""
    names = (str(v) for k, v in leaves.items() if k.startswith("imports["))
    return {os.path.realpath(os.path.expanduser(n)) if n.endswith(".py") or "/" in n else n for n in names}


def leaf_values(config_yaml: str) -> dict:
    """Dotted key -> value of a resolved config's yaml (a checkpoint's, or a run's)."""
    return dict(_leaves(_plain(config_yaml)))


def optim_name_of(config_yaml: str) -> str | None:
    """``optim.name`` of a resolved config's yaml (a checkpoint's, or a run's); None without one."""
    name = _plain(config_yaml).get("optim", {}).get("name")
    return None if name is None else str(name)
