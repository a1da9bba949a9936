"""Token mixers that are not softmax attention: gated DeltaNet, KDA, Lightning, Mamba, short convolutions, RG-LRU."""

from __future__ import annotations

from nnsight.intervention.envoy import Envoy

from ..served import served
from .base import Component
from .norms import norm_values


class LinearAttentionEnvoy(Component, Envoy):
    """A block's linear-attention or state-space mixer: ``model.layers[i].linear_attn``.

    - ``linear_attention_norm_scale`` ``[batch, seq, 1]``, ``linear_attention_normalized`` ``[batch, seq, hidden]``:
      the norm before the mixer (`nncanon.components.norms`).
    - ``linear_attention_input`` ``[batch, seq, hidden]``: what the mixer module receives (the normed stream).
    - ``linear_attention_head_outputs`` ``[batch, seq, heads, head_dim]``: each head's output before
      the mixer's output projection, where the mixer has per-head structure there.
    - ``linear_attention_post_norm_scale`` ``[batch, seq, 1]``: the scale of the norm on the mixer's output before
      it is added (LFM3's ``post_operator_norm``), where the block has one.
    - ``linear_attention_output`` ``[batch, seq, hidden]``: exactly what the mixer adds to the
      residual stream.
    """

    role = "linear_attn"
    standard_values = ("linear_attention_norm_scale", "linear_attention_normalized", "linear_attention_input",
                       "linear_attention_head_outputs", "linear_attention_post_norm_scale", "linear_attention_output")
    locals().update(norm_values("linear_attn"))

    linear_attention_input = served(
        "linear_attention_input",
        "what the mixer module receives: the normed stream [b, s, d]",
        "The linear-attention / state-space mixer's input, ``[batch, seq, hidden]``: the stream after the block's "
        "norm, with the norm's weight. Writable.",
    )
    linear_attention_head_outputs = served(
        "linear_attention_head_outputs",
        "per-head outputs before the mixer's output projection [b, s, H, head_dim]",
        "Each head's output before the mixer's output projection, ``[batch, seq, heads, head_dim]``. Writable.",
    )
    linear_attention_output = served(
        "linear_attention_output",
        "what the mixer adds to the residual stream [b, s, d]",
        "Exactly what the linear-attention / state-space mixer adds to the residual stream, "
        "``[batch, seq, hidden]``. Writable.",
    )
