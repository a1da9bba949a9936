"""Mamba, FalconMamba and Mamba-2: pure state-space models, one mixer per block and no MLP.

``y = x + mixer(norm(x))`` on ``backbone.layers``; the mixer (a selective scan) is served as
``linear_attn`` and its output is the whole block update, so ``mlp`` is absent. With
``residual_in_fp32`` (the default) the residual is upcast before the add: in a bf16 model every
block outputs fp32 while the mixer's contribution stays bf16.

Mamba and FalconMamba have no heads (channels run through one scan each, into ``out_proj``);
Mamba-2's scan output, after its gated group RMSNorm, is ``num_heads × head_dim`` wide at
``out_proj``'s input, served per head (heads of one norm group are normalised jointly).
"""

from ..served import Site
from .base import Embeddings, Family

_SSM = dict(
    layers="backbone.layers",
    embed_tokens="backbone.embeddings",
    norm="backbone.norm_f",
    attention=None,
    mixer="mixer",
    mixer_output=Site("mixer"),
    mlp=None,
    mlp_output=None,
    residual="y = x + mixer(norm(x)) (x upcast to fp32 first when residual_in_fp32)",
    casts_head_input=True,
    embeddings=Embeddings(positions_kind="recurrent"),
)

MAMBA = Family(name="mamba", model_types=("mamba", "falcon_mamba"), **_SSM)

MAMBA2 = Family(
    name="mamba2",
    model_types=("mamba2",),
    mixer_head_outputs=Site("mixer.out_proj", key="input"),
    mixer_heads="num_heads",
    **_SSM,
)

FAMILIES = [MAMBA, MAMBA2]
