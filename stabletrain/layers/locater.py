"""LocAteR, the QK-eigenspectrum regulariser (003 Sec. 6, Eq. 8; docs/methods.md §4).

Per attention head ``h`` with ``d_h x d`` slices ``W_Q^h, W_K^h`` of the (effective) fused
``qkv`` weight and ``W_QK = W_Q^h^T W_K^h`` (``d x d``, rank <= ``d_h``)::

    penalty = sum over layers and heads of
              scale_coef * tr(W_QK^T W_QK)  +  mean_coef * (tr(W_QK) - 1)^2

``scale_coef`` is kappa1 (eigenspectrum scale), ``mean_coef`` kappa2 (eigenspectrum mean).
The trainer adds it to every micro-batch loss when ``regularizer=locater``
(:mod:`stabletrain.losses.locater`).

Decisions (docs/methods.md §4): never forming a ``d x d`` matrix,
``tr(W_QK) = <W_Q, W_K>`` (elementwise) and
``tr(W_QK^T W_QK) = tr((W_Q W_Q^T)(W_K W_K^T))`` (two ``d_h x d_h`` Gram matrices), all heads
of a layer at once; ``d`` is the model (attention input) width; raw projections: no softmax
scale or temperature, no q/k biases. With sigmaReparam the effective weight is used (what
the attention computes with). The monitor quantities ``tr(W_QK^2)`` and
``d tr(W_QK^2) - tr(W_QK)^2`` come from :func:`qk_eigen_stats`.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from stabletrain.errors import ReachedNothing



def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, attention)`` for every module with a fused ``qkv`` linear and ``num_heads``."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(getattr(m, "qkv", None), nn.Module) and hasattr(m, "num_heads")]


def qk_heads(qkv_weight: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """``(W_Q, W_K)`` per head, each ``(num_heads, d_h, d)``, from a ``(3 h d_h, d)`` qkv weight."""
    rows, d = qkv_weight.shape
    d_h = rows // (3 * num_heads)
    heads = qkv_weight.reshape(3, num_heads, d_h, d)
    return heads[0], heads[1]


def qk_trace_terms(w_q: Tensor, w_k: Tensor) -> tuple[Tensor, Tensor]:
    """Per head ``(tr(W_QK), tr(W_QK^T W_QK))`` for slices ``(..., d_h, d)``; differentiable."""
    trace = (w_q * w_k).sum((-2, -1))
    gram_q = w_q @ w_q.transpose(-2, -1)
    gram_k = w_k @ w_k.transpose(-2, -1)
    fro2 = (gram_q * gram_k).sum((-2, -1))  # both Grams are symmetric: tr(A B) = <A, B>
    return trace, fro2


def qk_eigen_stats(w_q: Tensor, w_k: Tensor) -> dict[str, Tensor]:
    """Per head ``eig_mean_trace``, ``eig_scale_fro2``, ``eig_scale_tr2``, ``eig_var_d2``.

    ``tr(W_QK^2) = tr((W_K W_Q^T)^2)`` (what 003 Fig. 6 plots; negative possible for an
    asymmetric ``W_QK``) and ``d tr(W_QK^2) - tr(W_QK)^2`` (003 Eq. 8's ``d^2 Var``).
    """
    trace, fro2 = qk_trace_terms(w_q, w_k)
    m = w_k @ w_q.transpose(-2, -1)
    tr2 = (m * m.transpose(-2, -1)).sum((-2, -1))
    return {"eig_mean_trace": trace, "eig_scale_fro2": fro2, "eig_scale_tr2": tr2,
            "eig_var_d2": w_q.shape[-1] * tr2 - trace.pow(2)}


def layer_penalty(qkv_weight: Tensor, num_heads: int, scale_coef: float, mean_coef: float) -> Tensor:
    """One layer's LocAteR term, summed over its heads, in fp32."""
    with torch.autocast(qkv_weight.device.type, enabled=False):
        w_q, w_k = qk_heads(qkv_weight.float(), num_heads)
        trace, fro2 = qk_trace_terms(w_q, w_k)
        return (scale_coef * fro2 + mean_coef * (trace - 1.0).pow(2)).sum()


def locater_penalty(model: nn.Module, reg_cfg, whole_weights=None) -> Tensor:
    """The LocAteR loss term of ``model`` (a 0-dim fp32 tensor with grad; 0 if no attention);
    ``reg_cfg`` has ``scale_coef`` and ``mean_coef``. ``whole_weights(module, fn)``, when given,
    computes ``fn(module)`` with the module's weights whole (the trainer's under FSDP2, where
    outside the forward each rank holds shards); it is called per attention's ``qkv``."""
    def penalty(qkv: nn.Module, num_heads: int) -> Tensor:
        return layer_penalty(qkv.weight, num_heads, reg_cfg.scale_coef, reg_cfg.mean_coef)

    terms = [penalty(attn.qkv, attn.num_heads) if whole_weights is None
             else whole_weights(attn.qkv, lambda qkv, h=attn.num_heads: penalty(qkv, h))
             for _, attn in attention_layers(model)]
    if not terms:
        warnings.warn(f"LocAteR: {type(model).__name__} has no attention with a fused qkv nn.Linear and num_heads, "
                      f"whose query/key weights it penalises: the term adds 0", ReachedNothing, stacklevel=2)
        return torch.zeros((), device=next(model.parameters()).device)
    return torch.stack(terms).sum()


@torch.no_grad()
def locater_value(model: nn.Module, reg_cfg) -> dict[str, float]:
    """The penalty and its two parts per attention layer and in total, as floats (monitors).

    Keys: ``<layer>/scale`` (``sum_h tr(W_QK^T W_QK)``), ``<layer>/mean`` (``sum_h (tr(W_QK)-1)^2``),
    ``<layer>/penalty``, and ``total`` (= :func:`locater_penalty`).
    """
    out: dict[str, float] = {}
    total = 0.0
    for name, attn in attention_layers(model):
        w_q, w_k = qk_heads(attn.qkv.weight.detach().double(), attn.num_heads)
        trace, fro2 = qk_trace_terms(w_q, w_k)
        scale, mean = fro2.sum().item(), (trace - 1.0).pow(2).sum().item()
        pen = reg_cfg.scale_coef * scale + reg_cfg.mean_coef * mean
        out.update({f"{name}/scale": scale, f"{name}/mean": mean, f"{name}/penalty": pen})
        total += pen
    out["total"] = total
    return out
