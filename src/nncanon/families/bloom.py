"""BLOOM: the attention and MLP modules add the residual themselves, so the contributions are
their output projections (``self_attention.dense``, ``mlp.dense_4h_to_h``).

Attention is computed inline (ALiBi, no attention interface); the probabilities are read at the
assignment after dropout, where they are still ``[b, H, q, k]`` before the ``bmm``.
``apply_residual_connection_post_layernorm=True`` adds each sublayer to the *normed* stream, and
``pretraining_tp > 1`` with ``slow_but_exact`` bypasses the projection modules: both are declined.

The kernel's per-head inputs are the query and key of ``alibi.baddbmm(batch1=query, batch2=keyᵀ,
beta=1, alpha=1/√head_dim)`` and the values of the ``torch.bmm`` with the probabilities, all with the
heads folded into the batch (``[b·H, s, head_dim]``), served ``[b, s, H, head_dim]`` views; keys and
values after the cache. ALiBi is the module's ``alibi`` argument, added to the scaled scores.
"""

from typing import Any

from ..components.kernel import split_kernel
from ..served import Site
from .base import Embeddings, Family


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


def _alpha(module: Any, kwargs: dict, head_dim: int) -> float:
    """The ``alpha`` of its ``baddbmm`` (``1/√head_dim``)."""
    return kwargs["alpha"]


BLOOM = Family(
    name="bloom",
    model_types=("bloom",),
    embeddings=Embeddings(positions_kind="alibi", norm="transformer.word_embeddings_layernorm"),
    layers="transformer.h",
    embed_tokens="transformer.word_embeddings",
    norm="transformer.ln_f",
    attention="self_attention",
    attention_output=Site("self_attention.dense"),
    mlp_output=Site("mlp.dense_4h_to_h"),
    head_outputs=Site("self_attention.dense", key="input"),
    probabilities=("attention_probs_1",),
    kernel=split_kernel("alibi_baddbmm_0", "torch_bmm_0", ("batch1", "batch2", 1), _alpha,
                        "its alibi.baddbmm(batch1=query, batch2=keyᵀ) and torch.bmm(probabilities, value)",
                        batch_heads=True, bias="alibi"),
    block_extras=1,
    residual=(
        "h = self_attention(input_layernorm(x), residual=x) = x + dense(ctx); "
        "y = mlp(post_attention_layernorm(h), residual=h) = h + dense_4h_to_h(gelu(...))"
    ),
    declines=_declines,
)

FAMILIES = [BLOOM]
