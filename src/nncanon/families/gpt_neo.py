"""GPT-Neo: ``transformer.h`` blocks; the attention that holds the projections is ``attn.attention``
(``attn`` only dispatches to it). Attention is inline in ``_attn``; global and local (sliding
window) layers alternate. Blocks return ``(hidden, attn_weights)``. The kernel's per-head inputs are
those ``_attn`` is called with (keys and values after the cache); it does not scale ``q·kᵀ``, and masks
the causal and local-window positions itself, from its ``bias`` buffer.
"""

from ..components.kernel import method_kernel, unscaled
from ..served import Site
from .base import Embeddings, Family

GPT_NEO = Family(
    name="gpt_neo",
    model_types=("gpt_neo",),
    embeddings=Embeddings(positions="transformer.wpe"),
    layers="transformer.h",
    embed_tokens="transformer.wte",
    norm="transformer.ln_f",
    attention="attn.attention",
    attention_output=Site("attn.attention", index=0),
    head_outputs=Site("attn.attention.out_proj", key="input"),
    probabilities=("self__attn_0", "torch_matmul_1"),
    kernel=method_kernel(unscaled),
    block_extras=1,
    residual="h = x + attn(ln_1(x)); y = h + mlp(ln_2(h))",
)

FAMILIES = [GPT_NEO]
