"""MiniCPM3: a Llama block with multi-head latent attention (DeepSeek-V2's MLA), scaled for depth.

``h = x + r·self_attn(input_layernorm(x)); y = h + r·mlp(post_attention_layernorm(h))`` with
``r = scale_depth / sqrt(num_hidden_layers)``: no module outputs the contribution, so it is served as
``r`` times the module's output, and a write is divided by ``r`` on the way back. The embeddings are
scaled by ``scale_emb`` inside ``embed_tokens``, and the last stream, after the final norm, is divided
by ``logits_scaling = hidden_size / dim_model_base`` before ``lm_head``. The heads are ``o_proj``'s
input, ``v_head_dim`` wide.
"""

import math

from ..served import Site
from .base import Family, LogitStep


def _residual_scale(config) -> float:
    """`scale_depth / sqrt(num_hidden_layers)`"""
    return config.scale_depth / math.sqrt(config.num_hidden_layers)


MINICPM3 = Family(
    name="minicpm3",
    model_types=("minicpm3",),
    attention_output=Site("self_attn", index=0, scale=_residual_scale),
    mlp_output=Site("mlp", scale=_residual_scale),
    logit_steps=(LogitStep("divide_input", "logits_scaling"),),
    residual="h = x + r·attn(input_layernorm(x)); y = h + r·mlp(post_attention_layernorm(h)), "
    "r = scale_depth / sqrt(num_hidden_layers)",
)

FAMILIES = [MINICPM3]
