"""The demo dictionary: a small top-k SAE trained on the demo GPT-2's residual stream (``scripts/train_demo_sae.py``)."""

from __future__ import annotations

from pathlib import Path

from .dictionary import Dictionary

#: The demo dictionaries ``demo_dictionary`` loads, by name: the demo model they were trained on and their folder.
DEMO_DICTIONARIES = {"gpt2": "gpt2-sae"}


def demo_dictionary_path(name: str = "gpt2") -> Path:
    """The folder of demo dictionary ``name`` (a SAELens folder: ``cfg.json``, ``sae_weights.safetensors``)."""
    from ..demo import DEMO_DIR

    if name not in DEMO_DICTIONARIES:
        raise ValueError(f"unknown demo dictionary {name!r}; choose one of {', '.join(map(repr, DEMO_DICTIONARIES))}")
    return DEMO_DIR / DEMO_DICTIONARIES[name]


def demo_dictionary(name: str = "gpt2") -> Dictionary:
    """The demo dictionary for ``nncanon.demo_model(name)``: for ``"gpt2"``, a top-k SAE (256 features, 16 per
    token) on ``blocks.2.hook_resid_post``; ``training.json`` beside its weights holds how it was trained and its
    evaluation on held-out sentences."""
    return Dictionary.load(demo_dictionary_path(name))
