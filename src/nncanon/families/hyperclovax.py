"""HyperCLOVA X: a Llama block with Peri-LN post-norms and a residual multiplier.

``h = x + r·post_norm1(self_attn(input_layernorm(x)))``;
``y = h + r·post_norm2(mlp(post_attention_layernorm(h)))``, ``r = residual_multiplier``.
The contributions are ``r`` times the post-norms' outputs (``post_norm1``/``post_norm2`` are
``nn.Identity`` when ``use_post_norm`` is off, so the same sites serve both). The embeddings are
multiplied by ``embedding_multiplier`` before block 0, and the logits are
``lm_head(norm(h)) · logits_scaling``.
"""

from ..served import Site
from .base import Embeddings, Family, LogitStep

HYPERCLOVAX = Family(
    name="hyperclovax",
    model_types=("hyperclovax",),
    embeddings=Embeddings(scale="embedding_multiplier"),
    attention_output=Site("post_norm1", scale="residual_multiplier"),
    mlp_output=Site("post_norm2", scale="residual_multiplier"),
    logit_steps=(LogitStep("multiply", "logits_scaling"),),
    residual=(
        "h = x + r·post_norm1(attn(input_layernorm(x))); "
        "y = h + r·post_norm2(mlp(post_attention_layernorm(h))), r = residual_multiplier"
    ),
)

FAMILIES = [HYPERCLOVAX]
