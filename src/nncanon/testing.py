"""Tiny offline models for tests and examples: no hub, no download. Nothing in the package imports this module.

`tiny_tokenizer` trains a byte-level BPE tokenizer in code (`nncanon.proof.prompts`); `tiny_hf_model` builds a
registry variant with random weights (`nncanon.proof.variants`); `tiny_model` wraps it in a
`StandardizedTransformer`.
"""

from __future__ import annotations

from typing import Any

import torch

from .model import StandardizedTransformer
from .proof.prompts import PROMPTS, tiny_tokenizer
from .proof.variants import tiny_hf_model
from .registry import Variant

__all__ = ["PROMPTS", "tiny_hf_model", "tiny_model", "tiny_tokenizer"]


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
    hf = tiny_hf_model(name, attn_implementation=attn_implementation, seed=seed, dtype=dtype, **overrides)
    return StandardizedTransformer(hf, tokenizer=tiny_tokenizer(hf.config.get_text_config().vocab_size),
                                   verify=verify)
