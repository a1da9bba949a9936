"""nncanon: one interpretability surface for every decoder-only transformers family, on nnsight.

The public names are imported at their first use (`__getattr__`): ``import nncanon`` alone, and the command line's
``--help`` and argument errors, do not import torch, transformers and nnsight (3-4 s).
"""

from __future__ import annotations

import importlib
from typing import Any

from .versions import __version__ as __version__

_ERRORS = (
    "BatchCoupledWarning",
    "ConfigChanged",
    "DictionaryDetached",
    "DictionaryMismatch",
    "GradientNotAvailable",
    "InvalidArgument",
    "InvalidCheckpoint",
    "InvalidCollection",
    "InvalidDictionary",
    "InvalidInput",
    "InvalidLayer",
    "InvalidModel",
    "InvalidSkip",
    "InvalidWrite",
    "ModelChanged",
    "ModelUnavailable",
    "NestedTrace",
    "NncanonError",
    "NotInTrace",
    "OutOfOrderRead",
    "OutOfScopeModel",
    "QuantizationUnavailable",
    "SizeNotAvailable",
    "TokenizerNotFound",
    "UnknownFamilyError",
    "UnknownHookName",
    "UntestedTransformersWarning",
    "ValueNotAvailable",
)

#: Where each public name lives (a module of the package), imported at the name's first use.
_WHERE = {
    **dict.fromkeys(_ERRORS, "errors"),
    "StandardizedTransformer": "model",
    "SupportReport": "support",
    "demo_dictionary": "demo",
    "demo_model": "demo",
    "registered_model_types": "families",
    "twin": "proof.ladder",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """A public name (imported from its module), or a submodule (``nncanon.tools``, ``nncanon.sae``...)."""
    where = _WHERE.get(name)
    if where is not None:
        value = getattr(importlib.import_module(f".{where}", __name__), name)
        globals()[name] = value
        return value
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
