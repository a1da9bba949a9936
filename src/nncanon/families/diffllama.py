"""DiffLlama: a Llama block with differential attention (the Differential Transformer).

``h = x + self_attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))``. Inside the
attention, two attention calls over the two halves of V share one set of ``num_attention_heads``
softmax maps; maps ``j`` and ``j + H/2`` then form differential head ``j``:
``(1 - λ_init) · groupnorm(a_j - λ · a_{j+H/2})``, ``2·head_dim`` wide, normed on its own, and the
``H/2`` differential heads are ``o_proj``'s input. So ``attention_head_outputs`` is
``[b, s, H/2, 2·head_dim]`` (``model.num_heads`` and ``head_dim`` say so), and zeroing a head there
removes it. ``attention_probabilities`` is declined: each map is computed twice, once per call, so
no single tensor is where a write changes the attention; so are the kernel's inputs (``query_states``...):
the two calls share the queries and keys and take one half of the values each.
"""

from ..components.kernel import STATES
from .base import Family


def _differential_heads(config, layer: int) -> tuple[int, int]:
    """``(num_attention_heads / 2, 2 · head_dim)``"""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads // 2, 2 * head_dim


_PROBABILITIES = (
    "DiffLlama computes each softmax map twice (two attention calls, one per half of V) and pairs maps j "
    "and j + H/2 into one differential head: no single tensor is where a write changes the attention. "
    "attention_head_outputs (the differential heads) are served"
)

_KERNEL = (
    "DiffLlama calls the attention kernel twice, both calls on the same queries and keys, each on one half of "
    "the values: no single call's inputs are the attention's"
)

DIFFLLAMA = Family(
    name="diffllama",
    model_types=("diffllama",),
    head_shape=_differential_heads,
    declines=lambda config, layer: {**dict.fromkeys(STATES, _KERNEL), "attention_probabilities": _PROBABILITIES},
    residual="h = x + attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h)); "
    "attn = o_proj(heads_j = (1 - λ_init)·groupnorm(a_j - λ·a_{j+H/2}))",
)

FAMILIES = [DIFFLLAMA]
