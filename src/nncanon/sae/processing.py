"""The model processing a dictionary was trained under, applied to what it reads and undone on what it writes.

SAELens records how it loaded the model a dictionary was trained on: ``cfg.json`` ``metadata.model_class_name``
(``"HookedTransformer"`` by default) and ``metadata.model_from_pretrained_kwargs`` (before SAELens 6.0 both at the
top level). SAELens loads a ``HookedTransformer`` with ``from_pretrained_no_processing(**kwargs)``: no processing
unless a kwarg turns one on. TransformerLens's processing rewrites weights so that some hooks see other values than
the unprocessed model computes; a dictionary trained there reads those. nncanon reads the unprocessed model, so it
maps each value a dictionary reads to what the processed model computes there (a function of the served value and
the model's weights), and maps what the dictionary writes back:

==================================  ===============================================================================
recorded kwarg                      what the dictionary reads, from the value nncanon serves
==================================  ===============================================================================
``center_writing_weights``          on a LayerNorm model: every write to the stream is centred over the width, so
                                    ``hook_resid_pre/mid/post``, ``hook_attn_out``, ``hook_mlp_out``,
                                    ``attn.hook_result`` (each head's, as ``W_O`` is centred),
                                    ``hook_embed``, ``hook_pos_embed`` (``W_E``, ``W_pos`` are centred too; and a
                                    module's output that is one of them) are ``x - x.mean(-1)``; every other hook
                                    is unchanged (a LayerNorm removes the mean anyway). On an RMSNorm model
                                    TransformerLens skips it (with a warning): a no-op.
``fold_value_biases``               the value bias ``b_V`` moves into the output bias: ``hook_v`` is
                                    ``value_states - b_V`` (per key/value head), ``hook_z`` is
                                    ``attention_head_outputs - b_V`` (each query head's ``b_V``; a softmax row sums
                                    to 1), ``hook_result`` less ``b_V @ W_O`` per head; ``hook_attn_out`` and the
                                    stream are unchanged. ``b_V`` is measured on
                                    the model (the value projection of a zero input), and the fold is proved
                                    there: refused where the value projection is not affine or a head's output of
                                    a constant value is not that value (attention sinks).
``fold_ln``                         a no-op on every hook value: the norms' weights move into the weights that read
                                    them, and ``hook_normalized`` / ``hook_scale`` are before the weight either way.
``center_unembed``                  a no-op: it shifts the logits per position, which no dictionary reads.
``refactor_factored_attn_matrices`` rewrites ``W_Q``/``W_K`` and ``W_V``/``W_O`` per head by an SVD: refused for a
                                    dictionary reading ``hook_q/k/v/z`` (nncanon does not recompute that basis);
                                    a no-op elsewhere. TransformerLens refuses it on a rotary model: refused there.
==================================  ===============================================================================

The loader's other kwargs change no value a dictionary reads and are recorded as no-ops (`NO_OPS`); an unknown
kwarg, a kwarg whose value is not a bool, or a model class nncanon does not know is `InvalidDictionary`. A
processing that cannot be reproduced on the model or point it is attached to is `DictionaryMismatch` at attach,
with the reason: never ignored.

Every mapping is ``tl = x - offset`` with ``offset`` the width's mean (centring) or a constant (``b_V``), so a write
of ``y`` in the dictionary's space hands the model ``y + offset`` (the offset of the value it read): an edit moves
the model's value by exactly the dictionary's change, and an unedited run is the clean run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import DictionaryMismatch, InvalidDictionary
from ..reading import read
from ..tools.heads import projection_weights
from .names import Point, has_rotary
from .sites import point_shape

#: The kwargs of TransformerLens's loader that change what a hook computes, as SAELens records them.
PROCESSINGS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases",
               "refactor_factored_attn_matrices")

#: Recorded kwargs that change no value a dictionary reads, with why.
NO_OPS = {
    "default_prepend_bos": "how TransformerLens tokenizes text (whether a BOS token is prepended): nncanon reads the "
                           "model on the inputs you give it",
    "default_padding_side": "how TransformerLens pads a batch of texts: nncanon reads the inputs you give it",
    "device": "where the model was placed", "n_devices": "where the model was placed",
    "move_to_device": "where the model was placed", "dtype": "the model's dtype (attach checks the dictionary's)",
    "torch_dtype": "the model's dtype (attach checks the dictionary's)",
    "trust_remote_code": "how the model's code was loaded",
    "revision": "which weights were loaded: nncanon reads the model you load",
    "checkpoint_index": "which weights were loaded: nncanon reads the model you load",
    "checkpoint_value": "which weights were loaded: nncanon reads the model you load",
    "use_attn_result": "it switches a hook on", "use_split_qkv_input": "it switches a hook on",
    "use_hook_mlp_in": "it switches a hook on", "use_attn_in": "it switches a hook on",
}

#: Model classes whose loader kwargs SAELens records: ``HookedTransformer`` (loaded with
#: ``from_pretrained_no_processing`` and the kwargs) and ``AutoModelForCausalLM`` (HuggingFace's own model: module
#: paths, no processing; its kwargs are HuggingFace's loading kwargs).
MODEL_CLASSES = ("HookedTransformer", "HookedSAETransformer", "AutoModelForCausalLM")

#: Values that are the residual stream or a write to it: centred under ``center_writing_weights``.
STREAM = ("layer_input", "resid_mid", "layer_output", "attention_output", "linear_attention_output", "mlp_output",
          "shared_expert_output", "mlp_module_output", "token_embeddings", "position_embeddings",
          "attention_head_contributions")

#: Values that are a pre-norm's output with its weight: ``fold_ln`` makes TransformerLens's hooks there
#: (``attn.hook_in``, ``mlp.hook_in``) the normalised input without the weight.
NORMED = ("attention_input", "linear_attention_input", "mlp_input")

#: LayerNorm architectures (by ``model_type``) where ``center_writing_weights`` does not make TransformerLens's stream
#: the served stream less its mean, or where TransformerLens's versions disagree on it: refused, with the reason.
CENTRING_REFUSED = {
    "opt": "TransformerLens 4.3's OPT adapter does not centre (supports_center_writing_weights=False) where "
           "HookedTransformer did, and the record does not say which the dictionary saw",
    "xglm": "TransformerLens 4.3's XGLM adapter does not centre, where HookedTransformer's processing would",
    "modernbert-decoder": "TransformerLens 4.3's ModernBERT-decoder adapter does not centre",
    "openai-gpt": "a post-norm block: the stream is a LayerNorm's output, which centring the writing weights does not "
                  "make mean-zero (TransformerLens 4.3 does not centre it)",
    "bloom": "the stream starts with the embedding's LayerNorm output (word_embeddings_layernorm), which centring W_E "
             "does not make mean-zero",
    "rwkv": "block 0 norms the embedding (pre_ln) into the stream, which centring W_E does not make mean-zero",
}

#: Config attributes that make a block post-norm (the stream is a norm's output): centring refused there too.
_POST_NORM = {"do_layer_norm_before": False, "apply_residual_connection_post_layernorm": True}

#: Values of the attention's heads that ``refactor_factored_attn_matrices`` rewrites.
HEADS = ("query_states", "key_states", "value_states", "attention_head_outputs")


@dataclass(frozen=True)
class Processing:
    """The processing a dictionary's model was loaded with (`recorded`).

    Attributes:
        settings: The kwargs of `PROCESSINGS` that are on (a sorted tuple of names).
        no_ops: The recorded kwargs of `NO_OPS` (name, value).
        model_class: The model class recorded (``"HookedTransformer"`` where none is).
        source: Where the record was found (``"metadata.model_from_pretrained_kwargs"``...; ``""``: none).
    """

    settings: tuple[str, ...] = ()
    no_ops: tuple[tuple[str, Any], ...] = ()
    model_class: str = "HookedTransformer"
    source: str = ""
    kwargs: dict = field(default_factory=dict, compare=False)

    def __bool__(self) -> bool:
        return bool(self.settings)

    def describe(self) -> str:
        """``"from_pretrained_no_processing(center_writing_weights=True)"``, ``"no processing"``."""
        if self.model_class == "AutoModelForCausalLM":
            return "AutoModelForCausalLM (no processing)"
        if not self.settings:
            return "no processing"
        return f"from_pretrained_no_processing({', '.join(f'{name}=True' for name in self.settings)})"


def recorded(raw: dict, where: str = "the dictionary's cfg.json") -> Processing:
    """The `Processing` a SAELens ``cfg.json`` (``raw``, parsed) records.

    Raises:
        InvalidDictionary: an unknown kwarg, a processing kwarg that is not a bool, kwargs that are not a mapping,
            or a model class nncanon does not know (naming it and what nncanon knows).
    """
    metadata = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    kwargs, source = None, ""
    for name, holder in (("metadata.model_from_pretrained_kwargs", metadata), ("model_from_pretrained_kwargs", raw)):
        if holder.get("model_from_pretrained_kwargs") is not None:
            kwargs, source = holder["model_from_pretrained_kwargs"], name
            break
    model_class = metadata.get("model_class_name") or raw.get("model_class_name") or "HookedTransformer"
    if model_class not in MODEL_CLASSES:
        raise InvalidDictionary(f"{where}: model_class_name {model_class!r} is not a model nncanon knows the hooks "
                                f"of; it knows {', '.join(MODEL_CLASSES)}")
    if kwargs is None:
        return Processing(model_class=model_class)
    if not isinstance(kwargs, dict):
        raise InvalidDictionary(f"{where}: {source} is a {type(kwargs).__name__} ({kwargs!r}), not a mapping of "
                                "TransformerLens loader kwargs")
    if model_class == "AutoModelForCausalLM":  # HuggingFace's loader kwargs: no processing of any value
        return Processing(no_ops=tuple(sorted(kwargs.items(), key=lambda item: item[0])), model_class=model_class,
                          source=source, kwargs=dict(kwargs))
    on, no_ops = [], []
    for key, value in kwargs.items():
        if key in PROCESSINGS:
            if not isinstance(value, bool):
                raise InvalidDictionary(f"{where}: {source}[{key!r}] is {value!r}; a TransformerLens processing "
                                        "kwarg is true or false")
            if value:
                on.append(key)
        elif key in NO_OPS:
            no_ops.append((key, value))
        else:
            raise InvalidDictionary(
                f"{where}: {source} has {key!r}, which is not a TransformerLens loader kwarg nncanon knows: it knows "
                f"the processings {', '.join(PROCESSINGS)} and the kwargs that change no value "
                f"{', '.join(NO_OPS)}; a dictionary is not run under a processing nncanon cannot name")
    return Processing(tuple(sorted(on)), tuple(no_ops), model_class, source, dict(kwargs))


def of(cfg: Any) -> Processing:
    """The `Processing` of a `nncanon.sae.config.DictionaryConfig` (read from the config it was built from)."""
    return recorded(cfg.source or {}, "the dictionary's config")


# -- the mapping at one point -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Mapping:
    """What one point reads under a processing: ``tl = x - offset(x)``.

    Attributes:
        centre: Subtract the mean over the last axis (``center_writing_weights``).
        bias: A constant to subtract, broadcast over ``[b, s]`` (``fold_value_biases``: ``b_V``), or ``None``.
        notes: What each recorded processing does at this point, for ``support()``.
    """

    centre: bool = False
    bias: torch.Tensor | None = None
    notes: tuple[str, ...] = ()

    @property
    def identity(self) -> bool:
        """Whether the point reads the served value as it is."""
        return not self.centre and self.bias is None

    def offset(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x - read(x)`` (``None``: nothing), in ``x``'s shape."""
        offset = None
        if self.bias is not None:
            offset = self.bias.to(dtype=x.dtype, device=x.device).expand_as(x)
        if self.centre:
            inner = x if offset is None else x - offset
            mean = inner.mean(dim=-1, keepdim=True).expand_as(x)
            offset = mean if offset is None else offset + mean
        return offset

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """The value the dictionary reads: ``x`` (the served value ``[b, s, ...]``) as the processed model computes
        it."""
        offset = self.offset(x)
        return x if offset is None else x - offset

    def back(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The served value that reads as ``y``: ``y`` plus the offset of ``x`` (the value that was read)."""
        offset = self.offset(x)
        return y if offset is None else y + offset.to(y.dtype)


IDENTITY = Mapping()


def mapping(model: Any, processing: Processing, point: Point) -> Mapping:
    """The `Mapping` of ``point`` on ``model`` under ``processing``.

    Raises:
        DictionaryMismatch: the processing cannot be reproduced exactly at this point of this model (the reason).
    """
    if not processing.settings:
        return IDENTITY
    centre, bias, notes = False, None, []
    where = point.name or point.label
    for name in processing.settings:
        if name == "fold_ln" and point.value in NORMED:
            raise DictionaryMismatch(
                f"the dictionary reads {where} under fold_ln: TransformerLens folds the norm's weight and bias into "
                "the weights that read it, so the module's input there is the normalised stream before the norm's "
                "weight (the norm's hook_normalized), not the norm's output nncanon serves at this point; attach it at "
                f"blocks.{point.layer}.{'ln2' if point.value == 'mlp_input' else 'ln1'}.hook_normalized (the "
                "norm's normalised value, which that input is under fold_ln)")
        if name in ("fold_ln", "center_unembed"):
            notes.append(f"{name}: no change at {where}")
        elif name == "center_writing_weights":
            kind = norm_kind(model)
            if kind != "LayerNorm":
                notes.append(f"center_writing_weights: a no-op on this {kind} model (TransformerLens skips it)")
            elif point.value in STREAM:
                _refuse_centring(model, point)
                centre = True
                notes.append(f"center_writing_weights: {where} centred over its width")
            else:
                notes.append(f"center_writing_weights: no change at {where} (it reads a norm's output)")
        elif name == "fold_value_biases":
            if point.value in ("value_states", "attention_head_outputs", "attention_head_contributions"):
                bias = value_bias(model, point.layer, point.value, "fold_ln" in processing.settings)
                if point.head is not None:
                    bias = bias[point.head]
                folded = " (with the norm's bias fold_ln moved in)" if "fold_ln" in processing.settings else ""
                notes.append(f"fold_value_biases: {where} less its value bias b_V{folded}")
            else:
                notes.append(f"fold_value_biases: no change at {where}")
        elif name == "refactor_factored_attn_matrices":
            if _rotary(model, point.layer):
                raise DictionaryMismatch(
                    f"the dictionary was trained under refactor_factored_attn_matrices, which TransformerLens refuses "
                    f"on a rotary model; layers[{point.layer}]'s attention is rotary: the record does not describe "
                    "this model")
            if point.value in HEADS:
                raise DictionaryMismatch(
                    f"the dictionary reads {where} under refactor_factored_attn_matrices: TransformerLens rewrites "
                    "each head's W_Q/W_K and W_V/W_O in an SVD basis there, which nncanon does not recompute; it "
                    "reproduces that processing only at points it leaves unchanged (the stream, hook_attn_out, the "
                    "MLP's values)")
            notes.append(f"refactor_factored_attn_matrices: no change at {where}")
    return Mapping(centre, bias, tuple(notes))


def _refuse_centring(model: Any, point: Point) -> None:
    """`DictionaryMismatch` where centring ``point``'s value is not what TransformerLens's ``center_writing_weights``
    computes: an architecture of `CENTRING_REFUSED`, a post-norm block, or a value wider than the model's width
    (hyper-connections keep ``k`` streams side by side: TransformerLens has no such model)."""

    config = model._text_config
    where = point.name or point.label
    reason = CENTRING_REFUSED.get(config.model_type)
    post = [f"{name}={value}" for name, value in _POST_NORM.items() if getattr(config, name, None) is value]
    if reason is None and post:
        reason = (f"a post-norm block ({', '.join(post)}): the stream is a LayerNorm's output, not a sum of centred "
                  "writes")
    if reason is not None:
        raise DictionaryMismatch(f"center_writing_weights at {where} on this {config.model_type} model: {reason}; "
                                 "nncanon does not reproduce it")

    width = point_shape(model, point)[0][-1]
    hidden = model._text_config.hidden_size
    if width != hidden:
        raise DictionaryMismatch(
            f"center_writing_weights at {where}: the value is {width} wide, {width // hidden} "
            f"streams of the model's width {hidden} (hyper-connections); TransformerLens centres one stream, and has "
            "no model that keeps several: nncanon does not guess which mean it would remove")


def norm_kind(model: Any) -> str:
    """``"LayerNorm"`` where the model's final norm removes its input's mean (TransformerLens's ``LN``), else
    ``"RMSNorm"`` (checked on the module: ``norm(x + 3) == norm(x)``)."""
    known = model.__dict__.setdefault("_nncanon_norm_kind", {})
    if "kind" not in known:
        norm = getattr(model, "norm", None)
        if norm is None:
            raise DictionaryMismatch(
                f"center_writing_weights centres the stream on a LayerNorm model and does nothing on an RMSNorm one; "
                f"this {model._text_config.model_type} model has no final norm to tell which it is")
        module = norm._module
        weight = next((p for p in module.parameters()), None)
        dtype = torch.float32 if weight is None else weight.dtype
        device = "cpu" if weight is None else weight.device
        width = model._text_config.hidden_size
        x = torch.randn(2, width, generator=torch.Generator().manual_seed(0)).to(dtype=dtype, device=device)
        try:
            with torch.no_grad():
                first, shifted = module(x), module(x + 3)
        except Exception as error:  # a norm over several streams (hyper-connections): said so
            raise DictionaryMismatch(
                f"center_writing_weights centres the stream on a LayerNorm model and does nothing on an RMSNorm one; "
                f"this {model._text_config.model_type} model's final norm does not take one stream of its width "
                f"({type(error).__name__}: {error}), so nncanon cannot tell which it is") from None
        centred = torch.allclose(first.float(), shifted.float(), atol=1e-2 if dtype != torch.float32 else 1e-4)
        known["kind"] = "LayerNorm" if centred else "RMSNorm"
    return known["kind"]


def value_bias(model: Any, layer: int, value: str, folded_norm: bool = False) -> torch.Tensor:
    """``b_V`` of block ``layer``, per head of ``value``: ``[H_kv, head_dim]`` for ``value_states``, ``[H, head_dim]``
    (each query head's key/value head's) for ``attention_head_outputs``.

    Measured on the model: one trace writes ``0``, ``r`` and ``-r`` as the attention's input and reads the values;
    ``b_V`` is the value of ``0``. With ``folded_norm`` (``fold_ln`` is on too: TransformerLens has moved the
    pre-norm's bias into ``b_V`` before folding it) the first row's stream entering the block is zero instead, so that
    the attention reads the norm's output of a zero normalised input (a LayerNorm's bias; an RMSNorm's zero).
    Proved there: ``v(r) + v(-r) == 2 v(0)`` (the projection is affine) and the heads' outputs of the first row are
    its value (a softmax row sums to 1). Remembered per model, block and ``folded_norm``.

    Raises:
        DictionaryMismatch: a check fails, or the block does not serve what the measure reads.
    """
    known = model.__dict__.setdefault("_nncanon_value_bias", {})
    if (layer, folded_norm) not in known:
        known[(layer, folded_norm)] = _measure_value_bias(model, layer, folded_norm)
    per_kv, per_head = known[(layer, folded_norm)]
    if value == "attention_head_contributions":  # each head's b_V through its slice of W_O: [H, d]
        weight, _ = projection_weights(model, layer)
        return torch.einsum("hk,hkd->hd", per_head.to(weight.dtype), weight.detach()).to(per_head.dtype)
    return per_kv if value == "value_states" else per_head


def _measure_value_bias(model: Any, layer: int, folded_norm: bool) -> tuple[torch.Tensor, torch.Tensor]:

    report = model.support()
    for needed in ("attention_input", "value_states", "attention_head_outputs"):
        reason = report.reason(needed, layer=layer)
        if reason is not None:
            raise DictionaryMismatch(f"fold_value_biases: nncanon measures b_V of layers[{layer}] from its "
                                     f"{needed}, which is not available: {reason}")
    saved: list = []
    # rows: the bias measured (a zero input, or a zero stream under a folded norm), then 0, r and -r (affinity)
    with torch.no_grad(), model.trace(torch.tensor([[1], [1], [1], [1]])):
        if folded_norm:
            stream = read(model, layer, "layer_input")
            stream[0] = 0
        x = read(model, layer, "attention_input")
        r = torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(1)).to(dtype=x.dtype, device=x.device)
        if folded_norm:
            x[1:] = torch.stack([r * 0, r, -r])[:, None, :]
        else:
            x[:] = torch.stack([r * 0, r * 0, r, -r])[:, None, :]
        saved.append(read(model, layer, "value_states").save())
        saved.append(read(model, layer, "attention_head_outputs").save())
    values, heads = saved
    b_v = values[0, 0].float()
    scale = max(float(values.float().abs().max()), 1.0)
    tolerance = (1e-5 if values.dtype == torch.float32 else 1e-2) * scale
    affine = (values[2, 0].float() + values[3, 0].float() - 2 * values[1, 0].float()).abs().max().item()
    if affine > tolerance:
        raise DictionaryMismatch(f"fold_value_biases: layers[{layer}]'s value projection is not affine "
                                 f"(v(r) + v(-r) - 2 v(0) = {affine:.3g}): there is no one b_V to fold")
    groups = heads.shape[-2] // values.shape[-2]
    per_head = b_v.repeat_interleave(groups, dim=0)
    off = (heads[0, 0].float() - per_head).abs().max().item()
    if off > tolerance:
        raise DictionaryMismatch(f"fold_value_biases: layers[{layer}]'s heads do not output b_V for a constant value "
                                 f"(off by {off:.3g}; attention sinks or a normalised value?): TransformerLens's fold "
                                 "is not exact there")
    return b_v.to(values.dtype), per_head.to(values.dtype)


def _rotary(model: Any, layer: int) -> bool:

    return model.support().available("self_attn", layer=layer) and has_rotary(model, layer)
