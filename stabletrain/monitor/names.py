"""Metric names: the one contract between the training loop, metrics.jsonl and the plots.

A per-block metric is ``<group>/<block>/<quantity>`` (``sigma1/blocks.3/wq_t_wk_max``); the
block is the module path of the transformer block and may contain dots
(``layers.1.blocks.0`` in Swin) but never a slash. ``token_sim/<block>`` has no quantity.
AdamW² telemetry is ``adamw2/frac_bounded`` and, per tensor, ``adamw2/lr_eff/<param>``,
``adamw2/lr_ratio/<param>``, ``adamw2/sigma_w/<param>`` and ``adamw2/sigma_u/<param>``
(docs/methods.md §1). Training scalars are plain names.
"""

from __future__ import annotations

import re
from typing import NamedTuple

SIGMA1 = "sigma1"
SEC = "sec"
ENTROPY = "entropy"
TOKEN_SIM = "token_sim"
QK_SPECTRUM = "qk_spectrum"
NORM = "norm"
ADAMW2 = "adamw2"

BLOCK_GROUPS = (SIGMA1, SEC, ENTROPY, TOKEN_SIM, QK_SPECTRUM, NORM)

# training scalars written by the loop
LOSS = "loss"  # what is minimised: the task loss plus every loss term
LR = "lr"
GRAD_NORM = "grad_norm"  # before clipping; the log interval's largest, or the log step's without skip_nonfinite
LOSS_PENALTY = "loss/penalty"  # the loss terms' share of LOSS
STEP_TIME = "time/step_s"
PEAK_MEMORY = "memory/peak_gb"
MFU = "throughput/mfu"  # model FLOPs utilisation (CUDA only)
BAD_SAMPLES = "data/bad_samples"  # unreadable files replaced so far (image folders)
SKIPPED_STEPS = "train/skipped_steps"  # steps of the log interval whose update was skipped (non-finite)
SKIPPED_STEP = "train/skipped_step"  # 1, in a record of its own at each step whose update was skipped
RESUMED_AT = "run/resumed_at"  # the step a resumed run continued from, logged at that step
# beside it, the settings the resumed run changed: "optim.lr: 0.001 -> 0.003, steps: 40 -> 60"
# (config.yaml then holds the new values only)
RESUME_CHANGES = "run/changed"
VAL, VAL_EMA = "val", "val_ema"  # the live model's and the weight average's evaluation prefixes
VAL_LOSS = "val/loss"
VAL_ACC = "val/acc"


def loss_term(name: str) -> str:
    """One loss term's share of LOSS (logged when several are active): ``loss/zloss``."""
    return f"loss/{name}"


def rollback(field: str) -> str:
    """A rollback's record: ``rollback/restored_step``, ``rollback/skipped_steps``, ..."""
    return f"rollback/{field}"


def throughput(unit: str) -> str:
    """``throughput/tokens_per_s`` or ``throughput/samples_per_s``."""
    return f"throughput/{unit}_per_s"


def scored(prefix: str, quantity: str) -> str:
    """An evaluation record: ``val/loss``, ``val_ema/acc``, ``val/ppl``."""
    return f"{prefix}/{quantity}"

# sigma1 quantities; "_max"/"_mean" are over heads of the per-head product, "_full" the
# full-width product (the sum over heads), which is the magnitude the AdamW² paper reports
WQ, WK, WV, WO, W1, W2 = "wq", "wk", "wv", "wo", "w1", "w2"
WQ_T_WK, WO_WV = "wq_t_wk", "wo_wv"  # stems; per-head names are wq_t_wk_head{h}, wo_wv_head{h}
WQ_T_WK_MAX, WQ_T_WK_MEAN, WQ_T_WK_FULL = "wq_t_wk_max", "wq_t_wk_mean", "wq_t_wk_full"
WO_WV_MAX, WO_WV_MEAN, WO_WV_FULL = "wo_wv_max", "wo_wv_mean", "wo_wv_full"
W2_W1 = "w2_w1"

# entropy quantities (natural log)
ENT_MIN, ENT_MEAN, ENT_LOG_T, ENT_BOUND_MIN = "min", "mean", "log_T", "bound_min"

# QK eigenspectrum statistics, labelled as in docs/methods.md §4
EIG_MEAN_TRACE = "eig_mean_trace"
EIG_SCALE_FRO2 = "eig_scale_fro2"
EIG_SCALE_TR2 = "eig_scale_tr2"
EIG_VAR_D2 = "eig_var_d2"
QK_STATS = (EIG_MEAN_TRACE, EIG_SCALE_FRO2, EIG_SCALE_TR2, EIG_VAR_D2)

# norm quantities: gains/biases of the block's two norms, block input and its gradient
NORM1_GAMMA, NORM1_BETA = "norm1_gamma", "norm1_beta"
NORM2_GAMMA, NORM2_BETA = "norm2_gamma", "norm2_beta"
ACT_X, ACT_GRAD_X = "x", "grad_x"

FRAC_BOUNDED = f"{ADAMW2}/frac_bounded"


class Quantity(NamedTuple):
    group: str
    quantity: str
    label: str  # how plots title it


# The 15 watched quantities of AdamW² Eq. 1 (docs/methods.md §7), in the paper's order. The two
# beta terms are absent for RMSNorm and nanoGPT's bias-free LayerNorm (13 terms).
FIFTEEN: tuple[Quantity, ...] = (
    Quantity(SIGMA1, WQ, r"$\sigma_1(W_q)$"),
    Quantity(SIGMA1, WK, r"$\sigma_1(W_k)$"),
    Quantity(SIGMA1, WV, r"$\sigma_1(W_v)$"),
    Quantity(SIGMA1, WO, r"$\sigma_1(W_o)$"),
    Quantity(SIGMA1, W1, r"$\sigma_1(W_1)$"),
    Quantity(SIGMA1, W2, r"$\sigma_1(W_2)$"),
    Quantity(SIGMA1, WQ_T_WK_FULL, r"$\sigma_1(W_q^\top W_k)$"),
    Quantity(SIGMA1, WO_WV_FULL, r"$\sigma_1(W_o W_v)$"),
    Quantity(NORM, NORM1_GAMMA, r"$\|\gamma_1\|_2$"),
    Quantity(NORM, NORM1_BETA, r"$\|\beta_1\|_2$"),
    Quantity(NORM, NORM2_GAMMA, r"$\|\gamma_2\|_2$"),
    Quantity(NORM, NORM2_BETA, r"$\|\beta_2\|_2$"),
    Quantity(SIGMA1, W2_W1, r"$\sigma_1(W_2 W_1)$"),
    Quantity(NORM, ACT_X, r"$\|x\|_2$, $x$ the block's input"),
    Quantity(NORM, ACT_GRAD_X, r"$\|\partial L/\partial x\|_2$, at the block's input"),
)


def metric(group: str, block: str, quantity: str | None = None) -> str:
    """``group/block/quantity`` (or ``group/block`` when the group has one value per block)."""
    if "/" in block:
        raise ValueError(f"block name {block!r} must not contain '/'")
    return f"{group}/{block}" if quantity is None else f"{group}/{block}/{quantity}"


def for_block(block: str, values: dict) -> dict:
    """Insert the block into ``group/quantity`` (or ``group``) keys: ``sigma1/wq`` ->
    ``sigma1/blocks.3/wq``, ``token_sim`` -> ``token_sim/blocks.3``."""
    out = {}
    for key, v in values.items():
        group, _, quantity = key.partition("/")
        out[metric(group, block, quantity or None)] = v
    return out


def head(prefix: str, h: int) -> str:
    """Per-head quantity name: ``head("head", 3)`` -> ``head3``, ``head("wq_t_wk_head", 3)``."""
    return f"{prefix}{h}"


def sec_name(s: int) -> str:
    return f"s{s}"


def sec_sizes(d_h: int) -> list[int]:
    """The ``s`` of the SEC curve: 1, 2, 4, ... up to ``d_h``, and ``d_h`` itself (docs/methods.md §7)."""
    sizes, s = [], 1
    while s < d_h:
        sizes.append(s)
        s *= 2
    sizes.append(d_h)
    return sizes


def sec_alert_size(d_h: int) -> int:
    """The ``s`` whose SEC marks concentration in the alert: 4 at the paper's ``d_h = 64``.

    The paper's signature is ``SEC(64, 4) > 99%`` (000), energy in 1/16 of the head's
    directions, "fewer than 10". **Decision:** narrow heads keep that ratio but look at
    two directions at least (``d_h // 16`` clipped to ``[2, 4]``): a collapsed 16-wide head
    showed SEC(16, 2) = 0.99999997 with SEC(16, 1) = 0.93, so one direction would miss it; and
    at most half the head (``SEC(d_h, d_h)`` is always 1). Rounded down to a size the curve
    logs (:func:`sec_sizes`): 2 for ``d_h`` 48 to 63, a stricter test than 3.
    """
    s = max(1, min(max(2, min(4, d_h // 16)), d_h // 2))
    return 1 << (s.bit_length() - 1)


def adamw2_lr_eff(param: str) -> str:
    return f"{ADAMW2}/lr_eff/{param}"


def adamw2_lr_ratio(param: str) -> str:
    return f"{ADAMW2}/lr_ratio/{param}"


class Parsed(NamedTuple):
    group: str
    block: str
    quantity: str | None


def parse(name: str) -> Parsed | None:
    """Split a per-block metric name; ``None`` for training scalars and AdamW² telemetry."""
    parts = name.split("/")
    if parts[0] not in BLOCK_GROUPS or len(parts) < 2:
        return None
    if parts[0] in (TOKEN_SIM, ATTN_LOGIT_MAX):
        return Parsed(parts[0], parts[1], None) if len(parts) == 2 else None
    if len(parts) != 3:
        return None
    return Parsed(parts[0], parts[1], parts[2])


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def natural_sorted(names) -> list[str]:
    """Sort block or parameter names so that ``blocks.10`` follows ``blocks.9``."""
    return sorted(names, key=_natural_key)


def blocks_in(names) -> list[str]:
    """The block names that occur in a collection of metric names, in depth order."""
    return natural_sorted({p.block for n in names if (p := parse(n)) is not None})


# logit monitors at the probe cadence: attention-logit growth is what collapses attention
# entropy (ViT-22B), and a drifting output log-partition is what z-loss (PaLM) holds down
ATTN_LOGIT_MAX = "attn_logit_max"  # attn_logit_max/<block>: max over heads, queries, keys; no quantity
LOG_Z = "logits/log_z"  # mean over tokens of logsumexp of the output logits
BLOCK_GROUPS = (*BLOCK_GROUPS, ATTN_LOGIT_MAX)
