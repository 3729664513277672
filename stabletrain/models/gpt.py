"""A nanoGPT-style GPT written with the shared Block (causal attention through SDPA).

GPT-2 conventions (docs/methods.md §6): learned position embeddings, tied input/output
embeddings, GELU MLP x4, ``bias=False`` removes LayerNorm and Linear biases, init
N(0, 0.02) with the residual projections (attn.proj, mlp.fc2) scaled by 1/sqrt(2 n_layer).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from stabletrain.config import FAMILY_KEYS, Components, shown_value
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


# nanoGPT's block names (Hugging Face's GPT-2 has the same) -> this GPT's
_THEIR_NAMES = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
                "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
# Hugging Face keeps these as Conv1D weights, (in, out)
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# nanoGPT's model_args and Hugging Face's config.json -> model.* keys
_THEIR_ARGS = {"n_layer": "depth", "n_head": "num_heads", "n_embd": "embed_dim", "block_size": "block_size",
               "n_positions": "block_size", "vocab_size": "vocab_size", "bias": "bias", "n_inner": "mlp_hidden"}
_THEIR_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
# config.json options of Hugging Face's GPT-2 that change its function, which this GPT has no setting for:
# its value of each (Hugging Face's default)
_THEIR_FIXED = {"layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}


def _their_name(k: str) -> str:
    k = k.removeprefix("transformer.")
    if k.startswith("ln_f."):
        return "norm." + k[5:]
    if k.startswith("h."):
        i, rest = k[2:].split(".", 1)
        layer, _, leaf = rest.rpartition(".")
        return f"blocks.{i}.{_THEIR_NAMES.get(layer, layer)}.{leaf}"
    return k


def _listed(items: list[str]) -> str:
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 2 else items)


def gpt_weights(state: dict[str, Tensor], settings: dict, m, _model=None) -> tuple[dict[str, Tensor], dict, list[str]]:
    """A GPT checkpoint as this GPT's tensors (``init_weights``): nanoGPT's (its ckpt.pt, a
    from_pretrained model's state dict) and Hugging Face's GPT-2 renamed, the latter's Conv1D weights
    transposed and its causal-mask buffers dropped, with the settings they state as ``model.*`` keys;
    and the position embedding of a longer context cut to ``block_size`` (nanoGPT's crop_block_size:
    the function of every sequence that fits is kept); an untied ``lm_head`` is left out, this GPT's is
    its ``wte``. Returns ``(state, settings, how they were read)``."""
    read_as = []
    if any(k.startswith(("transformer.", "h.", "ln_f.")) for k in state):
        conv1d = any(k.endswith("attn.c_attn.weight") and v.ndim == 2 and v.shape[1] == 3 * v.shape[0]
                     for k, v in state.items())
        state = {_their_name(k): v.t() if conv1d and k.endswith(_CONV1D) else v for k, v in state.items()
                 if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # the causal mask, not a weight
        theirs = {_THEIR_ARGS[k]: v for k, v in settings.items() if k in _THEIR_ARGS and v is not None}
        if settings:  # nanoGPT's MLP is nn.GELU; a config.json leaves out Hugging Face's default, gelu_new
            act = settings.get("activation_function", "gelu_new" if conv1d else "gelu")
            theirs["act"] = _THEIR_ACTS.get(act, act)
        # Hugging Face's config.json has no bias key (GPT-2 has biases): the tensors say
        theirs.setdefault("bias", any(k.endswith(".attn.qkv.bias") for k in state))
        read_as.append("Hugging Face GPT-2's tensors, its Conv1D weights transposed" if conv1d else "nanoGPT's tensors")
        other = [k for k, ours in _THEIR_FIXED.items() if k in settings and settings[k] != ours]
        if other:  # loaded all the same: the nearest function there is here, said
            theirs_said = _listed([f"{k}={shown_value(settings[k])}" for k in other])
            ours_said = _listed([shown_value(_THEIR_FIXED[k]) for k in other])
            read_as.append(f"its config.json's {theirs_said}, which this GPT does not have ({ours_said} here): "
                           "the function they compute here is another")
        settings = theirs
    lm_head, wte = state.get("lm_head.weight"), state.get("wte.weight")
    # this GPT ties them: of an untied source's two, loading both would keep whichever loads last, unsaid
    if lm_head is not None and wte is not None and not (lm_head.shape == wte.shape and torch.equal(lm_head, wte)):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        read_as.append("its untied lm_head.weight left out: this GPT's output layer is its wte.weight")
    if "lm_head.weight" not in state and wte is not None:  # tied, so saved once
        state = {**state, "lm_head.weight": wte}
    wpe = state.get("wpe.weight")
    refused = []  # (what the source has, the setting that fits it): named together, not one per try
    if wte is not None and wte.ndim == 2 and wte.shape[0] != m.vocab_size:
        refused.append((f"a vocabulary of {wte.shape[0]} tokens (wte.weight; model.vocab_size={m.vocab_size} here)",
                        f"model.vocab_size={wte.shape[0]}"))
    if wpe is not None and wpe.ndim == 2 and wpe.shape[0] < m.block_size:
        refused.append((f"{wpe.shape[0]} positions (wpe.weight; model.block_size={m.block_size} here)",
                        f"model.block_size={wpe.shape[0]} (or less)"))
    if not m.bias and any(k.endswith(".attn.qkv.bias") for k in state):  # dropped, they take its function along
        refused.append(("biases in its layers (model.bias=false here)", "model.bias=true"))
    if refused:
        act = settings.get("act")
        also = f" (and model.act={act}, its activation)" if act is not None and act != m.act else ""
        raise ConfigError(f"it has {' and '.join(a for a, _ in refused)}; set {' '.join(b for _, b in refused)}{also}")
    if wpe is not None and wpe.ndim == 2 and wpe.shape[0] > m.block_size:
        state = {**state, "wpe.weight": wpe[:m.block_size]}
        settings = {**settings, "block_size": m.block_size}  # the function of what fits is the same
        read_as.append(f"its first {m.block_size} of {wpe.shape[0]} positions")
    return state, settings, read_as


@MODELS.register("gpt", kind="text", data="pytext", check=check_gpt, flops=gpt_flops, tau=0.01,  # 000 Table 2
                 no_decay=(),  # nanoGPT decays every matrix, its position embedding too
                 weights=gpt_weights,
                 keys=FAMILY_KEYS["gpt"])
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
