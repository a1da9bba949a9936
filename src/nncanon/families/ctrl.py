"""CTRL: ``transformer.h`` blocks with ``multi_head_attention`` and a ``Sequential`` ``ffn``."""

from ..served import Site
from .base import Family

CTRL = Family(
    name="ctrl",
    model_types=("ctrl",),
    layers="transformer.h",
    embed_tokens="transformer.w",
    norm="transformer.layernorm",
    attention="multi_head_attention",
    mlp="ffn",
    attention_output=Site("multi_head_attention", index=0),
    mlp_output=Site("ffn"),
    head_outputs=Site("multi_head_attention.dense", key="input"),
    residual="h = x + multi_head_attention(layernorm1(x)); y = h + ffn(layernorm2(h))",
)

FAMILIES = [CTRL]
