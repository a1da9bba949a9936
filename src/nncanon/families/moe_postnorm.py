"""Mixtures of experts in post-norm and sandwich-norm blocks: the contributions are norm outputs.

FlexOlmo is OLMo-2's block (no pre-norm): ``h = x + post_attention_layernorm(self_attn(x));
y = h + post_feedforward_layernorm(mlp(h))``. AFMoE (Arcee Trinity) is a sandwich:
``h = x + post_attention_layernorm(self_attn(input_layernorm(x)));
y = h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))``, its MLP dense on the first
``num_dense_layers`` layers and a mixture of experts with shared experts after them; its attention
gates each channel before ``o_proj``. Kolibri-1 is GLM-4's sandwich:
``h = x + post_self_attn_layernorm(self_attn(input_layernorm(x)));
y = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))``. The MoE's output (routed plus
shared) is normed before it joins the stream, so the shared experts have no additive part of the
contribution.

Kolibri-1.1 keeps Kolibri-1's block, with a dense MLP on ``mlp_only_layers``, and replaces its full
attention by indexed attention (``layer_types``): a weightless indexer picks the keys each query attends
to by scoring the layer's own queries against its keys (a new pool of candidates on the ``index_layers``,
a rescoring of the preceding indexer's pool elsewhere); the blocks return that pool, ``(hidden, pool)``,
for the next indexed block. Some indexed blocks reuse the keys/values an earlier one stores
(``kv_source_layers``). So: ``query_states`` and ``key_states`` of an indexed block act through the
selection too, and are declined there; keys/values shared by several blocks are declined on each of
them; a skipped block hands on the pool it was given; a skip that would leave a later block without
the keys/values or the pool it reads is refused; and ``resume`` is declined where blocks read another
block's keys/values or pool.
"""

from typing import Any

from ..served import Site
from .base import Family, stranded_readers
from .qwen3_next import TOPK_ROUTER

_AFMOE_SHARED = (
    "AFMoE norms its mixture of experts' output (routed plus shared experts) with post_mlp_layernorm before "
    "it joins the stream, so the shared experts have no additive part of mlp_output; read "
    "mlp.shared_experts.output for their raw output"
)


_KOLIBRI_LOGITS = (
    "Kolibri-1's router computes its logits on one of two code paths picked at run time (a fused fp32 matmul "
    "on CUDA without grad, a linear layer otherwise), so no single operation is where a write changes the "
    "routing; expert_weights and expert_indices are served"
)
_KOLIBRI_SHARED = _AFMOE_SHARED.replace("AFMoE", "Kolibri-1")


def _afmoe_kind(config, layer: int) -> str:
    return "moe" if layer >= config.num_dense_layers else "dense"


FLEX_OLMO = Family(
    name="flex_olmo",
    model_types=("flex_olmo",),
    attention_output=Site("post_attention_layernorm"),
    mlp_output=Site("post_feedforward_layernorm"),
    residual="h = x + post_attention_layernorm(attn(x)); y = h + post_feedforward_layernorm(mlp(h))",
    **TOPK_ROUTER,
)

AFMOE = Family(
    name="afmoe",
    model_types=("afmoe",),
    attention_output=Site("post_attention_layernorm"),
    mlp_output=Site("post_mlp_layernorm"),
    residual=(
        "h = x + post_attention_layernorm(attn(input_layernorm(x))); "
        "y = h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))"
    ),
    layouts={
        "moe": dict(
            router_logits=Site("mlp.router", op="router_logits_0", flat=True),
            expert_weights=Site("mlp.router", index=1, flat=True),
            expert_indices=Site("mlp.router", index=2, flat=True),
        ),
        "dense": {},
    },
    layout_of=_afmoe_kind,
    declines=lambda config, layer: (
        {"shared_expert_output": _AFMOE_SHARED} if _afmoe_kind(config, layer) == "moe" else {}
    ),
)

KOLIBRI1 = Family(
    name="kolibri1",
    model_types=("kolibri1",),
    attention_output=Site("post_self_attn_layernorm"),
    mlp_output=Site("post_mlp_layernorm"),
    expert_weights=Site("mlp.gate", index=1, flat=True),
    expert_indices=Site("mlp.gate", index=2, flat=True),
    residual=(
        "h = x + post_self_attn_layernorm(attn(input_layernorm(x))); "
        "y = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))"
    ),
    declines=lambda config, layer: {"router_logits": _KOLIBRI_LOGITS, "shared_expert_output": _KOLIBRI_SHARED},
)

_KOLIBRI1_1_SELECTION = (
    "Kolibri-1.1's indexer picks the keys each query of this indexed-attention block attends to by scoring the "
    "block's queries against its keys before the kernel receives them: the kernel's query and key inputs are "
    "not the only way they act (a write there does not reach the selection)"
)


def _kolibri1_1_moe(config: Any, layer: int) -> str:
    return "dense" if layer in config.mlp_only_layers else "moe"


def _kolibri1_1_shared_kv(config: Any) -> dict[int, list[int]]:
    """Each block whose keys/values later blocks read (``kv_source_layers``), with those blocks."""
    readers: dict[int, list[int]] = {}
    for layer, source in enumerate(config.kv_source_layers):
        if source != layer:
            readers.setdefault(source, []).append(layer)
    return readers


def _kolibri1_1_pools(config: Any) -> dict[int, list[int]]:
    """Each indexer block (``index_layers``), with the indexed blocks that rescore its pool."""
    pools: dict[int, list[int]] = {}
    current = None
    for layer, kind in enumerate(config.layer_types):
        if layer in config.index_layers:
            current = pools.setdefault(layer, [])
        elif kind == "indexed_attention" and current is not None:
            current.append(layer)
    return pools


def _kolibri1_1_declines(config: Any, layer: int) -> dict:
    declines = {}
    if _kolibri1_1_moe(config, layer) == "moe":
        declines.update(router_logits=_KOLIBRI_LOGITS, shared_expert_output=_KOLIBRI_SHARED.replace("-1", "-1.1"))
    if config.layer_types[layer] == "indexed_attention":
        declines.update(dict.fromkeys(("query_states", "key_states"), _KOLIBRI1_1_SELECTION))
    for store, readers in _kolibri1_1_shared_kv(config).items():
        if layer in (store, *readers):
            declines.update(dict.fromkeys(("key_states", "value_states"), (
                f"layers[{store}]'s keys and values are also those of layers {readers} (Kolibri-1.1's "
                f"kv_source_layers): the kernel's key and value inputs here are one tensor shared by those blocks, "
                f"so a write to them (or their gradient) is not this block's alone")))
    return declines


def _kolibri1_1_refuse_skip(config: Any, start: int, end: int) -> str | None:
    stranded = stranded_readers(_kolibri1_1_shared_kv(config), start, end)
    if stranded is not None:
        store, later = stranded
        return (
            f"layers[{store}] produces the keys/values that layers {later} read (Kolibri-1.1's "
            f"kv_source_layers), and a skipped block produces none. Skip through layers[{max(later)}] as "
            f"well, or leave layers[{store}] running"
        )
    stranded = stranded_readers(_kolibri1_1_pools(config), start, end)
    if stranded is not None:
        indexer, later = stranded
        return (
            f"layers[{indexer}] selects the pool of candidate keys that layers {later} rescore (Kolibri-1.1's "
            f"index_layers), and a skipped block selects none. Skip through layers[{max(later)}] as well, or "
            f"leave layers[{indexer}] running"
        )
    return None


def _kolibri1_1_model_declines(config: Any) -> dict[str, str]:
    if not any(_kolibri1_1_shared_kv(config).values()) and not any(_kolibri1_1_pools(config).values()):
        return {}
    return {"resume": (
        "Kolibri-1.1's indexed-attention blocks read the keys/values (kv_source_layers) and the pool of candidate "
        "keys (index_layers) that earlier blocks produce during the same forward; a forward resumed past those "
        "blocks would run without them"
    )}


KOLIBRI1_1 = Family(
    name="kolibri1_1",
    model_types=("kolibri1_1",),
    attention_output=Site("post_self_attn_layernorm"),
    mlp_output=Site("post_mlp_layernorm"),
    block_extras=1,
    passes_state="index_pool",
    residual=KOLIBRI1.residual,
    layouts={
        "moe": dict(
            expert_weights=Site("mlp.gate", index=1, flat=True),
            expert_indices=Site("mlp.gate", index=2, flat=True),
        ),
        "dense": {},
    },
    layout_of=_kolibri1_1_moe,
    declines=_kolibri1_1_declines,
    refuse_skip=_kolibri1_1_refuse_skip,
    model_declines=_kolibri1_1_model_declines,
)

FAMILIES = [FLEX_OLMO, AFMOE, KOLIBRI1, KOLIBRI1_1]
