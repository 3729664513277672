"""The transformer block shared by ViT and GPT, with timm's module names.

With the default components it computes exactly timm's pre-norm ``Block`` (same names:
norm1, attn, ls1, drop_path1, norm2, mlp, ls2, drop_path2), so timm weights load into it.
``norm.placement=post`` gives the classic post-LN block ``x = LN(x + f(x))``; de-escalation
sits at the end of the block (``block``) or on the residual stream entering the FFN
(``ffn``; SPEC section 3).
"""

from __future__ import annotations

from typing import Optional

from timm.layers import DropPath, Mlp
from torch import Tensor, nn

from stabletrain.layers.attention import Attention
from stabletrain.layers.deescalate import make_deescalate
from stabletrain.layers.norm import _enum, make_norm


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, *, components, seq_len: int,
                 causal: bool = False, qkv_bias: bool = True, proj_bias: bool = True,
                 mlp_hidden: Optional[int] = None, act_layer=nn.GELU, drop_path: float = 0.0,
                 proj_drop: float = 0.0, attn_drop: float = 0.0, ln_eps: float = 1e-5,
                 norm_bias: bool = True, **_timm_kwargs):
        super().__init__()
        c = components
        self.post = _enum(c.norm.placement) == "post"
        self.norm1 = make_norm(c.norm, dim, bias=norm_bias, ln_eps=ln_eps)
        self.attn = Attention(dim, num_heads, attn_cfg=c.attention, norm_cfg=c.norm, seq_len=seq_len,
                              qkv_bias=qkv_bias, proj_bias=proj_bias, causal=causal,
                              attn_fp32=c.reparam.attn_fp32, attn_drop=attn_drop, proj_drop=proj_drop)
        self.ls1 = nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = make_norm(c.norm, dim, bias=norm_bias, ln_eps=ln_eps)
        self.mlp = Mlp(dim, mlp_hidden or int(dim * mlp_ratio), act_layer=act_layer, bias=proj_bias, drop=proj_drop)
        self.ls2 = nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.deesc_at, self.deesc = make_deescalate(c.deescalate, causal)

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, **_) -> Tensor:
        if self.post:
            x = self.norm1(x + self.drop_path1(self.ls1(self.attn(x, attn_mask))))
        else:
            x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask)))
        if self.deesc_at == "ffn":
            x = self.deesc(x)
        if self.post:
            x = self.norm2(x + self.drop_path2(self.ls2(self.mlp(x))))
        else:
            x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        if self.deesc_at == "block":
            x = self.deesc(x)
        return x
