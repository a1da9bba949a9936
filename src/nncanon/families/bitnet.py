"""BitNet b1.58: a Llama block whose attention norms all heads together before its output projection.

``h = x + self_attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))``: the contributions
are the modules' outputs, as in Llama. Inside the attention, ``o_proj(attn_sub_norm(heads))``: an
RMSNorm over the concatenated heads sits between them and ``o_proj``. ``attention_head_outputs`` is
each head's own output, the norm's input (zero a head there and it is gone, as with its attention
probabilities); a head reaches the stream through the norm as it ran on all heads together and its
slice of ``o_proj`` (``tools.attention_head_contributions``). The MLP norms its hidden layer
(``ffn_sub_norm``) before ``down_proj``, inside ``mlp``: its neurons are what ``down_proj`` receives, the norm's
output (``ffn_sub_norm(act(gate) · up)``).
"""

from ..served import Site
from .base import Family, MLPAnatomy

BITNET = Family(
    name="bitnet",
    model_types=("bitnet",),
    head_outputs=Site("self_attn.attn_sub_norm", key="input"),
    head_norm="self_attn.attn_sub_norm",
    head_projection="self_attn.o_proj",
    mlp_anatomy=MLPAnatomy(down="mlp.down_proj", pre="mlp.gate_proj", linear="mlp.up_proj", activation="mlp.act_fn",
                           hidden_norm="mlp.ffn_sub_norm"),
    residual="h = x + attn(input_layernorm(x)), attn = o_proj(attn_sub_norm(heads)); "
    "y = h + mlp(post_attention_layernorm(h))",
)

FAMILIES = [BITNET]
