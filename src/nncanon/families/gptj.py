"""GPT-J and CodeGen: parallel blocks with one LayerNorm feeding both attention and MLP.

Before transformers 5.24 their modeling code is the old one: the block returns
``(hidden_states, attn_weights)`` and attention has no sdpa path, its probabilities multiply the
values in ``self._attn`` (second ``torch.matmul``). From 5.24 the block returns a tensor and attention
goes through transformers' attention interface (where the probabilities are found by default).
"""

from ..served import Site
from ..versions import transformers_minor
from .base import Family

#: The pre-5.24 modeling code (tuple-returning block, ``self._attn``).
_OLD_CODE = transformers_minor() < (5, 24)

#: Why the pre-5.24 code's scores are not served (its ``self._attn`` scores are not proved on those minors).
_OLD_SCORES = ("transformers' GPT-J and CodeGen before 5.24 compute attention in self._attn, whose softmax's input is "
               "not proved to be the scores there: attention_probabilities are served; load with transformers 5.24 or "
               "later to read attention_scores")

GPTJ = Family(
    name="gptj",
    model_types=("gptj", "codegen"),
    layers="transformer.h",
    embed_tokens="transformer.wte",
    norm="transformer.ln_f",
    attention="attn",
    attention_output=Site("attn", index=0),
    head_outputs=Site("attn.out_proj", key="input"),
    probabilities=("self__attn_0", "torch_matmul_1") if _OLD_CODE else None,
    block_extras=1 if _OLD_CODE else 0,
    declines=(lambda config, layer: {"attention_scores": _OLD_SCORES}) if _OLD_CODE else None,
    residual="n = ln_1(x); y = x + attn(n) + mlp(n)",
)

FAMILIES = [GPTJ]
