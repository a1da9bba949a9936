"""CTRL: ``transformer.h`` blocks with ``multi_head_attention`` and a ``Sequential`` ``ffn``."""

import math

from ..served import Site
from .base import Embeddings, Family

#: CTRL's positions: sinusoids indexed from a buffer inline in its forward.
_SINUSOIDS = ("its sinusoidal position encodings are rows of a buffer (pos_encoding) that CTRLModel.forward indexes "
              "inline and adds to the stream: no module outputs them, so there is no site to serve them at (they are "
              "layers[0].layer_input - token_embeddings · sqrt(n_embd))")


def _entering(model, tokens, positions):
    """``tokens · sqrt(n_embd) + pos_encoding[position]``, as CTRLModel.forward makes it (positions from 0)."""
    inner = model.transformer
    table = inner.pos_encoding.to(device=tokens.device, dtype=tokens.dtype)
    return tokens * math.sqrt(inner.d_model_size) + table[: tokens.shape[1]]


CTRL = Family(
    name="ctrl",
    model_types=("ctrl",),
    embeddings=Embeddings(positions_kind=_SINUSOIDS, in_place=True, combine=_entering),
    layers="transformer.h",
    embed_tokens="transformer.w",
    norm="transformer.layernorm",
    attention="multi_head_attention",
    mlp="ffn",
    attention_output=Site("multi_head_attention", index=0),
    mlp_output=Site("ffn"),
    head_outputs=Site("multi_head_attention.dense", key="input"),
    residual="h = x + multi_head_attention(layernorm1(x)); y = h + ffn(layernorm2(h))",
)

FAMILIES = [CTRL]
