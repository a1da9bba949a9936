"""Falcon-H1: a Mamba-2 mixer and softmax attention side by side in every block, then an MLP.

``h = x + s·mamba(n) + a·self_attn(i·n); y = h + feed_forward(pre_ff_layernorm(h))`` with
``n = input_layernorm(x)``, ``s = ssm_out_multiplier``, ``a = attention_out_multiplier`` and
``i = attention_in_multiplier`` (it scales attention's input, so it is inside ``self_attn``'s
values already). The block scales both mixers' outputs before adding them: the contributions are
``s·mamba`` (``linear_attention_output``) and ``a·self_attn`` (``attention_output``), and a write is
divided back by the factor (only the elements the user changed). ``feed_forward`` applies its own
``mlp_multipliers`` inside. The block runs the Mamba mixer first (``component_order``: in one trace,
read its values before attention's) and returns a 1-tuple. The logits are ``lm_head(norm(h))``
times ``lm_head_multiplier``; ``embedding_multiplier`` scales the embeddings before block 0.
"""

from ..served import Site
from .base import Embeddings, Family, LogitStep

FALCON_H1 = Family(
    name="falcon_h1",
    model_types=("falcon_h1",),
    embeddings=Embeddings(scale="embedding_multiplier"),
    norm="model.final_layernorm",
    mixer="mamba",
    mixer_output=Site("mamba", scale="ssm_out_multiplier"),
    mixer_head_outputs=Site("mamba.out_proj", key="input"),
    mixer_heads="mamba_n_heads",
    attention_output=Site("self_attn", index=0, scale="attention_out_multiplier"),
    mlp="feed_forward",
    mlp_output=Site("feed_forward"),
    block_tuple=True,
    component_order=("linear_attn", "self_attn", "mlp"),
    logit_steps=(LogitStep("multiply", "lm_head_multiplier"),),
    residual=(
        "h = x + ssm_out_multiplier·mamba(n) + attention_out_multiplier·self_attn(attention_in_multiplier·n), "
        "n = input_layernorm(x); y = h + feed_forward(pre_ff_layernorm(h))"
    ),
)

FAMILIES = [FALCON_H1]
