"""Phi (parallel, one LayerNorm) and Persimmon (sequential): ``model.layers``, ``self_attn.dense``.

Fuyu is Persimmon under ``model.language_model`` with a linear patch embedding beside it.
"""

from dataclasses import replace

from ..served import Site
from .base import Family

PHI = Family(
    name="phi",
    model_types=("phi",),
    norm="model.final_layernorm",
    head_outputs=Site("self_attn.dense", key="input"),
    residual="n = input_layernorm(x); y = x + self_attn(n) + mlp(n)",
)

PERSIMMON = Family(
    name="persimmon",
    model_types=("persimmon",),
    norm="model.final_layernorm",
    head_outputs=Site("self_attn.dense", key="input"),
    residual="h = x + self_attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))",
)

FUYU = replace(
    PERSIMMON,
    name="fuyu",
    model_types=("fuyu",),
    layers="model.language_model.layers",
    embed_tokens="model.language_model.embed_tokens",
    norm="model.language_model.final_layernorm",
)

FAMILIES = [PHI, PERSIMMON, FUYU]
