"""Nemotron-H: one ``mixer`` per block, whose kind is ``config.layers_block_type[i]``.

Every block is ``y = x + mixer(norm(x))``; the mixer is a Mamba-2 scan (``linear_attention``,
served as ``linear_attn``), softmax attention (``full_attention``, served as ``self_attn``), a
dense MLP (``mlp``) or a mixture of experts (``moe``, served as ``mlp``). So a block serves one
contribution; the others are absent, not declined. The MoE's routed part passes through the
optional latent projections (``fc1_latent_proj``/``fc2_latent_proj``) and its shared experts run on
the MoE's input; the router computes its logits in fp32 (``mixer.gate``).
"""

from ..served import Site
from .base import Embeddings, Family

NEMOTRON_H = Family(
    name="nemotron_h",
    model_types=("nemotron_h",),
    embeddings=Embeddings(positions_kind="nope"),
    embed_tokens="model.embeddings",
    norm="model.norm_f",
    attention=None,
    mlp=None,
    mlp_output=None,
    residual="y = x + mixer(norm(x)), mixer ∈ {Mamba-2, attention, MLP, MoE} by block type",
    layouts={
        "linear_attention": dict(
            mixer="mixer",
            mixer_output=Site("mixer"),
            mixer_head_outputs=Site("mixer.out_proj", key="input"),
            mixer_heads="mamba_num_heads",
        ),
        "full_attention": dict(
            attention="mixer",
            attention_output=Site("mixer", index=0),
            head_outputs=Site("mixer.o_proj", key="input"),
        ),
        "mlp": dict(mlp="mixer", mlp_output=Site("mixer")),
        "moe": dict(
            mlp="mixer",
            mlp_output=Site("mixer"),
            router_logits=Site("mixer.gate", op="router_logits_0", flat=True),
            expert_weights=Site("mixer.gate", index=1, flat=True),
            expert_indices=Site("mixer.gate", index=2, flat=True),
            shared_expert_output=Site("mixer.shared_experts"),
        ),
    },
    layout_of=lambda config, layer: config.layers_block_type[layer],
)

FAMILIES = [NEMOTRON_H]
