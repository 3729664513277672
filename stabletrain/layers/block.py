"""The transformer block every family shares: one residual arrangement, written once.

:class:`BlockForward` is the arrangement: pre-norm ``x + f(norm(x))`` or, with
``norm.placement=post``, the classic post-LN ``norm(x + f(x))``, for the attention and the MLP
sub-layers, with de-escalation at the end of the block (``block``) or on the residual stream
entering the FFN (``ffn``; docs/methods.md §3). A family's block supplies only its two
branches: :class:`Block` (ViT, GPT) attends over the whole sequence; Swin's block
(``stabletrain.models.swin``) attends in shifted windows. A block-level fix written here
works in all three families.

With the default components :class:`Block` computes exactly timm's pre-norm ``Block`` (same
names: norm1, attn, ls1, drop_path1, norm2, mlp, ls2, drop_path2), so timm weights load into it.
"""

from __future__ import annotations

from typing import Optional

from timm.layers import DropPath, Mlp
from torch import Tensor, nn

from stabletrain.layers.attention import Attention
from stabletrain.layers.deescalate import make_deescalate
from stabletrain.layers.norm import make_norm
from stabletrain.registry import option_value


class BlockForward:
    """The residual arrangement; a block sets ``post``, ``deesc_at`` and ``deesc`` (see
    :meth:`set_components`) and defines ``attention_branch`` and ``mlp_branch``."""

    post: bool
    deesc_at: str

    def set_components(self, components, causal: bool) -> None:
        self.post = option_value(components.norm.placement) == "post"
        self.deesc_at, self.deesc = make_deescalate(components.deescalate, causal)

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        # a recent timm's VisionTransformer passes both to each block where a caller gives either
        x = self._sublayer(x, self.norm1, self.drop_path1, self.attention_branch, attn_mask, is_causal)
        if self.deesc_at == "ffn":
            x = self.deesc(x)
        x = self._sublayer(x, self.norm2, self.drop_path2, self.mlp_branch)
        if self.deesc_at == "block":
            x = self.deesc(x)
        return x

    def _sublayer(self, x: Tensor, norm: nn.Module, drop_path: nn.Module, branch, *args) -> Tensor:
        if self.post:
            return norm(x + drop_path(branch(x, *args)))
        return x + drop_path(branch(norm(x), *args))


class Block(BlockForward, nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, *, components, seq_len: int,
                 causal: bool = False, qkv_bias: bool = True, proj_bias: bool = True,
                 mlp_hidden: Optional[int] = None, act_layer=nn.GELU, drop_path: float = 0.0,
                 proj_drop: float = 0.0, attn_drop: float = 0.0, ln_eps: float = 1e-5,
                 norm_bias: bool = True, mlp_drop: float | tuple[float, float] | None = None, **_timm_kwargs):
        super().__init__()
        c = components
        self.norm1 = make_norm(c.norm, dim, bias=norm_bias, ln_eps=ln_eps)
        self.attn = Attention(dim, num_heads, attn_cfg=c.attention, norm_cfg=c.norm, seq_len=seq_len,
                              qkv_bias=qkv_bias, proj_bias=proj_bias, causal=causal,
                              attn_fp32=c.reparam.attn_fp32, attn_drop=attn_drop, proj_drop=proj_drop)
        self.ls1 = nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = make_norm(c.norm, dim, bias=norm_bias, ln_eps=ln_eps)
        hidden = mlp_hidden or int(dim * mlp_ratio)
        if hidden < 1:  # timm's Mlp reads a width of 0 as "none given" and builds one as wide as dim
            raise ValueError(f"Block: mlp_ratio={mlp_ratio:g} makes the MLP {hidden} wide at dim={dim}")
        self.mlp = Mlp(dim, hidden, act_layer=act_layer, bias=proj_bias,
                       drop=proj_drop if mlp_drop is None else mlp_drop)
        self.ls2 = nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.set_components(c, causal)

    def attention_branch(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        return self.ls1(self.attn(x, attn_mask, is_causal))

    def mlp_branch(self, x: Tensor) -> Tensor:
        return self.ls2(self.mlp(x))
