"""OpenAI GPT (GPT-1): post-LN blocks, ``h = ln_1(x + attn(x)); y = ln_2(h + mlp(h))``.

The block normalises the stream after adding each sublayer, so no tensor is what attention or
the MLP adds to ``layer_input``: those two values are declined. There is no final norm. Blocks
and attention return lists (``[h]``, ``[h, weights]`` with ``output_attentions``); attention is
inline in ``_attn``: the kernel's per-head inputs are those it is called with, the key transposed
(``[b, H, head_dim, s]``, served ``[b, s, H, head_dim]`` as every key is); it scales ``q·kᵀ`` by
``1/√head_dim`` where ``config.scale_attn`` (``module.scale``), and masks the causal positions itself.
"""

from typing import Any

from ..components.kernel import method_kernel
from ..served import Site
from .base import Embeddings, Family

POST_LN = (
    "OpenAI GPT blocks are post-LN (h = ln_1(x + attn(x)); y = ln_2(h + mlp(h))): each sublayer is "
    "added and then normalised, so no tensor is what {what} adds to layer_input"
)


def _declines(config: Any, layer: int) -> dict:
    return {
        "attention_output": POST_LN.format(what="attention"),
        "mlp_output": POST_LN.format(what="the MLP"),
    }


def _scale(module: Any, kwargs: dict, head_dim: int) -> float:
    """``1/√head_dim`` where the module scales (``module.scale``), else 1."""
    return head_dim**-0.5 if module.scale else 1.0


OPENAI_GPT = Family(
    name="openai-gpt",
    model_types=("openai-gpt",),
    embeddings=Embeddings(positions="transformer.positions_embed"),
    layers="transformer.h",
    embed_tokens="transformer.tokens_embed",
    norm=None,
    attention="attn",
    attention_output=Site("attn", index=0),
    head_outputs=Site("attn.c_proj", key="input"),
    probabilities=("self__attn_0", "torch_matmul_1"),
    kernel=method_kernel(_scale, key_transposed=True),
    block_extras=1,
    residual="h = ln_1(x + attn(x)); y = ln_2(h + mlp(h))",
    declines=_declines,
)

FAMILIES = [OPENAI_GPT]
