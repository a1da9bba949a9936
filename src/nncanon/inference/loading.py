"""How a load finds its family: the registered record, else the inferred one (`family_for_load`)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import OutOfScopeModel, UnknownFamilyError
from ..families import Family, family_for
from ..proof.load import load_provenance
from .infer import InferredFamily, causal_lm_class, infer_family


def model_class_of(model: Any, config: Any, kwargs: dict) -> type:
    """The causal-LM class a load builds: the module's own, the folder's custom code where the user
    passed ``trust_remote_code=True`` (never set here), else transformers' class for the config."""
    if isinstance(model, torch.nn.Module):
        return type(model)
    auto_map = getattr(config, "auto_map", None) or {}
    if kwargs.get("trust_remote_code") and "AutoModelForCausalLM" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        options = {k: kwargs[k] for k in ("revision", "token") if k in kwargs}
        return get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], model, **options)
    return causal_lm_class(config)


def family_for_load(config: Any, model: Any, kwargs: dict) -> tuple[Family, InferredFamily | None]:
    """The registered family of ``config``, or one inferred from a twin where none is registered.

    Raises:
        UnknownFamilyError: nothing is registered and the inference found no list of blocks (the
            message says what was tried).
    """
    try:
        return family_for(config), None
    except OutOfScopeModel:
        raise  # not a residual-stream decoder by design: nothing to infer
    except UnknownFamilyError as unknown:
        try:
            inferred = infer_family(config, model_class_of(model, config, kwargs))
        except UnknownFamilyError as error:
            raise UnknownFamilyError(f"{unknown}\nnncanon then tried to infer it: {error}") from error
        except Exception as error:  # the inference met a structure it does not know: say so, do not guess
            raise UnknownFamilyError(
                f"{unknown}\nnncanon then tried to infer it, and the inference failed on this model's structure "
                f"({type(error).__name__}: {error}); please report it with the config"
            ) from error
        return inferred.family, inferred


def inferred_provenance(model: Any, verify: str, unserved: list | None = None) -> Any:
    """Prove an inferred family on a twin of ``model``'s config (always: an inferred record is a guess,
    so ``verify="never"`` still proves it) and apply the proof; the provenance says it was inferred."""
    from dataclasses import replace

    # The proof cache keys nncanon's code, not a custom-code model's own: such a model is proved afresh.
    custom = not type(model._module).__module__.startswith("transformers.")
    provenance = load_provenance(model, model._module.config, "always" if verify == "always" or custom else "auto",
                                 unserved, getattr(model, "quantization", None))
    if provenance.kind != "proved":
        return replace(provenance, text=f"inferred, and not proved: {provenance.text}")
    return replace(provenance, text=f"inferred and {provenance.text}")
