"""GPT-2, GPT-BigCode and GPT-SW3: ``transformer.h`` blocks, ``attn`` and ``mlp`` modules, Conv1D or Linear.

GPT-SW3 is ``GPT2LMHeadModel`` (``gpt-sw3`` maps to ``GPT2Config``, whose ``model_type`` reads ``gpt2``);
only its tokenizer differs.

Under eager attention, a GPT-2 config with ``reorder_and_upcast_attn`` computes its probabilities in
the module's own ``_upcast_and_reordered_attn`` (in fp32), not in transformers' attention function:
the kernel's per-head inputs (``query_states``...), read at that function's call, are declined there.
"""

from ..components.kernel import STATES
from ..served import Site
from .base import Embeddings, Family

_REORDERED = ("under eager attention this config (reorder_and_upcast_attn) computes attention in "
              "GPT2Attention._upcast_and_reordered_attn, without calling transformers' attention interface")


def _declines(config, layer: int) -> dict:
    return dict.fromkeys(STATES, _REORDERED) if getattr(config, "reorder_and_upcast_attn", False) else {}


def _probabilities(config) -> tuple[str, ...] | None:
    """Inside ``_upcast_and_reordered_attn`` where the config asks for it, else transformers' attention"""
    if getattr(config, "reorder_and_upcast_attn", False):
        return ("self__upcast_and_reordered_attn_0", "torch_matmul_0")
    return None


GPT2 = Family(
    name="gpt2",
    model_types=("gpt2", "gpt_bigcode", "gpt-sw3"),
    embeddings=Embeddings(positions="transformer.wpe"),
    layers="transformer.h",
    embed_tokens="transformer.wte",
    norm="transformer.ln_f",
    attention="attn",
    attention_output=Site("attn", index=0),
    head_outputs=Site("attn.c_proj", key="input"),
    probabilities=_probabilities,
    declines=_declines,
    residual="h = x + attn(ln_1(x)); y = h + mlp(ln_2(h))",
)

FAMILIES = [GPT2]
