"""nncanon: one interpretability surface for every decoder-only transformers family, on nnsight."""

import nnsight

from .demo import demo_dictionary, demo_model
from .errors import (
    BatchCoupledWarning,
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
from .versions import __version__ as __version__

# Remote (NDIF) requests ship nncanon's code by value, so a server without nncanon runs them.
nnsight.register(__name__)

__all__ = [
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
