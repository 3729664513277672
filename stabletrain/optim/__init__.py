"""Optimizers (adamw, adamw2, lars, sgd), their param groups and lr schedules.

Standalone, in a loop of one's own (the trainer does the same through ``OptimizerSchedule``,
which also schedules the weight decay)::

    optimizer, summary = build_optimizer(model, cfg.optim, cfg.model.family, cfg.reparam,
                                         cfg.batch_size)
    print(summary)
    lr_at = make_schedule(cfg.schedule, scaled_lr(cfg.optim, cfg.batch_size), total_steps,
                          warmup=cfg.warmup, steps_per_epoch=steps_per_epoch)
    for step in range(start, total_steps):
        set_lr(optimizer, lr_at(step))          # multiplies by each group's lr_mult
        ...backward, clip...
        optimizer.step()
        if isinstance(optimizer, AdamW2) and step % every == 0:
            log(optimizer.telemetry())          # the only host sync AdamW² asks for
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stabletrain.optim.adamw2 import AdamW2, BoundRecord
from stabletrain.optim.lars import LARS
from stabletrain.registry import Registry, option_value
from stabletrain.optim.param_groups import classify, make_param_groups, summarize_groups
from stabletrain.optim.schedule import (
    LRSchedule,
    OptimizerSchedule,
    make_schedule,
    set_lr,
    set_weight_decay,
    to_steps,
    weight_decay_at,
)

__all__ = [
    "LARS",
    "OPTIMIZERS",
    "AdamW2",
    "BoundRecord",
    "LRSchedule",
    "OptimizerSchedule",
    "build_optimizer",
    "classify",
    "make_param_groups",
    "make_schedule",
    "scaled_lr",
    "set_lr",
    "set_weight_decay",
    "weight_decay_at",
    "summarize_groups",
    "to_steps",
]

# name -> ``(param_groups, optim_cfg, lr) -> Optimizer``; info ``group_flag``: the per-group
# flag the optimizer reads (AdamW²'s ``bound``, LARS's ``lars_exclude``; see param_groups)
OPTIMIZERS = Registry("optim", __name__, declares=("group_flag", "keys"), call="(param_groups, cfg, lr)",
                      returns=(lambda o: isinstance(o, torch.optim.Optimizer), "a torch.optim.Optimizer"))


def scaled_lr(optim_cfg: Any, batch_size: int | None = None) -> float:
    """``optim.lr``, times ``batch_size / 256`` when ``optim.lr_scale_by_batch`` (docs/methods.md §8.3)."""
    lr = float(optim_cfg.lr)
    if getattr(optim_cfg, "lr_scale_by_batch", False):
        if not batch_size:
            raise ValueError("optim.lr_scale_by_batch=true needs the global batch_size")
        lr *= batch_size / 256
    return lr


def build_optimizer(
    model: nn.Module,
    optim_cfg: Any,
    family: Any,
    reparam_cfg: Any = None,
    batch_size: int | None = None,
) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer named by ``optim_cfg.name`` over ``model``'s grouped parameters.

    Call after the model is on its device (adamw picks its fused kernel from that).
    ``optim_cfg.tau`` null under AdamW² is set to the model family's (:func:`family_tau`). Groups
    follow :mod:`stabletrain.optim.param_groups` and carry ``names`` and ``lr_mult``; the
    initial ``lr`` of each group is ``scaled_lr * lr_mult``. Returns the optimizer and a short
    text summary of the split for the trainer to print. ``family`` None takes a model of no
    registered family (an nn.Module of one's own): decay on >= 2-D weights only, none on its
    ``no_weight_decay()`` names if it has that method, AdamW²'s default tau.
    """
    name = option_value(optim_cfg.name)
    OPTIMIZERS.entry(name)  # an unknown name fails here, in one line
    lr = scaled_lr(optim_cfg, batch_size)
    gamma_lr_mult = float(reparam_cfg.gamma_lr_mult) if reparam_cfg is not None else 1.0
    family = None if family is None else option_value(family)  # None: a module of one's own, no family
    groups = make_param_groups(
        model,
        family,
        float(optim_cfg.weight_decay),
        optimizer=name,
        bound_norm_gains=bool(optim_cfg.bound_norm_gains),
        gamma_lr_mult=gamma_lr_mult,
    )
    if not groups:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    tau = optim_cfg.get("tau") if hasattr(optim_cfg, "get") else getattr(optim_cfg, "tau", None)
    if tau is None and name == "adamw2":
        from stabletrain.models.registry import family_tau

        # written into the config, so that config.yaml records the bound the run had
        tau = optim_cfg.tau = family_tau(family)
    own = optim_cfg.get("kwargs") if hasattr(optim_cfg, "get") else getattr(optim_cfg, "kwargs", None)
    args = f" ({', '.join(f'{k}={v}' for k, v in own.items())})" if own else ""  # an optimizer of one's own
    summary = summarize_groups(groups, header=f"optimizer {name}{args} lr {lr:g}: ",
                               tau=None if tau is None else float(tau))
    for g in groups:
        g.pop("kinds")
        g["lr"] = lr * g["lr_mult"]

    opt = OPTIMIZERS.make(name, groups, optim_cfg, lr)
    return opt, summary


@OPTIMIZERS.register("adamw")
def make_adamw(groups: list[dict], cfg: Any, lr: float) -> torch.optim.Optimizer:
    # torch's fused kernel exists for CUDA and CPU; on a CPU it is ~6x faster than foreach (ViT-B, GPT-2 S)
    fusable = all(p.device.type in ("cuda", "cpu") for g in groups for p in g["params"])
    fused = fusable if cfg.fused is None else bool(cfg.fused)
    return torch.optim.AdamW(groups, lr=lr, betas=_betas(cfg), eps=float(cfg.eps), fused=fused,
                             foreach=None if fused else True)


@OPTIMIZERS.register("adamw2", group_flag="bound")
def make_adamw2(groups: list[dict], cfg: Any, lr: float) -> torch.optim.Optimizer:
    return AdamW2(groups, lr=lr, betas=_betas(cfg), eps=float(cfg.eps), tau=float(cfg.tau),
                  power_iters=int(cfg.power_iters), warm_start=bool(cfg.warm_start),
                  eps_inside_sqrt=bool(cfg.eps_inside_sqrt), fused=cfg.fused,
                  overlap_sigma_w=bool(getattr(cfg, "overlap_sigma_w", False)))


@OPTIMIZERS.register("lars", group_flag="lars_exclude")
def make_lars(groups: list[dict], cfg: Any, lr: float) -> torch.optim.Optimizer:
    return LARS(groups, lr=lr, momentum=float(cfg.momentum), trust_coef=float(cfg.trust_coef))


@OPTIMIZERS.register("sgd")
def make_sgd(groups: list[dict], cfg: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=float(cfg.momentum), nesterov=bool(cfg.nesterov), foreach=True)


def _betas(cfg: Any) -> tuple[float, float]:
    return tuple(float(b) for b in cfg.betas)
