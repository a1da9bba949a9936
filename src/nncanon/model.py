"""`StandardizedTransformer`: any decoder-only transformers model, one surface, proved on a twin of its config.

The model is the load (`nncanon.loading`), the mounted surface (`nncanon.mounted.MountedModel`), the load-time
proof (`nncanon.proof.load`, or `nncanon.inference` for a family nobody registered) and its provenance.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .errors import ModelChanged, UntestedTransformersWarning
from .families import Family
from .inference.loading import family_for_load, inferred_provenance
from .loading import (
    causal_lm_config,
    config_of,
    note_transformers_error,
    refuse_folder_without_weights,
    tokenizer_of,
    without_hub_kernels,
)
from .mounted import MountedModel
from .proof.load import VERIFY_MODES, load_provenance
from .quantization import Quantization, declared, detected, refuse_unavailable, signature
from .quiet import kernel_notices_filtered
from .versions import untested_transformers


def _kind(quantization: Quantization | None) -> tuple:
    """What must agree between the proof's and the model's quantization: method, scheme and dtype."""
    return (None, "", torch.float32) if quantization is None else (
        quantization.method, quantization.scheme, quantization.dtype)


def _unreplaced(quantization: Quantization | None) -> bool:
    """Whether a float32 model without quantized layers is what ``quantization`` loads: its quantizer replaced none
    of the model's layers (transformers' bitsandbytes replaces ``nn.Linear`` itself only, not Falcon's subclass),
    as it replaced none of the twin's."""
    return quantization is not None and quantization.method is not None and quantization.dtype == torch.float32


def _named(quantization: Quantization | None) -> str:
    return "in float32, unquantized" if quantization is None else f"quantized or cast as {quantization.describe()}"


def _layers(found: tuple) -> str:
    classes, dtype = found
    return ", ".join(f"{count} {name}" for name, count in classes) + f"; {str(dtype).removeprefix('torch.')}"


class StandardizedTransformer(MountedModel):
    """A decoder-only transformers model with one surface for every family.

    Args:
        model: A hub id, a local folder, or a built ``PreTrainedModel`` (then pass ``tokenizer=``).
        verify: ``"auto"`` (default): prove every value on a twin of this config (a shrunk copy with
            random weights, on the CPU) unless the proof cache has that proof; ``"always"``: prove it
            again; ``"never"``: serve the values unproved (``support()`` says so). A value whose proof
            fails is declined, naming the failed check and its numbers. See "How nncanon knows a
            value is right" in the docs.
        family: The `Family` to serve the model with, instead of the registered one for its model type.
        **kwargs: Go to transformers and nnsight as they do for ``TransformersModel``:
            ``device="cpu"``, ``device_map``, ``dtype``, ``attn_implementation``, ``dispatch``...

    The tokenizer pads on the left, so ``[:, -1]`` is every prompt's last token in a batch.
    Loading runs no forward pass on the model (the proof runs on the twin).

    Example:
        >>> model = StandardizedTransformer("openai-community/gpt2", attn_implementation="eager")
        >>> with model.trace("The Eiffel Tower is in the city of"):
        ...     attention = model.layers[9].self_attn.attention_output.save()
        ...     probs = model.next_token_probs.save()
    """

    def __init__(
        self, model: Any, *args: Any, tokenizer: Any = None, verify: str = "auto", family: Family | None = None,
        **kwargs: Any,
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r} is not one of {', '.join(map(repr, VERIFY_MODES))}")
        config = causal_lm_config(config_of(model, kwargs))
        quantization = declared(config, kwargs, model if isinstance(model, torch.nn.Module) else None)
        refuse_unavailable(quantization, kwargs)  # (before any weight is loaded)
        inferred = None
        if family is None:
            family, inferred = family_for_load(config, model, kwargs)
        without_hub_kernels(model, kwargs)
        untested = untested_transformers()
        if untested is not None:
            warnings.warn(untested, UntestedTransformersWarning, stacklevel=2)
        if not isinstance(model, torch.nn.Module):
            if kwargs.get("dispatch"):
                refuse_folder_without_weights(model, kwargs)
            kwargs.setdefault("task", "text-generation")
            if tokenizer is None:
                tokenizer = tokenizer_of(model, kwargs)
        try:
            super().__init__(model, *args, family=family, tokenizer=tokenizer, **kwargs)
        except Exception as error:
            note_transformers_error(error, config)
            raise
        self._inferred = inferred
        self._quantization = quantization
        self._signature: tuple | None = None  # the proof's model as its layers hold it (`quantization.signature`)
        self._provenance = self._prove(verify, self._unserved)
        self._check_unchanged()  # (a model passed built, or dispatched: its layers as proved)

    def _prove(self, verify: str, unserved: list | None = None) -> Any:
        """Prove this model's values on a twin of its config (see ``verify``); decline what fails.
        ``unserved``: what `mount` returned."""
        with kernel_notices_filtered():
            if self._inferred is None:
                return load_provenance(self, self._module.config, verify, unserved, self._quantization)
            return inferred_provenance(self, verify, unserved)

    @property
    def quantization(self) -> Quantization | None:
        """How the model is quantized or cast, as the proof's twin was (`nncanon.quantization.Quantization`:
        ``bitsandbytes nf4, compute float32``...); ``None`` for a float32 model."""
        return self._quantization

    def interleave(self, *args: Any, **kwargs: Any) -> Any:
        """Run a trace, first checking that the model is still the one its proof was made for (`ModelChanged`)."""
        self._check_unchanged()
        return super().interleave(*args, **kwargs)

    def _check_unchanged(self) -> None:
        """Raise `ModelChanged` where the model's linear layers or dtype changed since the proof (a layer swapped
        for a quantized one, a cast): taken at the first trace of the loaded weights, compared at every later one."""
        if self.__dict__.get("_provenance") is None or getattr(self._module, "device", None) == torch.device("meta"):
            return
        now = signature(self._module)
        if self._signature is None:
            self._signature = now
            self.guard_quantized_weights()
            found = detected(self._module)
            if _kind(found) == _kind(self._quantization) or (found is None and _unreplaced(self._quantization)):
                return
            self._signature = None
            raise ModelChanged(
                f"the model is {_named(found)} but its proof was made for a model {_named(self._quantization)}: "
                "it was quantized or cast after the load. Load it as it is now (StandardizedTransformer(model, ...), "
                "or quantization_config=/dtype= at the load), so that the proof's twin is made like it."
            )
        if now != self._signature:
            raise ModelChanged(
                "the model changed since its proof: its linear layers or dtype are not those it was proved with "
                f"(now {_layers(now)}; proved with {_layers(self._signature)}): a layer was swapped (quantized) or "
                "the model cast after the load. Load it again as it is now, so that the proof's twin is made like it."
            )

    @property
    def inferred(self) -> Any:
        """The `nncanon.inference.InferredFamily` where no family is registered for this model type
        (its record was inferred from a twin and proved on it); ``None`` for a registered family."""
        return self._inferred

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # A remote request ships the model by value (nncanon is not on the server): it travels as the
        # MountedModel it is, the surface with its state, without the load and the proof, which the server never
        # runs (their code would travel with it otherwise, down to the proof's process-local state).
        return (MountedModel.__new__, (MountedModel,), self.__getstate__())

    def dispatch(self) -> None:
        """Load the real weights (a model built on meta); a folder with a config and no weights is refused by name."""
        if not self.dispatched and self.args:
            refuse_folder_without_weights(self.args[0], self.kwargs)
        super().dispatch()
        self._check_unchanged()  # the loaded layers are those the proof was made for (and their weights guarded)
