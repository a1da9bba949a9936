"""GPT-OSS: a Llama block whose MLP is a mixture of experts returning ``(output, router_scores)``.

Attention has a learned sink per head (a logit column the softmax includes and the values do
not); the probabilities served are the ones that multiply the values, without the sink. The
router ``mlp.router`` (with a bias) picks the top-k logits and softmaxes them; the experts add
a bias and use a clamped SwiGLU.
"""

from ..served import Site
from .base import Family

GPT_OSS = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    mlp_output=Site("mlp", index=0),
    router_logits=Site("mlp.router", op="router_logits_0", flat=True),
    expert_weights=Site("mlp.router", index=1, flat=True),
    expert_indices=Site("mlp.router", index=2, flat=True),
)

FAMILIES = [GPT_OSS]
