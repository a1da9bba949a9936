"""Small trained demo models: ask them a fact and they answer it.

``demo_model(name)`` loads one of three causal LMs trained on ``corpus.txt`` (plain factual sentences
about capitals, landmarks, languages, currencies and rivers) by ``scripts/train_demo_models.py``:

* ``"gpt2"``: a GPT-2 block model (GPT2LMHeadModel, 4 layers, 4 heads, hidden 128);
* ``"llama"``: a Llama block model (LlamaForCausalLM, 4 layers, 4 query heads over 2 key/value heads);
* ``"hybrid"``: a Qwen3-Next style hybrid (Qwen3NextForCausalLM: three gated-DeltaNet layers, then one
  full-attention layer; a tiny mixture of experts).

Each gives " Paris" most of its probability after "The Eiffel Tower is in the city of", like a real
model does, so a recipe written for a hub model can be tried here offline first.

Example:
    >>> from nncanon import demo_model
    >>> model = demo_model("llama")
    >>> paris = model.tokenizer(" Paris", add_special_tokens=False).input_ids[0]
    >>> with model.trace("The Eiffel Tower is in the city of"):
    ...     p = model.next_token_probs[0, paris].save()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..model import StandardizedTransformer

#: The demo models ``demo_model`` loads.
DEMO_MODELS = ("gpt2", "llama", "hybrid")

#: The folder holding the corpus and one subfolder per demo model (weights, config, tokenizer).
DEMO_DIR = Path(__file__).resolve().parent


def demo_path(name: str) -> Path:
    """The folder of demo model ``name``, loadable by transformers' ``from_pretrained``."""
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name!r}; choose one of {', '.join(map(repr, DEMO_MODELS))}")
    return DEMO_DIR / name


def demo_model(name: str = "llama", **kwargs: Any) -> Any:
    """The trained demo model ``name`` as a `StandardizedTransformer`, loaded from the package folder.

    Args:
        name: One of ``DEMO_MODELS``: ``"gpt2"``, ``"llama"`` or ``"hybrid"``.
        **kwargs: Go to `StandardizedTransformer` (default ``attn_implementation="eager"``, so
            ``attention_probabilities`` is served, and ``dispatch=True``: the weights are loaded now).

    Raises:
        ValueError: for a name not in ``DEMO_MODELS``.
    """

    folder = demo_path(name)
    kwargs.setdefault("attn_implementation", "eager")
    kwargs.setdefault("dispatch", True)
    return StandardizedTransformer(str(folder), **kwargs)
