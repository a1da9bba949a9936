"""The registry: which `Family` serves each ``config.model_type``.

To add a family, write a module here that defines ``FAMILIES = [Family(...)]`` (every module of
this package is read) and add its record to ``model_registry/``. The invariant suite picks it up.
See the docs section "Adding a family".
"""

from __future__ import annotations

import pkgutil
from importlib import import_module
from typing import Any

from ..errors import OutOfScopeModel, UnknownFamilyError
from ..scope import NOT_YET, out_of_scope_reason
from .base import Embeddings, Family, LogitStep, MLPAnatomy

ADDING_A_FAMILY = "docs/adding-a-family.md"


def _collect() -> dict[str, Family]:
    registry: dict[str, Family] = {}
    modules = sorted(info.name for info in pkgutil.iter_modules(__path__) if info.name != "base")
    for module in modules:
        for family in import_module(f"{__name__}.{module}").FAMILIES:
            for model_type in family.model_types:
                if model_type in registry:
                    raise RuntimeError(f"model_type {model_type!r} is registered twice")
                registry[model_type] = family
    return registry


REGISTRY: dict[str, Family] = _collect()


def registered_model_types() -> list[str]:
    """Every ``model_type`` nncanon serves, sorted."""
    return sorted(REGISTRY)


def family_for(config: Any) -> Family:
    """The family serving a model with ``config``; `UnknownFamilyError` if none does (`OutOfScopeModel`,
    naming why, for a type nncanon does not serve by design: see `nncanon.scope`)."""
    model_type = getattr(config, "model_type", None)
    family = REGISTRY.get(model_type)
    if family is None and (reason := out_of_scope_reason(model_type)) is not None:
        raise OutOfScopeModel(
            f"nncanon does not serve model_type {model_type!r} ({type(config).__name__}): {reason}. "
            f"nncanon serves decoder-only language models whose blocks add to a residual stream; the "
            f"served types are listed on docs/families.md."
        )
    if family is None and (reason := NOT_YET.get(model_type)) is not None:
        raise UnknownFamilyError(
            f"nncanon does not serve model_type {model_type!r} ({type(config).__name__}) yet: {reason}."
        )
    if family is None:
        raise UnknownFamilyError(
            f"nncanon has no family for model_type {model_type!r} "
            f"({type(config).__name__}). Registered: {', '.join(registered_model_types())}. "
            f"To add one, describe where its blocks keep their values in a module of "
            f"nncanon/families/ and a record in model_registry/ ({ADDING_A_FAMILY})."
        )
    return family


__all__ = ["REGISTRY", "Embeddings", "Family", "LogitStep", "MLPAnatomy", "family_for", "registered_model_types"]
