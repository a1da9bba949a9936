"""GPT-J and CodeGen: parallel blocks with one LayerNorm feeding both attention and MLP."""

from ..served import Site
from .base import Family

GPTJ = Family(
    name="gptj",
    model_types=("gptj", "codegen"),
    layers="transformer.h",
    embed_tokens="transformer.wte",
    norm="transformer.ln_f",
    attention="attn",
    attention_output=Site("attn", index=0),
    head_outputs=Site("attn.out_proj", key="input"),
    residual="n = ln_1(x); y = x + attn(n) + mlp(n)",
)

FAMILIES = [GPTJ]
