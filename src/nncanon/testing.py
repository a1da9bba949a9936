"""Tiny offline models for tests, examples and ``nncanon families``: no hub, no download.

`tiny_tokenizer` trains a byte-level BPE tokenizer in code; `tiny_model` builds a registry
variant with random weights and wraps it in a `StandardizedTransformer`.
"""

from __future__ import annotations

from typing import Any

import torch

from .proof.prompts import PROMPTS, tiny_tokenizer
from .registry import Variant, variant

__all__ = ["PROMPTS", "tiny_hf_model", "tiny_model", "tiny_tokenizer"]


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

    from .proof.twin import perturb

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


def tiny_model(
    name: str | Variant,
    attn_implementation: str = "eager",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    verify: str = "never",
    **overrides: Any,
) -> Any:
    """A `StandardizedTransformer` over `tiny_hf_model` with `tiny_tokenizer`.

    ``verify`` defaults to ``"never"``: the invariant suite runs the checks on the variant itself
    (`nncanon.proof.verify`), which proves more than a twin of it would.
    """
    from .model import StandardizedTransformer

    hf = tiny_hf_model(name, attn_implementation=attn_implementation, seed=seed, dtype=dtype, **overrides)
    return StandardizedTransformer(hf, tokenizer=tiny_tokenizer(hf.config.get_text_config().vocab_size),
                                   verify=verify)
