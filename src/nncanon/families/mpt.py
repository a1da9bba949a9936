"""MPT: ``transformer.blocks``; the ``ffn`` adds the residual itself, so the MLP's contribution is
``ffn.down_proj``. Attention is inline (ALiBi); the probabilities multiply the values in the
second ``torch.matmul``.
"""

from ..served import Site
from .base import Family

MPT = Family(
    name="mpt",
    model_types=("mpt",),
    layers="transformer.blocks",
    embed_tokens="transformer.wte",
    norm="transformer.norm_f",
    attention="attn",
    mlp="ffn",
    attention_output=Site("attn", index=0),
    mlp_output=Site("ffn.down_proj"),
    head_outputs=Site("attn.out_proj", key="input"),
    probabilities=("torch_matmul_1",),
    block_extras=1,
    residual="h = x + attn(norm_1(x)); y = ffn(norm_2(h), residual=h) = h + down_proj(gelu(up_proj(...)))",
)

FAMILIES = [MPT]
