"""StableLM: Llama's modules, with a parallel residual when ``use_parallel_residual`` is set.

Sequential (StableLM-3B-4E1T, StableLM-2-1.6B): ``h = x + self_attn(input_layernorm(x));
y = h + mlp(post_attention_layernorm(h))``. Parallel (StableLM-2-12B, with per-head q/k
LayerNorms): ``n = input_layernorm(x); y = x + self_attn(n) + mlp(n)``, and the block has no
``post_attention_layernorm``. Either way the contributions are the attention module's first
output and the MLP's output (the block's ``dropout`` is the identity in eval), as in Llama.
"""

from .base import Family

STABLELM = Family(
    name="stablelm",
    model_types=("stablelm",),
    residual=(
        "h = x + attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h)); "
        "use_parallel_residual: y = x + attn(n) + mlp(n), n = input_layernorm(x)"
    ),
)

FAMILIES = [STABLELM]
