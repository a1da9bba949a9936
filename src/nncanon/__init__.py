"""nncanon: one interpretability surface for every decoder-only transformers family, on nnsight.

The public names are imported at their first use (`__getattr__`): ``import nncanon`` alone, and the command line's
``--help`` and argument errors, do not import torch, transformers and nnsight (3-4 s).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .versions import __version__ as __version__

if TYPE_CHECKING:  # (for type checkers and the API reference, which read the names without importing them)
    from .demo import demo_dictionary, demo_model
    from .errors import (
        BatchCoupledWarning,
        CannotWrite,
        ConfigChanged,
        DictionaryDetached,
        DictionaryMismatch,
        GradientNotAvailable,
        InvalidArgument,
        InvalidCheckpoint,
        InvalidCollection,
        InvalidDictionary,
        InvalidInput,
        InvalidLayer,
        InvalidModel,
        InvalidSkip,
        InvalidWrite,
        ModelChanged,
        ModelUnavailable,
        NestedTrace,
        NncanonError,
        NotInTrace,
        OutOfOrderRead,
        OutOfScopeModel,
        QuantizationUnavailable,
        SizeNotAvailable,
        TokenizerNotFound,
        UnknownFamilyError,
        UnknownHookName,
        UntestedTransformersWarning,
        ValueNotAvailable,
    )
    from .families import registered_model_types
    from .model import StandardizedTransformer
    from .proof.ladder import twin
    from .support import SupportReport

_ERRORS = (
    "BatchCoupledWarning",
    "CannotWrite",
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

__all__ = [
    "BatchCoupledWarning",
    "CannotWrite",
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
    "StandardizedTransformer",
    "SupportReport",
    "TokenizerNotFound",
    "UnknownFamilyError",
    "UnknownHookName",
    "UntestedTransformersWarning",
    "ValueNotAvailable",
    "demo_dictionary",
    "demo_model",
    "registered_model_types",
    "twin",
]


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
