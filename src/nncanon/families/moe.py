"""Mixtures of experts in a Llama block: ``h = x + self_attn(norm(x)); y = h + mlp(norm(h))``.

The MLP is a sparse mixture of experts (on every layer, or on the layers a config knob picks; a
dense MLP elsewhere). Its whole contribution, routed plus shared experts, is the MLP module's
output. The router is a module of the MLP that returns ``(logits, weights, indices)`` on the
flattened tokens: the logits are served where the router binds them, so a write changes which
experts the top-k picks; the weights and indices are its returned ones, the ones the experts run
with (DeepSeek-style routers include ``routed_scaling_factor`` in the weights). Shared experts are
served after their gate (Qwen2-MoE's sigmoid gate), where a family has them.

A family whose MoE block has no shared expert in some configurations (ERNIE-4.5 with
``moe_num_shared_experts = 0``) adds the ``shared`` kind only where the configuration has one.
"""

from typing import Any

import torch

from ..served import Site
from ..versions import transformers_minor
from .base import Family, MLPAnatomy
from .qwen3_next import QWEN_MOE, TOPK_ROUTER

_NORMED_SUM = (
    "{name}'s mixture of experts norms the sum of its routed and shared experts ({norm}), so the shared "
    "experts have no additive part of mlp_output; read mlp.shared_experts.output for their raw output"
)


#: Aria's and GraniteMoE's (-Shared, -Hybrid) top-k routers return ``(indices, weights, logits)`` before
#: transformers 5.21, ``(logits, weights, indices)`` from 5.21.
INDICES_FIRST = transformers_minor() < (5, 21)


def router_sites(path: str, indices_first: bool = False) -> dict:
    """The routing sites of a top-k router module at ``path`` returning ``(logits, weights, indices)``
    (``indices_first``: ``(indices, weights, logits)``); the logits are the forward's ``router_logits``."""
    return dict(
        router_logits=Site(path, op="router_logits_0", flat=True),
        expert_weights=Site(path, index=1, flat=True),
        expert_indices=Site(path, index=0 if indices_first else 2, flat=True),
    )


def _sparse_step(config, layer: int) -> str:
    """Qwen2/3-MoE, Flint: sparse unless in ``mlp_only_layers`` or off the ``decoder_sparse_step``."""
    sparse = (
        layer not in (getattr(config, "mlp_only_layers", None) or [])
        and (getattr(config, "num_experts", 0) or 0) > 0
        and (layer + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )
    return "moe" if sparse else "dense"


def _first_k_dense(config, layer: int) -> str:
    """DeepSeek, GLM-4.5, dots.llm1, Sarvam: the first ``first_k_dense_replace`` layers are dense."""
    return "moe" if layer >= (config.first_k_dense_replace or 0) else "dense"


def _mlp_layer_types(config, layer: int) -> str:
    """GLM-4.7-Flash, K-EXAONE, MiMo-V2-Flash, Mellum, Hy3, Laguna: ``mlp_layer_types[i]``."""
    return "moe" if config.mlp_layer_types[layer] == "sparse" else "dense"


def _ernie(config, layer: int) -> tuple[str, ...]:
    sparse = (
        layer + 1
    ) % config.moe_layer_interval == 0 and config.moe_layer_start_index <= layer <= config.moe_layer_end_index
    if not sparse:
        return ("dense",)
    return ("moe", "shared") if config.moe_num_shared_experts > 0 else ("moe",)


def _laguna_heads(config, layer: int) -> tuple[int, int]:
    """``(num_attention_heads_per_layer[layer], head_dim)``"""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads_per_layer[layer], head_dim


def _per_layer_heads(config, layer: int) -> tuple[int, int]:
    """``(num_attention_heads, v_head_dim)`` of block ``layer``'s own config (``per_layer_config[layer]``)"""
    own = config.per_layer_config[layer]
    return own.num_attention_heads, own.v_head_dim


def _axk1_declines(config, layer: int) -> dict:
    if _mlp_layer_types(config, layer) == "dense":
        return {}
    return {"shared_expert_output": _NORMED_SUM.format(name="A.X K1", norm="mlp.post_mlp_layernorm")}


def _clamped_swiglu(mlp: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """MiniMax-M3's dense MLP: ``(clamp(up) + 1) · g · sigmoid(α · g)``, ``g = clamp(gate, max=limit)``."""
    gate = gate.clamp(max=mlp.swiglu_limit)
    up = up.clamp(min=-mlp.swiglu_limit, max=mlp.swiglu_limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * mlp.swiglu_alpha))


def _family(name: str, model_types: tuple[str, ...], moe: dict, layout_of=None, dense: dict | None = None,
            **fields) -> Family:
    """An MoE family on the Llama block: every layer sparse, or ``layout_of`` picks moe or dense (``dense``: the
    fields of the dense blocks)."""
    if layout_of is None:
        return Family(name=name, model_types=model_types, **moe, **fields)
    return Family(
        name=name,
        model_types=model_types,
        layouts={"moe": moe, "dense": dense or {}},
        layout_of=layout_of,
        **fields,
    )


#: DeepSeek-style MoE: top-k router ``mlp.gate``, ungated shared experts on the unflattened tokens.
DEEPSEEK_MOE = dict(TOPK_ROUTER, shared_expert_output=Site("mlp.shared_experts"))

FAMILIES = [
    _family("mixtral", ("mixtral", "olmoe", "minimax_m2"), TOPK_ROUTER),
    _family("phimoe", ("phimoe",), router_sites("mlp.router")),
    _family(
        "aria_text",
        ("aria_text",),
        dict(router_sites("mlp.router", indices_first=INDICES_FIRST), shared_expert_output=Site("mlp.shared_experts")),
    ),
    _family("hunyuan_v1_moe", ("hunyuan_v1_moe",), dict(TOPK_ROUTER, shared_expert_output=Site("mlp.shared_mlp"))),
    _family("solar_open", ("solar_open",), DEEPSEEK_MOE),
    _family("qwen2_moe", ("qwen2_moe",), QWEN_MOE, _sparse_step),
    _family("qwen3_moe", ("qwen3_moe",), TOPK_ROUTER, _sparse_step),
    _family(
        "flint", ("flint",), dict(TOPK_ROUTER, shared_expert_output=Site("mlp.shared_expert", flat=True)), _sparse_step
    ),
    # Param2-MoE (param2moe) is GLM-4.5's model class with its own config.
    _family(
        "deepseek",
        ("deepseek_v2", "deepseek_v3", "sarvam_mla", "glm4_moe", "param2moe", "sarvam_moe", "dots1"),
        DEEPSEEK_MOE,
        _first_k_dense,
    ),
    # DeepSeek-V3.2 and A.X K2 add a sparse-attention indexer (it picks the keys each query
    # attends to: the probabilities served are those over the picked keys, zero elsewhere).
    # MiniCPM5-MoE's attention gates each head's output by a sigmoid (q_gate_proj) before o_proj:
    # the heads served are o_proj's input, gated.
    _family(
        "glm4_moe_lite",
        ("glm4_moe_lite", "exaone_moe", "deepseek_v32", "axk2", "minicpm5_moe"),
        DEEPSEEK_MOE,
        _mlp_layer_types,
    ),
    # GLM-5 (DSA): its blocks also return the indexer's picks, for the next layer to share.
    _family("glm_moe_dsa", ("glm_moe_dsa",), DEEPSEEK_MOE, _mlp_layer_types, block_extras=1),
    # MiniMax-M3 scales the routed sum by `routed_scaling_factor` before adding the shared experts.
    _family(
        "minimax_m3",
        ("minimax_m3_vl_text",),
        dict(TOPK_ROUTER, shared_expert_output=Site("mlp.shared_experts", flat=True)),
        _mlp_layer_types,
        dense={"mlp_anatomy": MLPAnatomy(down="mlp.down_proj", pre="mlp.gate_up_proj", linear="mlp.gate_up_proj",
                                         fused="mlp.gate_up_proj", combine=_clamped_swiglu)},
    ),
    _family("mimo_v2_flash", ("mimo_v2_flash", "mellum"), TOPK_ROUTER, _mlp_layer_types),
    _family(
        "hy_v3",
        ("hy_v3",),
        dict(TOPK_ROUTER, shared_expert_output=Site("mlp.shared_experts", flat=True)),
        _mlp_layer_types,
    ),
    # Laguna scales the routed sum by `moe_routed_scaling_factor` before adding the shared experts; its
    # blocks have their own head counts (`num_attention_heads_per_layer`).
    _family(
        "laguna",
        ("laguna",),
        dict(TOPK_ROUTER, shared_expert_output=Site("mlp.shared_experts", flat=True)),
        _mlp_layer_types,
        head_shape=_laguna_heads,
    ),
    # dots.llm3-note: DeepSeek-style MoE and gated multi-head latent attention, with per-layer configs
    # (`per_layer_config`: its sliding-window layers have their own head counts and widths).
    _family(
        "dots3_note", ("dots3_note_text", "dots3_note"), DEEPSEEK_MOE, _mlp_layer_types, head_shape=_per_layer_heads
    ),
    # A.X K1: the MoE returns post_mlp_layernorm(routed + shared).
    _family(
        "axk1",
        ("axk1",),
        dict(TOPK_ROUTER, shared_expert_output=Site("mlp.shared_experts")),
        _mlp_layer_types,
        declines=_axk1_declines,
    ),
    Family(
        name="ernie4_5_moe",
        model_types=("ernie4_5_moe",),
        layouts={
            "moe": TOPK_ROUTER,
            "shared": dict(shared_expert_output=Site("mlp.shared_experts", flat=True)),
            "dense": {},
        },
        layout_of=_ernie,
    ),
]
