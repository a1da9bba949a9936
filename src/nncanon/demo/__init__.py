"""Small trained demo models: ask them a fact and they answer it.

``demo_model(name)`` loads one of three causal LMs trained on ``corpus.txt`` (plain factual sentences
about capitals, landmarks, languages, currencies and rivers) by ``scripts/train_demo_models.py``:

* ``"gpt2"``: a GPT-2 block model (GPT2LMHeadModel, 4 layers, 4 heads, hidden 128);
* ``"llama"``: a Llama block model (LlamaForCausalLM, 4 layers, 4 query heads over 2 key/value heads);
* ``"hybrid"``: a Qwen3-Next style hybrid (Qwen3NextForCausalLM: three gated-DeltaNet layers, then one
  full-attention layer; a tiny mixture of experts).

Each gives " Paris" most of its probability after "The Eiffel Tower is in the city of", like a real
model does, so a recipe written for a hub model can be tried here offline first.

``demo_dictionary(name)`` loads a dictionary trained on a demo model's stream by ``scripts/train_demo_sae.py``:
for ``"gpt2"``, a top-k SAE on ``blocks.2.hook_resid_post`` (an `nncanon.sae.Dictionary`).

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
from ..sae import Dictionary

#: The demo models ``demo_model`` loads.
DEMO_MODELS = ("gpt2", "llama", "hybrid")

#: The folder holding the corpus and one subfolder per demo model (weights, config, tokenizer).
DEMO_DIR = Path(__file__).resolve().parent

#: The demo dictionaries ``demo_dictionary`` loads: the demo model each was trained on, and its folder.
DEMO_DICTIONARIES = {"gpt2": "gpt2-sae"}


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


def demo_dictionary_path(name: str = "gpt2") -> Path:
    """The folder of demo dictionary ``name`` (a SAELens folder: ``cfg.json``, ``sae_weights.safetensors``, and
    ``training.json``: how it was trained and its evaluation on held-out sentences)."""
    if name not in DEMO_DICTIONARIES:
        raise ValueError(f"unknown demo dictionary {name!r}; choose one of {', '.join(map(repr, DEMO_DICTIONARIES))}")
    return DEMO_DIR / DEMO_DICTIONARIES[name]


def demo_dictionary(name: str = "gpt2") -> Dictionary:
    """The demo dictionary of ``demo_model(name)``: for ``"gpt2"``, a top-k SAE (256 features, 16 per token) on
    ``blocks.2.hook_resid_post``, trained by ``scripts/train_demo_sae.py`` (260 KB, shipped with nncanon).

    Raises:
        ValueError: for a name not in ``DEMO_DICTIONARIES``.
    """
    return Dictionary.load(demo_dictionary_path(name))
