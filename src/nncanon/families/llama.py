"""The canonical pre-norm block: ``h = x + self_attn(norm(x)); y = h + mlp(norm(h))``.

Llama and the many families that kept its block: the defaults of `Family` describe them, so a
family here is its name and the model types it serves.
"""

from .base import Family

LLAMA = Family(
    name="llama",
    model_types=(
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
    ),
)

FAMILIES = [LLAMA]
