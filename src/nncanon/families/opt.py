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

NORMS_POST_LN = ("this OPT configuration is post-LN (do_layer_norm_before=False, as OPT-350m): its norms normalise the "
                 "stream after each sublayer is added, not a sublayer's input")


#: The MLP's norm runs where the block has flattened the tokens.
FLAT_NORM = ("OPT runs its MLP's norm (final_layer_norm) on the batch's tokens flattened, (b·s, d), where a trace's "
             "invokes cannot be told apart: its scale and normalised input are not served (read mlp_input's stream, "
             "layers[i].layer_input + attention_output, and norm it)")


def _declines(config: Any, layer: int) -> dict:
    flat = dict.fromkeys(("mlp_norm_scale", "mlp_normalized"), FLAT_NORM)
    if getattr(config, "do_layer_norm_before", True):
        return flat
    norms = dict.fromkeys(("attention_norm_scale", "attention_normalized", "mlp_norm_scale", "mlp_normalized"),
                          NORMS_POST_LN)
    return {
        "attention_output": POST_LN.format(what="attention"),
        "mlp_output": POST_LN.format(what="the MLP"),
        **norms,
        **flat,
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
