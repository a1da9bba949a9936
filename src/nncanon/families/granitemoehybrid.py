"""GraniteMoeHybrid: Mamba-2 or attention blocks whose sublayer outputs are scaled, Granite-style.

``h = x + r·mixer(input_layernorm(x)); y = h + r·(block_sparse_moe(n) + shared_mlp(n))``, with
``n = post_attention_layernorm(h)`` and ``r = residual_multiplier``. The block keeps the mixer it
does not use as ``None`` (``mamba`` or ``self_attn``); the kind is ``config.layers_block_type[i]``.

No module outputs the MLP's contribution: the mixture of experts and the shared MLP both read
``n`` and the block adds them, so ``mlp_output`` is ``r`` times that sum, read where the block
binds it, and ``layers[i].mlp`` is ``block_sparse_moe`` (its router: ``block_sparse_moe.router``).
``shared_expert_output`` is ``r·shared_mlp(n)``, the shared MLP's part of the contribution.
Without experts (``num_local_experts = 0``) the MLP is ``shared_mlp`` alone.
Logits are ``lm_head(norm(h)) / logits_scaling``.
"""

from ..served import Site
from .base import Embeddings, Family, LogitStep
from .moe import INDICES_FIRST, router_sites

_R = "residual_multiplier"


def _kinds(config, layer: int) -> tuple[str, str]:
    return config.layers_block_type[layer], "moe" if config.num_local_experts > 0 else "dense"


def _positions(config) -> str:
    """Rotary where ``position_embedding_type`` is ``"rope"``, else none (NoPE attention beside Mamba)"""
    return "rotary" if getattr(config, "position_embedding_type", None) == "rope" else "nope"


GRANITEMOEHYBRID = Family(
    name="granitemoehybrid",
    model_types=("granitemoehybrid",),
    embeddings=Embeddings(positions_kind=_positions, scale="embedding_multiplier"),
    attention_output=Site("self_attn", index=0, scale=_R),
    logit_steps=(LogitStep("divide", "logits_scaling"),),
    residual=(
        "h = x + r·mixer(input_layernorm(x)); y = h + r·(block_sparse_moe(n) + shared_mlp(n)), "
        "n = post_attention_layernorm(h), r = residual_multiplier"
    ),
    layouts={
        "linear_attention": dict(
            attention=None,
            mixer="mamba",
            mixer_output=Site("mamba", scale=_R),
            mixer_head_outputs=Site("mamba.out_proj", key="input"),
            mixer_heads="mamba_n_heads",
        ),
        "full_attention": {},
        "moe": dict(
            mlp="block_sparse_moe",
            # `hidden_states = moe_hidden_states + self.shared_mlp(hidden_states)` in the block's forward.
            mlp_output=Site(op="hidden_states_4", scale=_R),
            **router_sites("block_sparse_moe.router", indices_first=INDICES_FIRST),
            shared_expert_output=Site("shared_mlp", scale=_R),
        ),
        "dense": dict(mlp="shared_mlp", mlp_output=Site("shared_mlp", scale=_R)),
    },
    layout_of=_kinds,
)

FAMILIES = [GRANITEMOEHYBRID]
