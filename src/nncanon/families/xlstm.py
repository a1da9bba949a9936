"""xLSTM: mLSTM blocks (a gated matrix-memory recurrence, no attention) with a gated MLP.

``h = x + mlstm_layer(norm_mlstm(x)); y = h + ffn(norm_ffn(h))`` on ``backbone.blocks``. The mLSTM
layer is the token mixer (served as ``linear_attn``); it returns ``(out, state)`` and its per-head
output, normalised per head (``multihead_norm``) and gated, feeds ``out_proj``: ``out_proj``'s
input is served per head (``num_heads``). A block takes its recurrent state ``(C, n, m)`` and
returns it updated, ``(hidden, state)``; the model copies it into its cache, so a skipped block
hands back the state it was given. The logits are soft-capped by ``output_logit_soft_cap``.
Prompts longer than ``max_inference_chunksize`` run every block once per chunk.
"""

from ..served import Site
from .base import Embeddings, Family, LogitStep

XLSTM = Family(
    name="xlstm",
    model_types=("xlstm",),
    embeddings=Embeddings(positions_kind="recurrent"),
    casts_head_input=True,
    layers="backbone.blocks",
    embed_tokens="backbone.embeddings",
    norm="backbone.out_norm",
    attention=None,
    mixer="mlstm_layer",
    mixer_output=Site("mlstm_layer", index=0),
    mixer_head_outputs=Site("mlstm_layer.out_proj", key="input"),
    mixer_heads="num_heads",
    mlp="ffn",
    mlp_output=Site("ffn"),
    block_extras=1,
    passes_state=True,
    logit_steps=(LogitStep("softcap", "output_logit_soft_cap"),),
    residual="h = x + mlstm_layer(norm_mlstm(x)); y = h + ffn(norm_ffn(h))",
)

FAMILIES = [XLSTM]
