"""BLOOM: the attention and MLP modules add the residual themselves, so the contributions are
their output projections (``self_attention.dense``, ``mlp.dense_4h_to_h``).

Attention is computed inline (ALiBi, no attention interface); the probabilities are read at the
assignment after dropout, where they are still ``[b, H, q, k]`` before the ``bmm``.
``apply_residual_connection_post_layernorm=True`` adds each sublayer to the *normed* stream, and
``pretraining_tp > 1`` with ``slow_but_exact`` bypasses the projection modules: both are declined.
"""

from typing import Any

from ..served import Site
from .base import Family


def _declines(config: Any, layer: int) -> dict:
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        reason = (
            "this BLOOM configuration sets apply_residual_connection_post_layernorm=True: each sublayer is "
            "added to the normed stream, not to layer_input, so no tensor is what {what} adds to the stream"
        )
    elif getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
        reason = (
            "this BLOOM configuration sets pretraining_tp > 1 with slow_but_exact=True: {what} bypasses its "
            "output projection module (F.linear on weight slices, without the bias), so no module returns it"
        )
    else:
        return {}
    return {
        "attention_output": reason.format(what="attention"),
        "mlp_output": reason.format(what="the MLP"),
    }


BLOOM = Family(
    name="bloom",
    model_types=("bloom",),
    layers="transformer.h",
    embed_tokens="transformer.word_embeddings",
    norm="transformer.ln_f",
    attention="self_attention",
    attention_output=Site("self_attention.dense"),
    mlp_output=Site("mlp.dense_4h_to_h"),
    head_outputs=Site("self_attention.dense", key="input"),
    probabilities=("attention_probs_1",),
    block_extras=1,
    residual=(
        "h = self_attention(input_layernorm(x), residual=x) = x + dense(ctx); "
        "y = mlp(post_attention_layernorm(h), residual=h) = h + dense_4h_to_h(gelu(...))"
    ),
    declines=_declines,
)

FAMILIES = [BLOOM]
