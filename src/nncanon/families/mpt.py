"""MPT: ``transformer.blocks``; the ``ffn`` adds the residual itself, so the MLP's contribution is
``ffn.down_proj``. Attention is inline (ALiBi); the probabilities multiply the values in the
second ``torch.matmul``. The kernel's per-head inputs are the query and key of the first
``torch.matmul`` (``q @ kᵀ``, times ``softmax_scale``) and the values of the second, keys and values after
the cache; ALiBi is the module's ``position_bias`` argument, added to the scaled scores.
"""

from typing import Any

from ..components.kernel import split_kernel
from ..served import Site
from .base import Embeddings, Family


def _softmax_scale(module: Any, kwargs: dict, head_dim: int) -> float:
    """The module's ``softmax_scale``."""
    return module.softmax_scale


MPT = Family(
    name="mpt",
    model_types=("mpt",),
    embeddings=Embeddings(positions_kind="alibi"),
    layers="transformer.blocks",
    embed_tokens="transformer.wte",
    norm="transformer.norm_f",
    attention="attn",
    mlp="ffn",
    attention_output=Site("attn", index=0),
    mlp_output=Site("ffn.down_proj"),
    head_outputs=Site("attn.out_proj", key="input"),
    probabilities=("torch_matmul_1",),
    kernel=split_kernel("torch_matmul_0", "torch_matmul_1", (0, 1, 1), _softmax_scale,
                        "its torch.matmul(query, keyᵀ) and torch.matmul(probabilities, value)", bias="position_bias"),
    block_extras=1,
    residual="h = x + attn(norm_1(x)); y = ffn(norm_2(h), residual=h) = h + down_proj(gelu(up_proj(...)))",
)

FAMILIES = [MPT]
