"""Attention variants chosen by name (``attention`` config group), all through SDPA.

Every variant is "a transform of q and k plus a softmax scale" (docs/methods.md §5), so all of
them run through ``F.scaled_dot_product_attention`` and its fused kernels:

- ``softmax``: identity, scale ``1/sqrt(d_h)``.
- ``qknorm``: RMSNorm with learned gains on per-head q and k, scale ``1/sqrt(d_h)`` (our added
  baseline, timm's ``qk_norm``).
- ``stable``: StableAtten (004 Eq. 3): StableNorm over ``d_h`` on q and k, scale
  ``tau * d_h^(-2 alpha)`` with ``tau = c * log2(N)``. The norms' ``d_h^alpha`` cancel the
  ``d_h^(2 alpha)``, so logits are ``tau * gamma_q gamma_k cos(q, k)``: bounded by
  ``tau * max|gamma_q * gamma_k|`` for any input scale. ``N`` is fixed at construction.

A monitor can set ``module.probe = {}`` on any attention here; the next forward then also
stores the explicit attention probabilities (``probs``, B x H x T x T), the attention
input (``x``), the largest attention logit (``logit_max``, a 0-dim fp32 tensor; see
:func:`logit_max`), whether the call was causal (``causal``) and, for a call given a mask, the
keys it allows (``key_mask``, bool) and whether the mask was a float one added to the logits
(``logit_bias``) in it. The returned output always comes from SDPA, so probing changes
nothing, and a forward that is not probed does no extra work.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from timm.models.swin_transformer import WindowAttention

from stabletrain.errors import ConfigError
from stabletrain.layers.norm import StableNorm, check_eps, mode_eps
from stabletrain.registry import Registry, option_value


def _is_qk_transform(t) -> bool:
    return (isinstance(t, tuple) and len(t) == 3 and all(isinstance(m, nn.Module) for m in t[:2])
            and isinstance(t[2], (int, float)))


ATTENTIONS = Registry("attention", __name__, declares=("keys",), call="(attn_cfg, norm_cfg, head_dim, seq_len)",
                      returns=(_is_qk_transform, "(q_norm, k_norm, scale): two nn.Module instances and a number"))


def qk_transform(attn_cfg, norm_cfg, head_dim: int, seq_len: int) -> tuple[nn.Module, nn.Module, float]:
    """``(q_norm, k_norm, scale)`` for the attention variant ``attn_cfg.name``.

    ``seq_len`` is the model's tokens per attention, fixed at construction: GPT block size,
    ViT token count with the class token, Swin window area (what StableAtten's ``N`` defaults to).
    """
    return ATTENTIONS.make(attn_cfg.name, attn_cfg, norm_cfg, head_dim, seq_len)


@ATTENTIONS.register("softmax")
def softmax(attn_cfg, norm_cfg, head_dim: int, seq_len: int):
    return nn.Identity(), nn.Identity(), head_dim**-0.5


@ATTENTIONS.register("qknorm")
def qknorm(attn_cfg, norm_cfg, head_dim: int, seq_len: int):
    """Our added baseline, not one of the papers' runs: RMSNorm with gains on q and k (eps
    ``attn_cfg.eps``), scale ``1/sqrt(d_h)``."""
    check_eps(attn_cfg.eps, "attention.eps")
    eps = mode_eps(attn_cfg.eps)
    return nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps), head_dim**-0.5


@ATTENTIONS.register("stable")
def stable(attn_cfg, norm_cfg, head_dim: int, seq_len: int):
    """StableAtten (004 Eq. 3). Decisions (docs/methods.md §5): the q and k norms have gains of
    size ``d_h`` shared by all heads, init 1; ``alpha = attn_cfg.alpha`` (null: ``norm_cfg.alpha``;
    the logits do not depend on it, only where eps enters does), ``eps = attn_cfg.eps`` and
    ``norm_cfg.eps_mode``; ``N = attn_cfg.seq_len`` or else the model's ``seq_len``
    (GPT block 1024 -> tau 16.18)."""
    alpha = attn_cfg.alpha if attn_cfg.alpha is not None else norm_cfg.alpha
    n = attn_cfg.seq_len if attn_cfg.seq_len is not None else seq_len
    if n < 2:
        raise ConfigError(f"attention=stable needs a sequence length N >= 2, got {n}")
    if not (isinstance(attn_cfg.c, Real) and attn_cfg.c > 0):
        raise ConfigError(f"attention.c={attn_cfg.c} must be > 0")
    check_eps(attn_cfg.eps, "attention.eps")
    tau = attn_cfg.c * math.log2(n)
    mode = option_value(norm_cfg.eps_mode)
    qn = StableNorm(head_dim, alpha=alpha, eps=attn_cfg.eps, eps_mode=mode)
    kn = StableNorm(head_dim, alpha=alpha, eps=attn_cfg.eps, eps_mode=mode)
    return qn, kn, tau * head_dim ** (-2 * alpha)


def explicit_probs(q: Tensor, k: Tensor, scale: float, attn_mask: Optional[Tensor], causal: bool,
                   logits: Optional[Tensor] = None) -> Tensor:
    """softmax(scale q k^T + mask) in fp32, what SDPA computes internally (for monitors).
    ``logits``: ``scale q k^T`` in fp32 when already computed."""
    if logits is None:
        logits = scale * (q.float() @ k.float().transpose(-2, -1))
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # SDPA's convention: True = attend
        logits = logits.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        logits = logits + attn_mask.float()
    if causal:
        t, s = logits.shape[-2:]
        keep = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits.softmax(-1)


def logit_max(logits: Tensor, attn_mask: Optional[Tensor], causal: bool) -> Tensor:
    """The largest attention logit over batch, heads, queries and keys (0-dim fp32 tensor).

    **Decision:** the logit is ``scale * q_n . k_n`` (``logits``), with ``q_n, k_n`` after the
    variant's q/k transform (QKNorm's RMSNorm, StableAtten's StableNorm) and the scale SDPA
    uses, *before* any additive bias or mask: the quantity whose growth Wortsman et al. (2023)
    and ViT-22B track. Swin's relative position bias is therefore not included. Masked pairs
    are excluded: future keys under ``causal``, and pairs a mask removes entirely (``False`` in
    a boolean mask, ``-inf`` in a float one). Swin's shifted-window mask is finite (-100), so
    for Swin the max runs over every query-key pair of a window, cross-region pairs included.
    """
    return mask_logits_(logits.clone(), attn_mask, causal).amax()


def allowed_keys(attn_mask: Tensor) -> Tensor:
    """The keys an SDPA mask lets a query attend to: a boolean mask's True entries, a float mask's
    entries above ``-inf``."""
    return attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")


def mask_logits_(logits: Tensor, attn_mask: Optional[Tensor], causal: bool) -> Tensor:
    """``logits`` with the pairs :func:`logit_max` excludes set to ``-inf``, in place."""
    keep = None if attn_mask is None else allowed_keys(attn_mask)
    if causal:
        t, s = logits.shape[-2:]
        tri = torch.ones(t, s, dtype=torch.bool, device=logits.device).tril()
        keep = tri if keep is None else keep & tri
    return logits if keep is None else logits.masked_fill_(~keep, float("-inf"))


def attend(mod: nn.Module, x: Tensor, q: Tensor, k: Tensor, v: Tensor,
           attn_mask: Optional[Tensor] = None, causal: bool = False) -> Tensor:
    """Shared core: q/k transform, optional fp32 attention, SDPA, optional probe capture."""
    q, k = mod.q_norm(q), mod.k_norm(k)
    drop = mod.attn_drop.p if mod.training else 0.0
    if mod.probe is not None:
        with torch.no_grad():  # masked once, in place: at T = 1024 each copy is B x H x 4 MB
            logits = mask_logits_((q.detach().float() @ k.detach().float().transpose(-2, -1)).mul_(mod.scale),
                                  attn_mask, causal)
            mod.probe["logit_max"] = logits.amax()
            mod.probe["probs"] = explicit_probs(q, k, mod.scale, attn_mask, False, logits)  # causal applied
        mod.probe["x"] = x.detach()
        mod.probe["causal"] = causal  # a block may ask for causal attention per call (is_causal)
        if attn_mask is not None and "key_mask" not in mod.probe:  # Swin records its own
            mod.probe["key_mask"] = allowed_keys(attn_mask)
            mod.probe["logit_bias"] = attn_mask.dtype != torch.bool  # its values move the logits
    # a boolean mask goes to SDPA as it is (True: attend); cast to a float, it would be added to the logits
    additive = attn_mask is not None and attn_mask.dtype != torch.bool
    if mod.attn_fp32:
        with torch.autocast(q.device.type, enabled=False):
            m = attn_mask.float() if additive else attn_mask
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m,
                                                 dropout_p=drop, is_causal=causal, scale=mod.scale)
        return out.to(v.dtype)
    if additive:
        attn_mask = attn_mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop,
                                          is_causal=causal, scale=mod.scale)


class Attention(nn.Module):
    """Multi-head self-attention with timm's parameter names (qkv, q_norm, k_norm, proj)."""

    def __init__(self, dim: int, num_heads: int, *, attn_cfg, norm_cfg, seq_len: int,
                 qkv_bias: bool = True, proj_bias: bool = True, causal: bool = False,
                 attn_fp32: bool = False, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ConfigError(f"width {dim} is not divisible by {num_heads} heads")
        self.num_heads, self.head_dim, self.causal, self.attn_fp32 = num_heads, dim // num_heads, causal, attn_fp32
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm, self.k_norm, self.scale = qk_transform(attn_cfg, norm_cfg, self.head_dim, seq_len)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        self.probe: Optional[dict] = None

    @property
    def entropy_bound_applies(self) -> bool:
        """Whether the monitors may log Theorem 3.1's entropy bound, which holds for the logits
        ``q . k / sqrt(d_h)`` of raw ``q, k``: not where q and k are normalised (qknorm, StableAtten)."""
        return (isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)
                and math.isclose(self.scale, self.head_dim**-0.5))

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = attend(self, x, q, k, v, attn_mask, self.causal or is_causal)
        return self.proj_drop(self.proj(o.transpose(1, 2).reshape(b, t, c)))


class SwinAttention(WindowAttention):
    """timm's window attention (relative position bias, shift mask) with our q/k variants."""

    causal = False
    # the relative position bias and the shift mask enter the logits: Theorem 3.1 bounds plain
    # ``q . k`` logits only, so the monitors log no entropy bound for these blocks
    entropy_bound_applies = False

    @classmethod
    def from_timm(cls, old: WindowAttention, *, attn_cfg, norm_cfg, attn_fp32: bool) -> "SwinAttention":
        new = cls(old.dim, old.num_heads, window_size=old.window_size, qkv_bias=old.qkv.bias is not None,
                  attn_drop=old.attn_drop.p, proj_drop=old.proj_drop.p)
        new.load_state_dict(old.state_dict())
        head_dim = old.qkv.out_features // (3 * old.num_heads)
        new.q_norm, new.k_norm, new.scale = qk_transform(attn_cfg, norm_cfg, head_dim, new.window_area)
        new.attn_fp32, new.probe = attn_fp32, None
        return new.to(old.qkv.weight.device)

    @property
    def head_dim(self) -> int:
        return self.qkv.out_features // (3 * self.num_heads)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self._get_rel_pos_bias()
        if self.probe is not None:  # attend() is given the position bias, which masks no key
            self.probe["key_mask"] = None
        if mask is not None:
            nw = mask.shape[0]
            if self.probe is not None:  # the keys of the query's own region (timm masks the rest with -100)
                keep = (mask == 0).view(1, nw, 1, n, n).expand(b // nw, -1, -1, -1, -1)
                self.probe["key_mask"] = keep.reshape(b, 1, n, n)
            mask = mask.view(1, nw, 1, n, n).expand(b // nw, -1, self.num_heads, -1, -1)
            bias = bias + mask.reshape(-1, self.num_heads, n, n)
        o = attend(self, x, q, k, v, bias, False)
        return self.proj_drop(self.proj(o.transpose(1, 2).reshape(b, n, -1)))
