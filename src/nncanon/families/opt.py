"""OPT: the MLP is ``fc1``/``fc2`` on the block itself, run on a flattened ``(b·s, d)`` tensor.

The post-LN configuration (``do_layer_norm_before=False``, OPT-350m) normalises the stream after
each sublayer, so no tensor is what attention or the MLP adds to ``layer_input``: those two
values are declined there. Its lens runs ``project_out`` after the (absent) final norm.
"""

from typing import Any

from ..served import Site
from .base import Embeddings, Family

POST_LN = (
    "this OPT configuration is post-LN (do_layer_norm_before=False, as OPT-350m): the block "
    "normalises the stream after adding each sublayer, so no tensor is what {what} adds to layer_input"
)


def _declines(config: Any, layer: int) -> dict:
    if getattr(config, "do_layer_norm_before", True):
        return {}
    return {
        "attention_output": POST_LN.format(what="attention"),
        "mlp_output": POST_LN.format(what="the MLP"),
    }


OPT = Family(
    name="opt",
    model_types=("opt",),
    embeddings=Embeddings(positions="model.decoder.embed_positions", project="model.decoder.project_in"),
    layers="model.decoder.layers",
    embed_tokens="model.decoder.embed_tokens",
    norm="model.decoder.final_layer_norm",
    before_head=("model.decoder.project_out",),
    mlp=None,
    mlp_output=Site("fc2", flat=True),
    head_outputs=Site("self_attn.out_proj", key="input"),
    residual="h = x + self_attn(self_attn_layer_norm(x)); y = h + fc2(relu(fc1(final_layer_norm(h))))",
    declines=_declines,
)

FAMILIES = [OPT]
