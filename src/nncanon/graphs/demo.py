"""The demo transcoders: one small JumpReLU transcoder per block of each demo model (`nncanon.demo_model`), trained
by ``scripts/train_demo_transcoders.py`` and shipped with nncanon as circuit-tracer transcoder sets
(``nncanon/demo/<name>-transcoders/``: ``config.yaml``, ``layer_<i>.safetensors``, ``training.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidArgument
from ..sae import Dictionary
from .formats import load_transcoders

#: Where the demo models and their transcoder sets are shipped (the package's ``demo`` folder: read as files here,
#: the entry-point module ``nncanon.demo`` is not imported).
DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"

#: The demo models with a shipped transcoder set.
DEMO_TRANSCODERS = ("gpt2", "llama", "hybrid")


def demo_transcoders_path(name: str) -> Path:
    """The ``config.yaml`` of the demo transcoder set of ``demo_model(name)``."""
    if name not in DEMO_TRANSCODERS:
        raise InvalidArgument(f"no demo transcoders for {name!r}: there are sets for the demo models "
                              f"{', '.join(map(repr, DEMO_TRANSCODERS))}")
    return DEMO_DIR / f"{name}-transcoders" / "config.yaml"


def demo_name(model: Any) -> str | None:
    """The demo model's name (``"gpt2"``, ``"llama"``, ``"hybrid"``) of a model loaded by `nncanon.demo_model`,
    else ``None``."""
    folder = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not folder:
        return None
    path = Path(folder).resolve()
    return path.name if path.parent == DEMO_DIR.resolve() and path.name in DEMO_TRANSCODERS else None


def demo_transcoders(model: Any = "gpt2", *, dtype: torch.dtype | None = None) -> list[Dictionary]:
    """The demo transcoders of a demo model: one JumpReLU transcoder (256 features, about 8 active per token) per
    block, reading ``mlp.hook_in`` and writing ``hook_mlp_out``, as `nncanon.sae.Dictionary` objects.

    Args:
        model: A demo model's name, or a model loaded by `nncanon.demo_model` (its dtype is then the default).
        dtype: The transcoders' dtype (default: the model's, else float32; shipped as float16).

    Raises:
        InvalidArgument: a name or model that is not one of the demo models.
    """
    if isinstance(model, str):
        name = model
    else:
        name = demo_name(model)
        if name is None:
            raise InvalidArgument("demo transcoders are for the demo models (nncanon.demo_model('gpt2'), 'llama', "
                                  "'hybrid'); this model was not loaded from them: pass transcoders trained on it")
        dtype = dtype or getattr(model, "dtype", None)
    return load_transcoders(demo_transcoders_path(name), dtype=dtype or torch.float32)
