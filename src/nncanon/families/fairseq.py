"""Fairseq-style decoders, XGLM and BioGPT: ``self_attn`` and an inline ``fc1``/``fc2`` MLP on the block.

XGLM computes attention inline (``bmm`` over ``(b·H, q, k)``); its probabilities are read where
they are still ``[b, H, q, k]``, at the assignment ``attn_weights_reshaped = ...``. The kernel's
per-head inputs are the query and key of the first ``torch.bmm`` (``q @ kᵀ``) and the values of the
second, heads folded into the batch (``[b·H, s, head_dim]``), served ``[b, s, H, head_dim]`` views; the
query is already scaled by ``1/√head_dim`` (XGLM scales its projection), so ``q·kᵀ`` is not scaled again.
"""

from ..components.kernel import split_kernel, unscaled
from ..served import Site
from .base import Embeddings, Family

_RESIDUAL = "h = x + self_attn(self_attn_layer_norm(x)); y = h + fc2(act(fc1(final_layer_norm(h))))"

XGLM = Family(
    name="xglm",
    model_types=("xglm",),
    embeddings=Embeddings(positions="model.embed_positions"),
    norm="model.layer_norm",
    mlp=None,
    mlp_output=Site("fc2"),
    head_outputs=Site("self_attn.out_proj", key="input"),
    probabilities=("attn_weights_reshaped_0",),
    kernel=split_kernel("torch_bmm_0", "torch_bmm_1", (0, 1, 1), unscaled,
                        "its torch.bmm(query, keyᵀ) and torch.bmm(probabilities, value)", batch_heads=True),
    residual=_RESIDUAL,
)

BIOGPT = Family(
    name="biogpt",
    model_types=("biogpt",),
    embeddings=Embeddings(positions="biogpt.embed_positions"),
    layers="biogpt.layers",
    embed_tokens="biogpt.embed_tokens",
    norm="biogpt.layer_norm",
    lm_head="output_projection",
    mlp=None,
    mlp_output=Site("fc2"),
    head_outputs=Site("self_attn.out_proj", key="input"),
    residual=_RESIDUAL,
)

FAMILIES = [XGLM, BIOGPT]
