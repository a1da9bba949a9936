"""Zamba and Zamba2: Mamba blocks, and hybrid blocks whose shared transformer feeds the Mamba input.

A Mamba block is ``y = x + mamba(input_layernorm(x))``. A hybrid block runs a shared transformer
``T = feed_forward(pre_ff_layernorm(self_attn(input_layernorm(cat[x, embeddings]))))`` (no residual
inside it), projects it with ``linear`` and adds it to the *input* of its own Mamba mixer:
``y = x + mamba(norm(x + linear(T)))``. So the only term a hybrid block adds to the stream is its
Mamba mixer's output (``layers[i].linear_attn``, ``mamba_decoder.mamba``); the shared attention
(``layers[i].self_attn``) and MLP (``layers[i].mlp``) serve their own values (per-head outputs,
probabilities) but their contributions are declined: they reach the stream only through the mixer.

The shared blocks are distinct modules with tied weights (every ``num_mem_blocks``-th hybrid block
shares one set), so each hybrid block's values are its own. Zamba's attention runs at twice the
hidden width (``attention_head_dim = 2·hidden / heads``); Zamba2 adds per-block LoRA adapters.
Both Mamba mixers have heads at ``out_proj``'s input (``n_mamba_heads``).
"""

from ..served import Site
from .base import Embeddings, Family, MLPAnatomy

_REASON = (
    "layers[{layer}] is a hybrid block: its shared transformer (attention, then MLP) adds nothing to the "
    "residual stream; its output goes through `linear` into the input of the block's Mamba mixer, "
    "y = x + mamba(norm(x + linear(T(cat[x, embeddings])))), so its part of the block's update is inside "
    "layers[{layer}].linear_attn.linear_attention_output"
)


def _declines(config, layer: int) -> dict:
    if config.layers_block_type[layer] != "hybrid":
        return {}
    reason = _REASON.format(layer=layer)
    return {"attention_output": reason, "mlp_output": reason}


def _positions(config) -> str:
    """Rotary where the shared attention uses it (Zamba2's ``use_mem_rope``), else none (NoPE attention beside Mamba)"""
    return "rotary" if getattr(config, "use_mem_rope", False) else "nope"


def _zamba(name: str, shared: str, anatomy: MLPAnatomy | str = "auto") -> Family:
    return Family(
        name=name,
        model_types=(name,),
        embeddings=Embeddings(positions_kind=_positions),
        norm="model.final_layernorm",
        attention=None,
        mlp=None,
        mlp_output=None,
        declines=_declines,
        residual="mamba: y = x + mamba(norm(x)); hybrid: y = x + mamba(norm(x + linear(T(cat[x, embeddings]))))",
        layouts={
            "linear_attention": dict(
                mixer="mamba",
                mixer_output=Site("mamba"),
                mixer_head_outputs=Site("mamba.out_proj", key="input"),
                mixer_heads="n_mamba_heads",
            ),
            "hybrid": dict(
                mixer="mamba_decoder.mamba",
                mixer_output=Site("mamba_decoder.mamba"),
                mixer_head_outputs=Site("mamba_decoder.mamba.out_proj", key="input"),
                mixer_heads="n_mamba_heads",
                attention=f"{shared}.self_attn",
                attention_output=Site(f"{shared}.self_attn", index=0),
                head_outputs=Site(f"{shared}.self_attn.o_proj", key="input"),
                mlp=f"{shared}.feed_forward",
                mlp_output=Site(f"{shared}.feed_forward"),
                mlp_anatomy=anatomy,
            ),
        },
        layout_of=lambda config, layer: config.layers_block_type[layer],
    )


# Zamba2's MLP adds a per-block adapter to gate_up_proj's output and chunks the sum into the gate and linear paths.
_MLP2 = "shared_transformer.feed_forward"
_ZAMBA2_MLP = MLPAnatomy(down=f"{_MLP2}.down_proj", pre=f"{_MLP2}.gate_up_proj", linear=_MLP2,
                         activation=f"{_MLP2}.act_fn", linear_op=("torch_chunk_0", 1))

FAMILIES = [_zamba("zamba", "shared_transf"), _zamba("zamba2", "shared_transformer", _ZAMBA2_MLP)]
