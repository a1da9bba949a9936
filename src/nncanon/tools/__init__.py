"""Research tools on the standard surface: they work on every registered family, with no family code.

One small module per tool:

- `logit_lens`: every layer's residual stream through the model's head, in one forward; a heatmap.
- `patchscope`: a hidden state from a source prompt patched into a target prompt.
- `steering`: add ``factor · vector`` to the stream at chosen layers and positions.
- `patching`: activation patching, one patch or batched sweeps over layers, positions and heads.
- `ablation`: zero and mean ablation of heads, neurons, attention, MLPs and blocks; a sweep over every head.
- `heads`: each head's contribution through its slice of the output projection.
- `attribution`: direct logit attribution of heads, neurons and sublayers.
- `attribution_patching`: the first-order estimate of patching every head and sublayer, in one backward.
- `cache`: every standard value of every layer from one forward.

See ``docs/tools.md`` for a runnable example of each.
"""

from ..reading import head_count
from ..resuming import next_token_only, resume_at, streams_entering
from .ablation import (
    head_ablation_sweep,
    mean_ablate,
    mean_values,
    skip_blocks,
    zero_ablate,
    zero_ablate_attention,
    zero_ablate_block,
    zero_ablate_heads,
    zero_ablate_mlp,
    zero_ablate_neurons,
)
from .attribution import FrozenNorm, LogitAttribution, direct_logit_attribution, freeze_norm
from .attribution_patching import OVER, AttributionPatching, attribution_patching
from .cache import ActivationCache, cache_activations
from .heads import attention_head_contributions, head_norm, output_projection, projection_input, projection_weights
from .logit_lens import lens_top_tokens, logit_lens, plot_logit_lens
from .patching import activation_patching, clean_values, last_token_logits, logit_difference, patch, run_metric
from .patchscope import IDENTITY_TARGET, patchscope, patchscope_generate, source_states
from .steering import steer

__all__ = [
    "IDENTITY_TARGET",
    "OVER",
    "ActivationCache",
    "AttributionPatching",
    "FrozenNorm",
    "LogitAttribution",
    "activation_patching",
    "attention_head_contributions",
    "attribution_patching",
    "cache_activations",
    "clean_values",
    "direct_logit_attribution",
    "freeze_norm",
    "head_ablation_sweep",
    "head_count",
    "head_norm",
    "last_token_logits",
    "lens_top_tokens",
    "logit_difference",
    "logit_lens",
    "mean_ablate",
    "mean_values",
    "next_token_only",
    "output_projection",
    "patch",
    "patchscope",
    "patchscope_generate",
    "plot_logit_lens",
    "projection_input",
    "projection_weights",
    "resume_at",
    "run_metric",
    "skip_blocks",
    "source_states",
    "steer",
    "streams_entering",
    "zero_ablate",
    "zero_ablate_attention",
    "zero_ablate_block",
    "zero_ablate_heads",
    "zero_ablate_mlp",
    "zero_ablate_neurons",
]
