"""One name table: TransformerLens hook names, nncanon's values and a model's module paths, as points of the model.

A dictionary trained with SAELens names where it reads by a TransformerLens hook name
(``blocks.12.hook_resid_post``); one trained on a HuggingFace model by a module path (``model.layers.12``); one
trained with nncanon by an nncanon value (``layers.12.layer_output``). `resolve` turns any of the three into a
`Point` (a block and the value read there), or says why the name has no meaning on this model, as ``support()``
does; `value_at` reads the point inside a trace. The table, with what each TransformerLens name means here:

=================================  =====================================================================
TransformerLens                    nncanon
=================================  =====================================================================
``blocks.L.hook_resid_pre``        ``layers[L].layer_input``
``blocks.L.hook_resid_mid``        ``layer_input + attention_output`` (the token mixer's contribution), where
                                   the MLP reads the stream after the mixer (not on a parallel block)
``blocks.L.hook_resid_post``       ``layers[L].layer_output``
``blocks.L.hook_attn_out``         ``self_attn.attention_output`` (a hybrid's linear mixer:
                                   ``linear_attn.linear_attention_output``)
``blocks.L.hook_mlp_out``          ``mlp.mlp_output``
``blocks.L.hook_mlp_in``           what the MLP's norm reads: ``hook_resid_mid``, on a parallel block ``layer_input``
``blocks.L.ln2.hook_normalized``   ``mlp.mlp_normalized``: the MLP norm's input normalised, before its weight and bias
                                   (refused with the reason where the block has no norm of its own before the MLP)
``blocks.L.ln1.hook_normalized``   ``self_attn.attention_normalized`` (a hybrid's linear mixer:
                                   ``linear_attn.linear_attention_normalized``), before the norm's weight and bias
``blocks.L.mlp.hook_in``           ``mlp_input``: circuit-tracer's (and TransformerBridge's) MLP input hook
``blocks.L.mlp.hook_out``          ``mlp_module_output``: the MLP module's output, before a post-norm (Gemma-2's
                                   ``post_feedforward_layernorm``) or a residual multiplier; ``mlp_output`` where
                                   the block adds it as it is
``blocks.L.mlp.hook_pre``          ``mlp.pre_activations`` (the gate path of a gated MLP)
``blocks.L.mlp.hook_pre_linear``   ``mlp.linear_activations`` (a gated MLP's linear path)
``blocks.L.mlp.hook_post``         ``mlp.neurons``: what the down projection receives
``blocks.L.attn.hook_z``           ``self_attn.attention_head_outputs`` ``[b, s, H, head_dim]``
``blocks.L.attn.hook_result``      ``attention_head_contributions`` ``[b, s, H, d]``: each head's output through its
                                   slice of the output projection (no bias), computed from ``hook_z``; read-only
``blocks.L.attn.hook_q/k/v``       ``query_states`` / ``key_states`` / ``value_states`` (no rotary embedding)
``blocks.L.attn.hook_rot_q/k``     ``query_states`` / ``key_states`` (after a rotary embedding)
``blocks.L.attn.hook_pattern``     ``self_attn.attention_probabilities`` ``[b, H, q, k]``; ``attn.hook_attn_scores``:
                                   ``self_attn.attention_scores`` ``[b, H, q, k]``, what the softmax receives
``blocks.L.ln1.hook_scale``        ``self_attn.attention_norm_scale`` ``[b, s, 1]`` (a hybrid's linear mixer:
                                   ``linear_attn.linear_attention_norm_scale``)
``blocks.L.ln2.hook_scale``        ``mlp.mlp_norm_scale`` (a parallel block: refused, one norm feeds both)
``blocks.L.ln1_post.hook_scale``   ``self_attn.attention_post_norm_scale`` (post-norm blocks: Gemma-2/3, OLMo-2; a
                                   hybrid's linear mixer: ``linear_attn.linear_attention_post_norm_scale``, LFM3)
``blocks.L.ln2_post.hook_scale``   ``mlp.mlp_post_norm_scale``
``ln_final.hook_scale``            ``model.final_norm_scale``; ``ln_final.hook_normalized``: ``model.final_normalized``
``hook_embed``                     ``model.token_embeddings`` (the token embedding module's output)
``hook_pos_embed``                 ``model.position_embeddings`` (refused with the reason on a model without
                                   absolute position embeddings: rotary, ALiBi, recurrent)
=================================  =====================================================================
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..components.layer import layer_index
from ..components.norms import FINAL_VALUES
from ..errors import NestedTrace, UnknownHookName, ValueNotAvailable
from ..model_sites import MODEL_SITES
from ..quantization import dense_weight
from ..reading import in_execution_order, read
from ..support import COMPONENT_OF, layer_states
from ..tools.heads import projection_path

#: Values of a point besides the standard ones: the stream between a block's token mixer and its MLP, the MLP
#: module's input and its output (before a post-norm or a residual multiplier; `mlp_output` is the contribution),
#: and each attention head's output through its slice of the output projection (TransformerLens's
#: ``attn.hook_result``, computed from ``attention_head_outputs``: read-only).
DERIVED = ("resid_mid", "mlp_input", "mlp_module_output", "attention_head_contributions")

#: TransformerLens hook names of a block, by their suffix after ``blocks.L.``: the nncanon value (a value name, a
#: `DERIVED` one, or a marker resolved per block: ``"mixer_output"``, ``"mixer_normalized"``, ``"mlp_in"``,
#: ``"q"``/``"k"`` and ``"rot_q"``/``"rot_k"``).
TRANSFORMER_LENS = {
    "hook_resid_pre": "layer_input",
    "hook_resid_mid": "resid_mid",
    "hook_resid_post": "layer_output",
    "hook_attn_out": "mixer_output",
    "hook_mlp_out": "mlp_output",
    "hook_mlp_in": "mlp_in",
    "ln2.hook_normalized": "mlp_normalized",
    "ln1.hook_normalized": "mixer_normalized",
    "mlp.hook_pre": "pre_activations",
    "mlp.hook_pre_linear": "linear_activations",
    "mlp.hook_post": "neurons",
    "mlp.hook_in": "mlp_input",
    "mlp.hook_out": "mlp_module_output",
    "attn.hook_z": "attention_head_outputs",
    "attn.hook_result": "attention_head_contributions",
    "attn.hook_q": "q",
    "attn.hook_k": "k",
    "attn.hook_v": "value_states",
    "attn.hook_rot_q": "rot_q",
    "attn.hook_rot_k": "rot_k",
    "attn.hook_pattern": "attention_probabilities",
    "ln1.hook_scale": "mixer_norm_scale",
    "ln2.hook_scale": "mlp_norm_scale",
    "ln1_post.hook_scale": "mixer_post_norm_scale",
    "ln2_post.hook_scale": "mlp_post_norm_scale",
    "attn.hook_attn_scores": "attention_scores",
}

_PER_HEAD_INPUT = ("TransformerLens copies attention's input once per head (use_split_qkv_input): nncanon serves the "
                   "one input every head reads, self_attn.attention_input (with the norm's weight; before it: "
                   "self_attn.attention_normalized, ln1.hook_normalized)")

#: TransformerLens hook names nncanon does not serve, with the reason and what to read instead.
UNSERVED = {
    "hook_attn_in": _PER_HEAD_INPUT,
    "hook_q_input": _PER_HEAD_INPUT,
    "hook_k_input": _PER_HEAD_INPUT,
    "hook_v_input": _PER_HEAD_INPUT,
}

#: TransformerLens hook names outside the blocks that name a model-level value (`nncanon.model_sites`).
MODEL_HOOKS = {"hook_embed": "token_embeddings", "hook_pos_embed": "position_embeddings"}

#: TransformerLens hook names outside the blocks that nncanon does not serve, with the reason.
MODEL_LEVEL: dict[str, str] = {}

#: TransformerLens hook names of the final norm: the model-level values they name.
FINAL_NAMES = {"ln_final.hook_scale": "final_norm_scale", "ln_final.hook_normalized": "final_normalized"}

#: The values a point can be (the standard layer values and `DERIVED`), for messages.
POINT_VALUES = ("layer_input", *COMPONENT_OF, *DERIVED, "layer_output")

_TL = re.compile(r"^blocks\.(-?\d+)\.(.+)$")
_OURS = re.compile(r"^(?:model\.)?layers(?:\.|\[)(-?\d+)\]?\.(.+)$")


@dataclass(frozen=True)
class Point:
    """A point of a model a dictionary reads or writes: block ``layer``'s ``value``.

    Attributes:
        layer: The block (non-negative); ``None`` for a model-level value (``token_embeddings``, ``hook_embed``).
        value: A standard value of the block (``"layer_output"``, ``"attention_head_outputs"``...) or one of
            `DERIVED`: ``"resid_mid"`` (``layer_input`` plus the token mixer's contribution, between mixer and MLP)
            or ``"mlp_input"`` (the MLP module's input).
        head: One head of a per-head value (``value[..., head, :]``), or ``None``.
        name: The name it was resolved from.
        parts: For ``resid_mid``, the values it is the sum of, in the order the model computes them
            (``("layer_input", "attention_output")``).
    """

    layer: int | None
    value: str
    head: int | None = None
    name: str = ""
    parts: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """``"layers[3].layer_output"`` (``"layers[3].attention_head_outputs[..., 2, :]"`` for one head;
        ``"model.token_embeddings"`` for a model-level value)."""
        if self.layer is None:
            return f"model.{self.value}"
        head = f"[..., {self.head}, :]" if self.head is not None else ""
        return f"layers[{self.layer}].{self.value}{head}"

    @property
    def per_head(self) -> bool:
        """Whether the value is laid out per head (``[b, s, H, head_dim]``)."""
        return self.value in ("attention_head_outputs", "attention_head_contributions",
                              "linear_attention_head_outputs", "query_states",
                              "key_states", "value_states")


def resolve(model: Any, name: str, head: int | None = None) -> Point:
    """The `Point` ``name`` names on ``model``: a TransformerLens hook name (``blocks.3.hook_resid_post``), an nncanon
    value (``layers.3.layer_output``, ``layers[3].self_attn.attention_output``) or a module path of this model
    (``model.layers.3``: the block's output).

    Args:
        model: A `StandardizedTransformer`.
        name: The name.
        head: One head of a per-head value (SAELens's ``hook_head_index``).

    Raises:
        UnknownHookName: ``name`` is none of the three (the message lists the forms).
        InvalidLayer: its block is outside the model.
        ValueNotAvailable: the name means nothing on this block (a parallel block has no ``hook_resid_mid``, a
            DeltaNet block no ``hook_z``), with the reason, as ``support()`` gives it.
    """
    if not isinstance(name, str):
        raise UnknownHookName(f"a hook name is a string, not a {type(name).__name__} ({name!r})")
    for level, reason in MODEL_LEVEL.items():
        if name == level:
            raise ValueNotAvailable(f"{name} is not available: {reason}")
    bare = name.removeprefix("model.")
    value = MODEL_HOOKS.get(name) or FINAL_NAMES.get(name) or (bare if bare in (*MODEL_SITES, *FINAL_VALUES) else None)
    if value is not None:  # a model-level value: served or refused with the family's reason
        reason = model.support().reason(value)
        if reason is not None:
            raise ValueNotAvailable(f"{name} is not available: {reason}")
        return Point(None, value, head, name)
    found = _TL.match(name)
    if found is not None:
        layer = layer_index(int(found.group(1)), model.num_layers, f"{name} (model.layers)")
        return _checked(model, Point(layer, _transformer_lens(model, layer, found.group(2), name), head, name))
    found = _OURS.match(name)
    if found is not None and not name.startswith(f"{model.family.layers}."):
        layer = layer_index(int(found.group(1)), model.num_layers, f"{name} (model.layers)")
        value = found.group(2).split(".")[-1]
        if value not in POINT_VALUES:
            raise UnknownHookName(f"{name!r}: {value!r} is not a value of a block; the values are "
                                  f"{', '.join(POINT_VALUES)}")
        return _checked(model, Point(layer, value, head, name))
    point = _module_path(model, name, head)
    if point is not None:
        return _checked(model, point)
    raise UnknownHookName(
        f"{name!r} names no point of this {model._text_config.model_type} model. A name is a TransformerLens hook "
        f"name (blocks.L.hook_resid_post, blocks.L.attn.hook_z, ...: {', '.join(TRANSFORMER_LENS)}), an nncanon "
        f"value (layers.L.layer_output, layers[L].self_attn.attention_output) or a module path of this model "
        f"({model.family.layers}.L for block L's output)"
    )


def _transformer_lens(model: Any, layer: int, suffix: str, name: str) -> str:
    """The value a TransformerLens ``blocks.L.<suffix>`` names on block ``layer``."""
    if suffix in UNSERVED:
        raise ValueNotAvailable(f"{name} is not available: {UNSERVED[suffix]}")
    marker = TRANSFORMER_LENS.get(suffix)
    if marker is None:
        raise UnknownHookName(f"{name!r}: blocks.L.{suffix} is not a TransformerLens hook name nncanon knows; it knows "
                              f"{', '.join(f'blocks.L.{s}' for s in TRANSFORMER_LENS)}")
    report = model.support()
    if marker in ("mixer_norm_scale", "mixer_post_norm_scale"):
        value = marker.removeprefix("mixer_")
        if report.available("self_attn", layer=layer):
            return f"attention_{value}"
        if report.available("linear_attn", layer=layer):
            return f"linear_attention_{value}"
        raise ValueNotAvailable(f"{name} is not available: {report.reason('self_attn', layer=layer)}")
    if marker in ("mixer_output", "mixer_normalized"):
        suffix = marker.removeprefix("mixer_")
        if report.available("self_attn", layer=layer):
            return f"attention_{suffix}"
        if report.available("linear_attn", layer=layer):
            return f"linear_attention_{suffix}"
        raise ValueNotAvailable(f"{name} is not available: {report.reason('self_attn', layer=layer)}")
    if marker == "mlp_in":
        return "resid_mid" if _sequential_or_reason(model, layer) is None else "layer_input"
    if marker in ("q", "k", "rot_q", "rot_k"):
        value = "query_states" if marker.endswith("q") else "key_states"
        if report.available("self_attn", layer=layer):
            rotary = has_rotary(model, layer)
            if rotary and not marker.startswith("rot"):
                raise ValueNotAvailable(
                    f"{name} is not available: TransformerLens's attn.hook_{marker} is before the rotary embedding, "
                    f"and this attention applies one; nncanon serves {value} after it, TransformerLens's "
                    f"attn.hook_rot_{marker}")
            if not rotary and marker.startswith("rot"):
                raise ValueNotAvailable(
                    f"{name} is not available: this attention applies no rotary embedding; its {value} is "
                    f"TransformerLens's attn.hook_{marker[-1]}")
        return value
    return marker


def _module_path(model: Any, name: str, head: int | None) -> Point | None:
    """The point a module path of this model names: a block (its output), or a module whose raw output is a
    standard value of the block unchanged; ``None`` where ``name`` is not under the blocks' path."""
    prefix = f"{model.family.layers}."
    if not name.startswith(prefix):
        return None
    index, _, rest = name[len(prefix):].partition(".")
    if not re.fullmatch(r"-?\d+", index):
        return None
    layer = layer_index(int(index), model.num_layers, f"{name} (model.layers)")
    if not rest:
        return Point(layer, "layer_output", head, name)
    block = model.layers[layer]
    for state in layer_states(block).values():
        if state is None:
            continue
        for value, binding in state.bindings.items():
            site = binding.site
            plain = (site.key == "output" and site.op is None and site.scale is None and site.bias is None
                     and not (site.merge or site.stacked or site.weighted))
            if plain and binding.location == f"{block.path}.{rest}.output" and value in POINT_VALUES:
                return Point(layer, value, head, name)
    if _has_module(block, rest):
        raise ValueNotAvailable(
            f"{name} is not available as a value: on this {model._text_config.model_type} model that module's output "
            f"is not one of the standard values as it stands (the block computes {model.family.residual}); read the "
            f"standard value instead (model.support() lists them), e.g. layers.{layer}.mlp_output")
    return None


def _has_module(block: Any, path: str) -> bool:
    module = block._module
    for part in path.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, torch.nn.Module):
            return False
    return True


def _checked(model: Any, point: Point) -> Point:
    """``point``, or `ValueNotAvailable` with the reason where block ``point.layer`` does not serve it."""
    reason = point_reason(model, point.layer, point.value)
    if reason is not None:
        raise ValueNotAvailable(f"{point.name or point.label} is not available: {reason}")
    if point.value == "resid_mid":
        parts = ("layer_input", *in_block_order(model, point.layer, mixers(model, point.layer)))
        point = Point(point.layer, point.value, point.head, point.name, parts)
    if point.head is not None and not point.per_head:
        raise ValueNotAvailable(f"{point.name or point.label} is not available with a head index ({point.head}): "
                                f"{point.value} is not laid out per head")
    return point


def point_reason(model: Any, layer: int, value: str) -> str | None:
    """Why block ``layer`` has no ``value`` (a standard value or one of `DERIVED`), or ``None`` when it has."""
    report = model.support()
    if value == "resid_mid":
        return _sequential_or_reason(model, layer)
    if value == "attention_head_contributions":
        return _head_result_reason(model, layer)
    if value in ("mlp_input", "mlp_module_output"):
        reason = report.reason("mlp", layer=layer)
        if reason is not None:
            return reason
        mlp = model.layers[layer].mlp
        if not hasattr(mlp, "_module") and mlp._nncanon.anatomy is not None:  # (run inline: its projections')
            return None
        if not hasattr(mlp, "_module"):
            return (f"layers[{layer}] runs its MLP inline, not as one module ({mlp!r}): it has no one input or output "
                    "to read; its input is the stream its norm reads, its output mlp_output")
        if value == "mlp_module_output":
            returned = mlp_returns(model, layer)
            if returned not in ("Tensor", "tuple"):  # (a tuple: its first element, the rest passed on)
                return (f"layers[{layer}]'s MLP module returns a {returned}, not a tensor: its output as a value is "
                        "mlp_output (blocks.L.hook_mlp_out)")
        return None
    if value not in POINT_VALUES:
        return f"{value!r} is not a value of a block ({', '.join(POINT_VALUES)})"
    return report.reason(value, layer=layer)


def _head_result_reason(model: Any, layer: int) -> str | None:
    """Why block ``layer`` has no ``attn.hook_result`` (``attention_head_contributions``), or ``None``: its heads
    must enter one output projection, a matrix from heads x head_dim to the stream, that can be split per head."""
    try:
        path = projection_path(model, layer)
    except ValueNotAvailable as error:
        return str(error).removeprefix(f"layers[{layer}].self_attn ")
    try:
        module = model.layers[layer].get(path)._module
    except AttributeError:
        return (f"its heads enter {path}, one of several attentions of the block, not a module of its own attention: "
                "there is no one output projection to split per head")
    weight = getattr(module, "weight", None)
    shape = tuple(dense_weight(module).shape) if isinstance(weight, torch.Tensor) else ()
    heads = model.layers[layer].self_attn._nncanon.bindings["attention_head_outputs"].heads or 1
    if len(shape) != 2 or shape[0] != model.hidden_size or shape[1] % heads:
        return (f"its heads enter {path} ({type(module).__name__}, weight {list(shape)}), which is not one matrix "
                f"from the {heads} heads to the stream ({model.hidden_size} wide; a grouped or two-stage output "
                "projection): a head's slice of it is not the head's output")
    return None


def mlp_returns(model: Any, layer: int) -> str:
    """The type name of what block ``layer``'s MLP module returns, asked of the model once per block kind (a plain
    forward hook on the module during a one-token trace)."""
    known, key = _asked_once(model, "_nncanon_sae_mlp_returns", layer, f"what layers[{layer}]'s MLP module returns")
    if key not in known:
        if not getattr(model, "dispatched", True):
            model.dispatch()  # (a model built on meta swaps its modules for loaded ones at dispatch: hook those)
        seen: list = []
        handle = model.layers[layer].mlp._module.register_forward_hook(lambda m, a, out: seen.append(out))
        try:
            with torch.no_grad(), model.trace(torch.tensor([[1]])):
                pass
        finally:
            handle.remove()
        known[key] = type(seen[0]).__name__ if seen else "nothing (it did not run)"
    return known[key]


def mixers(model: Any, layer: int) -> list[str]:
    """The token-mixer contributions block ``layer`` serves (``attention_output``, ``linear_attention_output``)."""
    report = model.support()
    return [v for v in ("attention_output", "linear_attention_output") if report.available(v, layer=layer)]


def in_block_order(model: Any, layer: int, names: list[str]) -> list[str]:
    """``names`` in the order block ``layer`` computes them (asked of the model once, outside a trace)."""
    known = model.__dict__.setdefault("_nncanon_sae_orders", {})
    key = (layer, tuple(names))
    if key not in known:
        known[key] = tuple(in_execution_order(model, layer, names))
    return list(known[key])


def _sequential_or_reason(model: Any, layer: int) -> str | None:
    """``None`` where block ``layer``'s MLP reads the stream after its token mixer (the block has a
    ``hook_resid_mid``), else why not. Asked of the model once per block kind: a one-token trace moves the mixer's
    contribution and sees whether the MLP's moves (a parallel block's does not)."""
    report = model.support()
    if not report.available("mlp_output", layer=layer):
        why = report.reason("mlp_output", layer=layer)
        return (f"layers[{layer}] has no MLP (or does not serve its output: {why}), "
                "so there is no point between its token mixer and its MLP")
    contributions = mixers(model, layer)
    if not contributions:
        return f"layers[{layer}] serves no token mixer's contribution, so the stream after it is not served"
    known, key = _asked_once(model, "_nncanon_sae_sequential", layer, f"whether layers[{layer}] has a hook_resid_mid")
    if key not in known:
        known[key] = _probe_sequential(model, layer, contributions[-1])
    if known[key]:
        return None
    return (f"layers[{layer}] is a parallel block ({model.family.residual}): its MLP reads the block's input, not the "
            f"stream after its token mixer, so it has no hook_resid_mid; TransformerLens's hook_mlp_in is "
            f"layer_input there")


def _asked_once(model: Any, cache: str, layer: int, question: str) -> tuple[dict, tuple]:
    """``(answers, key)``: the answers to a question asked of the model once per block kind with a one-token trace
    (kept as plain data in ``model.__dict__[cache]``: they travel with a remote request), and block ``layer``'s key;
    `NestedTrace` where the answer is not known yet and a trace of the model is running."""
    known = model.__dict__.setdefault(cache, {})
    key = (type(model.layers[layer]._module).__name__, layer if model.family.layout_of is not None else None)
    if key not in known and model.interleaver.interleaving:
        raise NestedTrace(
            f"{question} is asked of the model with a one-token trace, which cannot run inside this trace: resolve "
            "the name before the trace (nncanon.sae.resolve(model, name), which remembers the answer) and pass its "
            "Point inside")
    return known, key


def _probe_sequential(model: Any, layer: int, mixer: str) -> bool:
    clean: list = []
    moved: list = []
    ids = torch.tensor([[1, 2]])
    with torch.no_grad(), model.trace(ids):
        clean.append(read(model, layer, "mlp_output").save())
    with torch.no_grad(), model.trace(ids):
        contribution = read(model, layer, mixer)
        contribution[:] = contribution * 2 + 1
        moved.append(read(model, layer, "mlp_output").save())
    return not torch.equal(clean[0], moved[0])


_ROTARY: dict[type, bool] = {}


def has_rotary(model: Any, layer: int) -> bool:
    """Whether block ``layer``'s attention applies a rotary embedding to queries and keys (its forward's source names
    one, and the config does not choose ALiBi instead)."""
    attention = model.layers[layer].self_attn._module
    cls = type(attention)
    if cls not in _ROTARY:
        try:
            source = inspect.getsource(cls.forward).lower()
        except (OSError, TypeError):  # pragma: no cover - a forward without source
            source = ""
        _ROTARY[cls] = bool(re.search(r"rotary|rope|position_embeddings", source))
    return _ROTARY[cls] and not getattr(model._text_config, "alibi", False)
