"""RecurrentGemma (Griffin): RG-LRU recurrent blocks and local-attention blocks, each with an MLP.

``h = x + temporal_block(temporal_pre_norm(x)); y = h + mlp_block(channel_pre_norm(h))``. The
``temporal_block`` is an RG-LRU recurrence (``linear_attention`` in ``config.layers_block_type``,
served as ``linear_attn``) or sliding-window attention (``sliding_attention``, served as
``self_attn``); both return ``(out, None or weights)``. The RG-LRU's gates are block-diagonal with
``num_attention_heads`` blocks, so ``linear_out``'s input is served per head
(``[b, s, heads, lru_width / heads]``). The recurrent state lives on the modules, not in the cache.
The embeddings are scaled by ``sqrt(hidden_size)`` (a bf16 constant) before block 0; the logits
are soft-capped by ``logits_soft_cap``. Before transformers 5.23 the block types are called
``recurrent`` and ``attention`` (same modules, same code): `_KIND` maps them to the 5.23 names.
"""

import torch

from ..served import Site
from .base import Embeddings, Family, LogitStep

#: Pre-5.23 names of ``config.layers_block_type`` -> the layout kinds (the 5.23 names).
_KIND = {"recurrent": "linear_attention", "attention": "sliding_attention"}

def _normalizer(config) -> float:
    """``sqrt(hidden_size)`` rounded to bf16 (the model's ``normalizer`` buffer)"""
    return float(torch.tensor(config.hidden_size**0.5, dtype=torch.bfloat16))


RECURRENT_GEMMA = Family(
    name="recurrent_gemma",
    model_types=("recurrent_gemma",),
    embeddings=Embeddings(scale=_normalizer),
    norm="model.final_norm",
    attention="temporal_block",
    attention_output=Site("temporal_block", index=0),
    head_outputs=Site("temporal_block.o_proj", key="input"),
    mlp="mlp_block",
    mlp_output=Site("mlp_block"),
    logit_steps=(LogitStep("softcap", "logits_soft_cap"),),
    residual="h = x + temporal_block(temporal_pre_norm(x)); y = h + mlp_block(channel_pre_norm(h))",
    layouts={
        "linear_attention": dict(
            attention=None,
            mixer="temporal_block",
            mixer_output=Site("temporal_block", index=0),
            mixer_head_outputs=Site("temporal_block.linear_out", key="input"),
            mixer_heads="num_attention_heads",
        ),
        "sliding_attention": {},
    },
    layout_of=lambda config, layer: _KIND.get(config.layers_block_type[layer], config.layers_block_type[layer]),
)

FAMILIES = [RECURRENT_GEMMA]
