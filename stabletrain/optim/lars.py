"""LARS: momentum SGD with a layer-wise trust ratio (sigmaReparam vision recipe, 001 Tab. 13/14)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer


class LARS(Optimizer):
    """Layer-wise adaptive rate scaling on top of heavy-ball momentum.

    For each parameter ``w`` with gradient ``g``, group rate ``lr``, momentum ``mu``, weight
    decay ``wd`` and trust coefficient ``eta`` (``trust_coef``):

        adapted tensors:   d = r * (g + wd * w)
                           r = eta * ||w|| / (||g|| + wd * ||w||)   if ||w|| > 0 and ||g|| > 0
                           r = 1                                    otherwise
        excluded tensors:  d = g                  (no decay, no trust ratio)
        buf = mu * buf + d                        (buf = 0 before the first step)
        w   = w - lr * buf

    Norms are Frobenius norms of the whole tensor. Group key ``lars_exclude``: ``None``
    (standalone default) excludes tensors with fewer than 2 dims; the trainer's grouping sets
    it for 1-D tensors, biases, norms and sigmaReparam's gamma (docs/methods.md §8.3). The recipe's
    "Base LR" 0.1 is the absolute ``lr`` at batch 4096 (docs/methods.md §8.3 decision).
    All arithmetic stays on the device (no host sync).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coef: float = 0.001,
    ):
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coef <= 0:
            raise ValueError(
                f"LARS: need lr, momentum, weight_decay >= 0 and trust_coef > 0, got "
                f"lr={lr} momentum={momentum} weight_decay={weight_decay} trust_coef={trust_coef}"
            )
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "trust_coef": trust_coef,
            "lars_exclude": None,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            adapted: list[Tensor] = []
            excluded: list[Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LARS does not support sparse gradients")
                flag = group["lars_exclude"]
                is_excluded = p.dim() < 2 if flag is None else bool(flag)
                (excluded if is_excluded else adapted).append(p)
            directions = [p.grad for p in excluded]
            if adapted:
                directions += self._trust_scaled(group, adapted)
            params = excluded + adapted
            if params:
                self._momentum_step(group, params, directions)
        return loss

    @staticmethod
    def _trust_scaled(group: dict, params: list[Tensor]) -> list[Tensor]:
        wd, eta = group["weight_decay"], group["trust_coef"]
        grads = [p.grad for p in params]
        w_norm = torch.stack(torch._foreach_norm(params))
        g_norm = torch.stack(torch._foreach_norm(grads))
        usable = (w_norm > 0) & (g_norm > 0)
        ratio = torch.where(usable, eta * w_norm / (g_norm + wd * w_norm).clamp_min(1e-30), 1.0)
        directions = torch._foreach_add(grads, params, alpha=wd) if wd != 0 else [g.clone() for g in grads]
        torch._foreach_mul_(directions, list(ratio.unbind(0)))
        return directions

    def _momentum_step(self, group: dict, params: list[Tensor], directions: list[Tensor]) -> None:
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        torch._foreach_mul_(bufs, group["momentum"])
        torch._foreach_add_(bufs, directions)
        torch._foreach_add_(params, bufs, alpha=-group["lr"])
