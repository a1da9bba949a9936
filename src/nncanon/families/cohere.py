"""Cohere (Command-R), Cohere-2 and Cohere Compass: parallel blocks with one LayerNorm.

``n = input_layernorm(x); y = x + self_attn(n) + mlp(n)``: the module outputs are the
contributions. The logits are ``lm_head(norm(h)) · logit_scale`` (Compass: when set).
"""

from .base import Family, LogitStep

COHERE = Family(
    name="cohere",
    model_types=("cohere", "cohere2", "cohere_compass_text"),
    logit_steps=(LogitStep("multiply", "logit_scale"),),
    residual="n = input_layernorm(x); y = x + attn(n) + mlp(n)",
)

FAMILIES = [COHERE]
