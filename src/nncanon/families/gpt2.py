"""GPT-2 and GPT-BigCode: ``transformer.h`` blocks, ``attn`` and ``mlp`` modules, Conv1D or Linear."""

from ..served import Site
from .base import Family

GPT2 = Family(
    name="gpt2",
    model_types=("gpt2", "gpt_bigcode"),
    layers="transformer.h",
    embed_tokens="transformer.wte",
    norm="transformer.ln_f",
    attention="attn",
    attention_output=Site("attn", index=0),
    head_outputs=Site("attn.c_proj", key="input"),
    residual="h = x + attn(ln_1(x)); y = h + mlp(ln_2(h))",
)

FAMILIES = [GPT2]
