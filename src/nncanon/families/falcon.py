"""Falcon: ``transformer.h`` blocks returning ``(hidden, attn_weights)``.

Parallel blocks (``parallel_attn`` or ``new_decoder_architecture``) add attention into the MLP's
output *in place* (``mlp_output += attention_output``), so the MLP's contribution is a copy taken
as the MLP returns (``clone=True``), and a write to it is written back.

From transformers 5.25 the attention goes through transformers' attention interface (``scaling``,
``num_key_value_groups``; ALiBi reaches it folded into ``attention_mask``): its probabilities, kernel
inputs and recomputed probabilities are found there, as for Llama.

Before 5.25 the attention is written inline. The probabilities are read at the assignment that follows
the softmax on the RoPE path (``attention_scores``) and after dropout on the ALiBi path
(``attention_probs``): the two paths are chosen by ``config.alibi``. Under sdpa, each path calls
``torch.nn.functional.scaled_dot_product_attention`` itself (ALiBi folded into the mask it passes): the
kernel's per-head inputs are read there (the first call in the forward on the RoPE path, the second on
the ALiBi path), and the probabilities recomputed from them. Under eager the attention multiplies them
inline (no call receives them): they are not served there. On the ALiBi path eager adds ALiBi twice
(`_ALIBI_TWICE`), so probabilities recomputed under sdpa are declined there.
"""

from typing import Any

from ..components.kernel import RECOMPUTED, sdpa_kernel
from ..served import Site
from ..versions import transformers_minor
from .base import Embeddings, Family

#: The pre-5.25 modeling code (attention inline, an ``alibi`` argument, eager adding ALiBi twice).
_OLD_CODE = transformers_minor() < (5, 25)

_SDPA_CALL = "torch_nn_functional_scaled_dot_product_attention_{}"
_KERNELS = {alibi: sdpa_kernel(_SDPA_CALL.format(int(alibi))) for alibi in (False, True)}


def _kernel(config: Any) -> Any:
    """The sdpa call of the path the config takes: the first in the forward (RoPE), the second (ALiBi)."""
    return _KERNELS[bool(config.alibi)]


def _probabilities(config: Any) -> tuple[str, ...]:
    """The pre-5.25 inline softmax's result: after dropout (ALiBi), else the RoPE path's second assignment."""
    return ("attention_probs_2",) if config.alibi else ("attention_scores_2",)


_ALIBI_TWICE = (
    "transformers' Falcon before 5.25 attends differently under eager and sdpa on the ALiBi path: FalconModel "
    "folds ALiBi into the mask it passes every block, and the eager branch of FalconAttention adds it to the "
    "scores again (eager sees it twice, sdpa once), so probabilities recomputed from the sdpa call are not "
    "eager's. Load the model with StandardizedTransformer(..., attn_implementation=\"eager\") to read eager's "
    "(or use transformers 5.25 or later, where both see it once)"
)


#: Why the scores are not served by the pre-5.25 inline attention (its softmax's input is not proved there).
OLD_SCORES = ("transformers' Falcon before 5.25 computes attention inline, and its softmax's input is not proved to be "
              "the scores on this minor: attention_probabilities are served; load with transformers 5.25 or later to "
              "read attention_scores")


def _declines(config: Any, layer: int) -> dict:
    return {"attention_scores": OLD_SCORES, **({RECOMPUTED: _ALIBI_TWICE} if config.alibi else {})}


def _kv_heads(config: Any) -> int:
    if config.new_decoder_architecture or not config.multi_query:
        return config.num_kv_heads
    return 1


def _positions(config: Any) -> str:
    """ALiBi where the config asks for it, else rotary"""
    return "alibi" if getattr(config, "alibi", False) else "rotary"


FALCON = Family(
    name="falcon",
    model_types=("falcon",),
    embeddings=Embeddings(positions_kind=_positions),
    layers="transformer.h",
    embed_tokens="transformer.word_embeddings",
    norm="transformer.ln_f",
    attention="self_attention",
    attention_output=Site("self_attention", index=0),
    mlp_output=Site("mlp", clone=True),
    head_outputs=Site("self_attention.dense", key="input"),
    probabilities=_probabilities if _OLD_CODE else None,
    kernel=_kernel if _OLD_CODE else None,
    declines=_declines if _OLD_CODE else None,
    block_extras=1,
    residual=(
        "parallel: y = x + self_attention(ln_attn(x)) + mlp(ln_mlp(x)) (one input_layernorm where configured); "
        "sequential: h = x + self_attention(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))"
    ),
    kv_heads=_kv_heads,
)

FAMILIES = [FALCON]
