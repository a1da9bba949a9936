"""Kimi-Linear and Bailing-Hybrid: KDA linear attention or MLA softmax attention, both kept as ``self_attn``.

Pre-norm blocks (``h = x + self_attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))``).
``config.layer_types[i]`` says what ``self_attn`` is: Kimi Delta Attention (``linear_attention``,
served as ``linear_attn``: it returns a tensor; its gated per-head RMSNorm ``o_norm`` feeds
``o_proj``, so ``o_proj``'s input is per head, ``linear_num_heads × linear_head_dim``) or multi-head
latent attention (``full_attention``, served as ``self_attn``: NoPE in Kimi, RoPE and a per-head
sigmoid gate ``g_proj`` before ``o_proj`` in Bailing; heads are ``v_head_dim`` wide). On a KDA block
``layers[i].self_attn`` is not available: the module named so is the linear mixer.
``config.mlp_layer_types[i]`` says whether the MLP is dense or a mixture of experts with a
sigmoid, group-limited router (``mlp.gate``, fp32 logits) and ungated shared experts.
"""

from ..served import Site
from .base import Embeddings, Family

_KDA = dict(
    attention=None,
    mixer="self_attn",
    mixer_output=Site("self_attn"),
    mixer_head_outputs=Site("self_attn.o_proj", key="input"),
    mixer_heads="linear_num_heads",
)

_MOE = dict(
    router_logits=Site("mlp.gate", op="router_logits_0", flat=True),
    expert_weights=Site("mlp.gate", index=1, flat=True),
    expert_indices=Site("mlp.gate", index=2, flat=True),
    shared_expert_output=Site("mlp.shared_experts"),
)


def _kinds(config, layer: int) -> tuple[str, str]:
    return config.layer_types[layer], "moe" if config.mlp_layer_types[layer] == "sparse" else "dense"


def _family(name: str) -> Family:
    return Family(
        name=name,
        model_types=(name,),
        embeddings=Embeddings(positions_kind="nope"),
        residual=(
            "h = x + self_attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h)), self_attn = KDA or MLA"
        ),
        layouts={"linear_attention": _KDA, "full_attention": {}, "moe": _MOE, "dense": {}},
        layout_of=_kinds,
    )


FAMILIES = [_family("kimi_linear"), _family("bailing_hybrid")]
