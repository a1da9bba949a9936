"""Post-norm blocks: each sublayer's output is normed before it joins the stream.

OLMo-2, OLMo-3 and EXAONE-4 have no pre-norm at all (attention reads the raw stream):
``h = x + post_attention_layernorm(self_attn(x)); y = h + post_feedforward_layernorm(mlp(h))``.
GLM-4 is a sandwich: ``h = x + post_self_attn_layernorm(self_attn(input_layernorm(x)))``;
``y = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))``. Mind the names: in GLM-4,
as in Llama, ``post_attention_layernorm`` is the pre-MLP norm on the stream, while in OLMo-2/3
and EXAONE-4 it is the norm on attention's output.

The contributions are the outputs of those norms, not of the attention or MLP modules.
"""

from ..served import Site
from .base import Family

OLMO2 = Family(
    name="olmo2",
    model_types=("olmo2", "olmo3", "exaone4"),
    attention_output=Site("post_attention_layernorm"),
    mlp_output=Site("post_feedforward_layernorm"),
    residual="h = x + post_attention_layernorm(attn(x)); y = h + post_feedforward_layernorm(mlp(h))",
)

GLM4 = Family(
    name="glm4",
    model_types=("glm4",),
    attention_output=Site("post_self_attn_layernorm"),
    mlp_output=Site("post_mlp_layernorm"),
    residual=(
        "h = x + post_self_attn_layernorm(attn(input_layernorm(x))); "
        "y = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))"
    ),
)

FAMILIES = [OLMO2, GLM4]
