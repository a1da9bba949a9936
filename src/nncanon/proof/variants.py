"""The registry's variants as models: random weights, moved off their initialisation as a twin's are.

The invariant suite and ``nncanon families`` run the one verifier on these models themselves (a variant is
already tiny: it needs no twin).
"""

from __future__ import annotations

from typing import Any

import torch

from ..registry import Variant, variant
from .twin import perturb


def tiny_hf_model(
    name: str | Variant,
    attn_implementation: str = "eager",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Any:
    """The bare transformers model of a registry variant, random weights from ``seed``, in eval mode.

    The weights are the model's own initialisation, each then moved off it by a little noise
    (`nncanon.proof.twin.perturb`): no bias, gain or branch stays at an exact zero or one.
    """
    import transformers

    spec = variant(name) if isinstance(name, str) else name
    config = spec.build_config(**overrides)
    torch.manual_seed(seed)
    if spec.model_class is not None:
        config._attn_implementation = attn_implementation
        model = getattr(transformers, spec.model_class)(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    perturb(model)
    return model.to(dtype).eval()
