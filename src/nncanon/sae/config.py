"""A dictionary's configuration, read from a SAELens ``cfg.json`` (any SAELens version) without SAELens.

SAELens writes two layouts: before 6.0 every field sits at the top level (``hook_point`` or ``hook_name``,
``activation_fn_str``, ``normalize_activations`` as a bool...); from 6.0 the model-facing fields move under
``metadata`` (``hook_name``, ``hook_head_index``, ``hook_name_out``, ``model_name``...). `read_config` accepts both,
as SAELens's own ``handle_config_defaulting`` does, and refuses what nncanon cannot run with a named error listing
what it can.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import InvalidDictionary
from .config_types import check_config_types

#: The architectures a dictionary may have: SAELens's inference names. ``batchtopk`` runs as ``jumprelu`` with its
#: threshold (SAELens saves a trained BatchTopK SAE as a JumpReLU one); the transcoders map one site to another.
ARCHITECTURES = ("standard", "topk", "batchtopk", "jumprelu", "gated", "transcoder", "skip_transcoder",
                 "jumprelu_transcoder", "jumprelu_skip_transcoder")

#: What each architecture's activation is: ``relu``, ``topk`` (per token), ``jumprelu`` (a threshold per feature)
#: or ``gated`` (a gate and a magnitude path).
ACTIVATION_OF = {"standard": "relu", "topk": "topk", "batchtopk": "jumprelu", "jumprelu": "jumprelu",
                 "gated": "gated", "transcoder": "relu", "skip_transcoder": "relu",
                 "jumprelu_transcoder": "jumprelu", "jumprelu_skip_transcoder": "jumprelu"}

#: The input normalisations SAELens writes that run on a single token: ``none``; ``expected_average_only_in`` (a
#: constant factor SAELens keeps outside the folder, folded in at load: identity unless one is given);
#: ``constant_norm_rescale`` (each token scaled to norm ``sqrt(d_in)``, the scale undone on the output);
#: ``layer_norm`` (each token centred and divided by its standard deviation, undone on the output).
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64}


def dtype_of(name: Any) -> torch.dtype:
    """A dtype from its SAELens spelling (``"float32"``, ``"torch.bfloat16"``) or a `torch.dtype`."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise InvalidDictionary(f"dtype {name!r} is not one a dictionary can have: give one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class DictionaryConfig:
    """What a dictionary computes and where it reads and writes.

    Attributes:
        architecture: One of `ARCHITECTURES`.
        d_in: Width of what the encoder reads (for ``reshape_activations="hook_z"``: heads × head width).
        d_sae: Number of features.
        d_out: Width of what the decoder writes (``d_in`` for an SAE; a transcoder's output site's width).
        dtype: The weights' dtype; the dictionary runs in it and attaches to a model that runs in it.
        k: For ``topk``, how many features each token keeps.
        rescale_acts_by_decoder_norm: ``topk``: pre-activations are scaled by the decoder rows' norms before the
            top-k, and features divided by them before decoding (SAELens's ``rescale_acts_by_decoder_norm``).
        apply_b_dec_to_input: ``b_dec`` is subtracted from the input before encoding (SAEs only).
        normalize_activations: One of `NORMALIZATIONS`.
        reshape_activations: ``"hook_z"``: the input is ``[..., heads, head_dim]``, flattened to ``d_in`` and the
            reconstruction unflattened back; ``"none"``.
        hook_name: Where the dictionary reads (a TransformerLens hook name, an nncanon value, a module path).
        hook_head_index: The one head the dictionary reads (its input is ``value[..., head, :]``), or ``None``.
        hook_name_out: A transcoder's output site (``None`` for an SAE: it writes where it reads).
        hook_head_index_out: The one head a transcoder writes, or ``None``.
        model_name: The model the dictionary was trained on, as its config says (informational).
        source: The config as read (every field, for the record).
    """

    architecture: str
    d_in: int
    d_sae: int
    d_out: int
    dtype: torch.dtype = torch.float32
    k: int | None = None
    rescale_acts_by_decoder_norm: bool = False
    apply_b_dec_to_input: bool = False
    normalize_activations: str = "none"
    reshape_activations: str = "none"
    hook_name: str | None = None
    hook_head_index: int | None = None
    hook_name_out: str | None = None
    hook_head_index_out: int | None = None
    model_name: str | None = None
    source: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def activation(self) -> str:
        """``relu``, ``topk``, ``jumprelu`` or ``gated`` (`ACTIVATION_OF`)."""
        return ACTIVATION_OF[self.architecture]

    @property
    def transcoder(self) -> bool:
        """Whether the dictionary maps one site to another (it has ``hook_name_out``, or a transcoder architecture)."""
        return "transcoder" in self.architecture or self.hook_name_out is not None

    @property
    def skip(self) -> bool:
        """Whether a skip connection ``x @ W_skip.T`` is added to the reconstruction (skip transcoders)."""
        return "skip" in self.architecture

    def replaced(self, **changes: Any) -> DictionaryConfig:
        """A copy with ``changes``."""
        return replace(self, **changes)


def _refuse(what: str, value: Any, allowed: tuple, where: str) -> InvalidDictionary:
    return InvalidDictionary(f"{where}: {what} {value!r} is not one nncanon runs; it runs {', '.join(allowed)}")


def read_config(raw: dict, where: str = "the dictionary's cfg.json") -> DictionaryConfig:
    """The `DictionaryConfig` of a SAELens ``cfg.json`` (``raw``, parsed), either layout.

    Raises:
        InvalidDictionary: a field is missing or has a value nncanon does not run (naming ``where`` and the
            values it runs); a field's JSON type is not the one it has (`check_config_types`).
    """
    check_config_types(raw, where)
    metadata = raw.get("metadata") or {}
    merged = {**raw, **{k: v for k, v in metadata.items() if v is not None}}
    renamed = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
               "activation_fn_str": "activation_fn"}
    for old, new in renamed.items():
        if old in merged and merged.get(new) is None:
            merged[new] = merged[old]
    architecture = merged.get("architecture") or "standard"
    activation = merged.get("activation_fn")
    kwargs = merged.get("activation_fn_kwargs") or {}
    if architecture == "standard" and activation == "topk":  # SAELens before 6.0 wrote top-k this way
        architecture = "topk"
    if architecture not in ARCHITECTURES:
        raise _refuse("architecture", architecture, ARCHITECTURES, where)
    if activation not in (None, "relu", "topk") and architecture in ("standard", "transcoder", "skip_transcoder"):
        raise _refuse("activation_fn", activation, ("relu", "topk"), where)
    for name in ("d_in", "d_sae"):
        if not isinstance(merged.get(name), int):
            raise InvalidDictionary(f"{where} has no integer {name!r} (it has {sorted(raw)})")
    normalize = merged.get("normalize_activations", "none")
    if isinstance(normalize, bool):  # SAELens before 6.0
        normalize = "expected_average_only_in" if normalize else "none"
    normalize = "none" if normalize is None else normalize
    if normalize not in NORMALIZATIONS:
        raise _refuse("normalize_activations", normalize, NORMALIZATIONS, where)
    hook_name = merged.get("hook_name")
    reshape = merged.get("reshape_activations")
    if reshape is None:
        reshape = "hook_z" if isinstance(hook_name, str) and hook_name.endswith("hook_z") else "none"
    if reshape not in ("none", "hook_z"):
        raise _refuse("reshape_activations", reshape, ("none", "hook_z"), where)
    k = merged.get("k", kwargs.get("k"))
    if architecture == "topk" and not isinstance(k, int):
        raise InvalidDictionary(f"{where}: a topk dictionary needs an integer k (it has k={k!r})")
    transcoder = "transcoder" in architecture or merged.get("hook_name_out") is not None
    apply_b_dec = bool(merged.get("apply_b_dec_to_input", not transcoder))
    if transcoder and apply_b_dec:
        raise InvalidDictionary(f"{where}: apply_b_dec_to_input is set on a transcoder; SAELens refuses it too "
                                "(b_dec is in the output's space, not the input's)")
    d_out = merged.get("d_out", merged["d_in"]) if transcoder else merged["d_in"]
    return DictionaryConfig(
        architecture=architecture, d_in=merged["d_in"], d_sae=merged["d_sae"], d_out=int(d_out),
        dtype=dtype_of(merged.get("dtype", "float32")), k=k if architecture == "topk" else None,
        rescale_acts_by_decoder_norm=bool(merged.get("rescale_acts_by_decoder_norm", False)),
        apply_b_dec_to_input=apply_b_dec, normalize_activations=normalize, reshape_activations=reshape,
        hook_name=hook_name, hook_head_index=merged.get("hook_head_index"),
        hook_name_out=merged.get("hook_name_out"), hook_head_index_out=merged.get("hook_head_index_out"),
        model_name=merged.get("model_name"), source=dict(raw),
    )
