"""GraniteMoE, GraniteMoeShared, GraniteMoeSWA: Granite's scaled sublayers around a mixture of experts.

``h = x + r·self_attn(input_layernorm(x)); y = h + r·(block_sparse_moe(n) + shared_mlp(n))``, with
``n = post_attention_layernorm(h)`` and ``r = residual_multiplier``; GraniteMoE (and a shared
configuration with ``shared_intermediate_size = 0``) has no ``shared_mlp``. ``layers[i].mlp`` is
``block_sparse_moe`` (router ``block_sparse_moe.router``, fp32 logits, softmax over the top-k).
With a shared MLP no module outputs the MLP's contribution: the block adds the two, so
``mlp_output`` is ``r`` times that sum, read where the block binds it, and ``shared_expert_output``
is ``r·shared_mlp(n)``, the shared MLP's part of it. GraniteMoeSWA adds sliding-window layers.
Logits are ``lm_head(norm(h)) / logits_scaling``.
"""

from ..served import Site
from .base import Embeddings, Family, LogitStep
from .moe import INDICES_FIRST, router_sites

_R = "residual_multiplier"


def _shared(config, layer: int) -> tuple[str, ...]:
    return ("shared",) if (getattr(config, "shared_intermediate_size", 0) or 0) > 0 else ()


def _family(name: str, model_types: tuple[str, ...], shared: bool, indices_first: bool = INDICES_FIRST) -> Family:
    return Family(
        name=name,
        model_types=model_types,
        embeddings=Embeddings(scale="embedding_multiplier"),
        mlp="block_sparse_moe",
        attention_output=Site("self_attn", index=0, scale=_R),
        mlp_output=Site("block_sparse_moe", scale=_R),
        **router_sites("block_sparse_moe.router", indices_first=indices_first),
        logit_steps=(LogitStep("divide", "logits_scaling"),),
        residual=(
            "h = x + r·attn(input_layernorm(x)); y = h + r·(block_sparse_moe(n) + shared_mlp(n)), "
            "n = post_attention_layernorm(h), r = residual_multiplier"
            if shared
            else "h = x + r·attn(input_layernorm(x)); y = h + r·block_sparse_moe(post_attention_layernorm(h)), "
            "r = residual_multiplier"
        ),
        layouts=(
            {
                "shared": dict(
                    # `hidden_states = moe_hidden_states + self.shared_mlp(hidden_states)` in the block's forward.
                    mlp_output=Site(op="hidden_states_4", scale=_R),
                    shared_expert_output=Site("shared_mlp", scale=_R),
                )
            }
            if shared
            else {}
        ),
        layout_of=_shared if shared else None,
    )


FAMILIES = [
    _family("granitemoe", ("granitemoe",), shared=False),
    # GraniteMoeSWA's router returns (logits, weights, indices) on every supported minor: before 5.21 it is
    # served apart from GraniteMoeShared's (same family, same name).
    *([_family("granitemoeshared", ("granitemoeshared",), shared=True),
       _family("granitemoeshared", ("granitemoe_swa",), shared=True, indices_first=False)] if INDICES_FIRST
      else [_family("granitemoeshared", ("granitemoeshared", "granitemoe_swa"), shared=True)]),
]
