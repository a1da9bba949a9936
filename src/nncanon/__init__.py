"""nncanon: one interpretability surface for every decoder-only transformers family, on nnsight."""

from .errors import InvalidSkip, InvalidWrite, NncanonError, UnknownFamilyError, ValueNotAvailable
from .families import registered_model_types
from .model import StandardizedTransformer
from .support import SupportReport

__version__ = "0.1.0"

__all__ = [
    "InvalidSkip",
    "InvalidWrite",
    "NncanonError",
    "StandardizedTransformer",
    "SupportReport",
    "UnknownFamilyError",
    "ValueNotAvailable",
    "registered_model_types",
]
