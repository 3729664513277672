"""A nanoGPT-style GPT written with the shared Block (causal attention through SDPA).

GPT-2 conventions (docs/methods.md §6): learned position embeddings, tied input/output
embeddings, GELU MLP x4, ``bias=False`` removes LayerNorm and Linear biases, init
N(0, 0.02) with the residual projections (attn.proj, mlp.fc2) scaled by 1/sqrt(2 n_layer).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stabletrain.config import Components
from stabletrain.errors import ConfigError
from stabletrain.layers.block import Block
from stabletrain.layers.deescalate import DEESCALATIONS
from stabletrain.layers.norm import make_norm
from stabletrain.models.registry import MODELS
from stabletrain.models.vit import act_layer, check_heads
from stabletrain.registry import option_value


def check_gpt(m, components: Components) -> None:
    check_heads(m, components)
    d = components.deescalate
    if d.causal is False and DEESCALATIONS.entry(d.name).info.get("active", True):
        raise ConfigError("deescalate.causal=false would mix later tokens into earlier ones in a causal GPT "
                          "(the full-sequence mean sees the future); leave deescalate.causal null")


def gpt_flops(model: nn.Module, m) -> float:
    """Training FLOPs of one sequence of ``block_size`` tokens, as nanoGPT counts them:
    ``(6 N + 12 L d T) T`` with ``N`` the parameters without the position embedding (the tied
    output layer counted once) and ``12 L d T`` per token for the attention scores and mixing."""
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    t = m.block_size
    return (6 * n + 12 * m.depth * m.embed_dim * t) * t


@MODELS.register("gpt", kind="text", data="pytext", check=check_gpt, flops=gpt_flops, tau=0.01,  # 000 Table 2
                 no_decay=(),  # nanoGPT decays every matrix, its position embedding too
                 keys=("vocab_size", "block_size", "bias", "dropout", "embed_dim", "depth", "num_heads", "mlp_ratio",
                       "mlp_hidden", "act"))
class GPT(nn.Module):
    """GPT from ``m`` (the ``model`` group) built of :class:`Block` with ``components``.

    ``model.dropout`` sits where nanoGPT has it: on the embeddings, the attention
    probabilities, and after each residual branch's output projection (none inside the MLP).
    """

    def __init__(self, m, components: Components | None = None):
        super().__init__()
        cfg = components or Components()
        self.block_size = m.block_size
        self.wte = nn.Embedding(m.vocab_size, m.embed_dim)
        self.wpe = nn.Embedding(m.block_size, m.embed_dim)
        self.drop = nn.Dropout(m.dropout)
        self.blocks = nn.ModuleList(
            Block(m.embed_dim, m.num_heads, m.mlp_ratio, components=cfg, seq_len=m.block_size, causal=True,
                  qkv_bias=m.bias, proj_bias=m.bias, mlp_hidden=m.mlp_hidden, norm_bias=m.bias,
                  act_layer=act_layer(m.act),
                  proj_drop=m.dropout, attn_drop=m.dropout, mlp_drop=(0.0, m.dropout), ln_eps=1e-5)
            for _ in range(m.depth)
        )
        post = option_value(cfg.norm.placement) == "post"
        self.norm = nn.Identity() if post else make_norm(cfg.norm, m.embed_dim, bias=m.bias, ln_eps=1e-5)
        self.lm_head = nn.Linear(m.embed_dim, m.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)
        resid_std = 0.02 / math.sqrt(2 * m.depth)
        for blk in self.blocks:
            nn.init.normal_(blk.attn.proj.weight, std=resid_std)
            nn.init.normal_(blk.mlp.fc2.weight, std=resid_std)

    @staticmethod
    def _init(mod: nn.Module) -> None:
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            nn.init.normal_(mod.weight, std=0.02)
            if getattr(mod, "bias", None) is not None:
                nn.init.zeros_(mod.bias)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))

    @staticmethod
    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
