"""The checks that prove each served value: two independent computations compared, with the numbers.

Every check takes a `nncanon.mounted.MountedModel` (a `StandardizedTransformer` is one) and returns `CheckResult` records: which check, on
which layer, which values it proves, whether it held, and the measured error against its tolerance.
The same checks run in the invariant suite (on every registry variant), at load (on a twin of the
user's config) and on inferred families; `verify` runs them all.

- ``read``: each value equals the tensor read with plain PyTorch hooks (or nnsight's source hooks
  for an operation inside a forward) on the unwrapped model, bit for bit; so do the logits.
- ``identity``: ``layer_input + contributions == layer_output``; an idle block (not run) adds nothing.
- ``ablation``: zeroing one contribution (the block's later contributions held at their clean
  values) moves ``layer_output`` by exactly that contribution: the value is what reaches the stream.
- ``invokes``: a write in one invoke leaves the batch's other invokes bit-identical, and reaches its own.
- ``locality``: in bf16, a write at one position leaves every other position bit-identical.
- ``heads``: the heads, each through its slice of the output projection (plus the bias), sum to the
  projection's output.
- ``probabilities``: zeroing a head's probabilities equals zeroing its output.
- ``kernel``: ``softmax(q·kᵀ·scale + mask)`` of the kernel's inputs reproduces the eager probabilities
  (under a kernel that computes none, times the values it reproduces the kernel's output); zeroing one
  group of values zeroes exactly its heads' kernel output.
- ``recomputed``: under sdpa, the probabilities recomputed from the kernel's inputs equal eager's, and
  multiply the values to sdpa's output.
- ``routing``: the chosen experts are distinct and valid; a router logit set to ``-inf`` removes that
  expert from exactly the tokens routed to it.
- ``lens``: the lens at the last layer equals the logits, bit for bit.
- ``skip``: skipped blocks pass the stream; the lens of the stream entering them equals the logits.
- ``resume``: a forward resumed at a layer with the recorded stream is the forward, bit for bit.

The gradient checks (`Check.gradient`) prove ``value.grad`` apart from the value: a value whose
gradient check fails is still served, its ``.grad`` is not.

- ``gradients``: ``value.grad`` of every served value, inside ``with logit.backward():``, equals the
  gradient plain PyTorch computes at the value's site (tensor hooks, ``torch.autograd.grad``).
- ``gradient_writes``: ``value.grad = 0`` equals the plain model with the value's site detached.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from nnsight.intervention.util import first_input

from ..components.kernel import RECOMPUTED, STATES, Kernel, _additive_mask
from ..components.kernel import implementation as kernel_implementation
from ..errors import GradientNotAvailable
from ..mounted import MountedModel
from ..reading import head_count, in_execution_order
from ..resuming import next_token_only, resume_at, streams_entering
from ..served import _pick, _put, operation_name, stacked_as_served
from ..support import COMPONENT_OF, COMPONENTS, LAYER_VALUES
from .prompts import PROMPTS

#: Sums of fp32 tensors computed in another order than the model's (a parallel block adds its
#: sublayers in one expression) agree to about 1e-8; this is the bar, relative and absolute.
TOLERANCE = 1e-5

#: The values a block adds to the residual stream.
CONTRIBUTIONS = ("attention_output", "linear_attention_output", "mlp_output")
#: Per-head values.
HEAD_VALUES = ("attention_head_outputs", "linear_attention_head_outputs")
#: The attention kernel's per-head inputs.
KERNEL_INPUTS = tuple(STATES)
#: The routing values of a mixture of experts.
ROUTING = ("router_logits", "expert_weights", "expert_indices")
#: Model-level values the checks prove (not per layer).
MODEL_VALUES = ("logits", "project_on_vocab", "skip_layers", "resume")
#: The values a gradient reaches (``expert_indices`` are integers).
GRADIENT_VALUES = tuple(v for v in LAYER_VALUES if v not in COMPONENTS and v != "expert_indices")
#: Gradients are compared at this relative bar and `GRADIENT_ABSOLUTE` (a backward sums in its own order).
GRADIENT_TOLERANCE = 1e-5
GRADIENT_ABSOLUTE = 1e-6
#: The logit whose gradients the gradient checks take: this token's, at the last position.
GRADIENT_TOKEN = 5
#: RWKV's recurrent state is updated in place when it caches: no backward runs through it then.
NO_CACHE = {"use_cache": False}


@dataclass(frozen=True)
class CheckResult:
    """One check on one layer (``None``: the whole model).

    Attributes:
        check: Its name (``"identity"``, ``"ablation"``...).
        layer: The layer it ran on, ``None`` for a model-level check.
        values: The values it proves (or, failed, puts in doubt).
        passed: Whether it held.
        error: The measured discrepancy (max absolute difference), where it has one.
        tolerance: The bar ``error`` is held to.
        note: What was compared, or what went wrong.
        gradient: Whether it proves the values' gradients (``value.grad``) rather than the values.
    """

    check: str
    layer: int | None
    values: tuple[str, ...]
    passed: bool
    error: float | None = None
    tolerance: float | None = None
    note: str = ""
    gradient: bool = False

    def describe(self) -> str:
        """One line: ``ablation on layers[1] (mlp_output): failed, error 3.1e-01 > 1e-05 (...)``."""
        where = "the model" if self.layer is None else f"layers[{self.layer}]"
        outcome = "held" if self.passed else "failed"
        figures = ""
        if self.error is not None:
            bar = "<=" if self.passed else ">"
            figures = f", error {self.error:.2e} {bar} {self.tolerance:.0e}" if self.tolerance is not None else (
                f", error {self.error:.2e}"
            )
        note = f" ({self.note})" if self.note else ""
        return f"{self.check} on {where} ({', '.join(self.values)}): {outcome}{figures}{note}"

    def to_dict(self) -> dict:
        """As plain data (the proof cache)."""
        return {
            "check": self.check,
            "layer": self.layer,
            "values": list(self.values),
            "passed": self.passed,
            "error": self.error,
            "tolerance": self.tolerance,
            "note": self.note,
            "gradient": self.gradient,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CheckResult:
        """The inverse of `to_dict`."""
        return cls(
            data["check"], data["layer"], tuple(data["values"]), bool(data["passed"]), data.get("error"),
            data.get("tolerance"), data.get("note", ""), bool(data.get("gradient", False)),
        )


def _compare(check: str, layer: int | None, values: Sequence[str], actual: torch.Tensor, expected: torch.Tensor,
             tolerance: float, note: str = "", absolute: float | None = None,
             magnitude: torch.Tensor | None = None) -> CheckResult:
    """``actual`` against ``expected``: max absolute difference within ``absolute`` (default ``tolerance``)
    plus ``tolerance`` relative to ``expected``, or to ``magnitude`` where larger (``actual`` a difference of
    tensors of that size, whose rounding is relative to them, not to the difference)."""
    if actual.shape != expected.shape:
        return CheckResult(check, layer, tuple(values), False, None, tolerance,
                           f"shape {tuple(actual.shape)} where {tuple(expected.shape)} was expected")
    actual, expected = actual.detach(), expected.detach()  # (a gradient may carry a graph of its own)
    difference = (actual.double() - expected.double()).abs()
    error = float(difference.max()) if difference.numel() else 0.0
    size = expected.double().abs() if magnitude is None else torch.maximum(expected.double().abs(),
                                                                            magnitude.detach().double().abs())
    bar = (tolerance if absolute is None else absolute) + tolerance * size
    passed = bool((difference <= bar).all()) if tolerance else error == 0.0
    return CheckResult(check, layer, tuple(values), passed, error, tolerance, note)


def _failure(check: str, layer: int | None, values: Sequence[str], error: Exception) -> CheckResult:
    return CheckResult(check, layer, tuple(values), False, None, None, f"{type(error).__name__}: {error}"[:300])


def _guarded(check: str, layer: int | None, values: Sequence[str], run: Callable[[], list[CheckResult]]
             ) -> list[CheckResult]:
    """``run()``, or one failed result naming the exception it raised."""
    try:
        return run()
    except Exception as error:
        return [_failure(check, layer, values, error)]


def raised(model: Any, check: str, error: Exception) -> list[CheckResult]:
    """A check that raised outside its own guards (the model's forward itself fails, say): one failed
    result per layer over every value the layer serves, and one over the model-level values."""
    report = model.support()
    results = []
    for layer in range(model.num_layers):
        values = [v for v in LAYER_VALUES if v not in COMPONENTS and report.available(v, layer=layer)]
        results.append(_failure(check, layer, values, error))
    return [*results, _failure(check, None, MODEL_VALUES, error)]


# -- reading the surface ------------------------------------------------------------------------


def host(model: Any, layer: int, name: str) -> Any:
    """The component of block ``layer`` that serves ``name`` (the block for ``layer_input``/``output``)."""
    component = COMPONENT_OF.get(name)
    block = model.layers[layer]
    return block if component is None else getattr(block, component)


def served(model: Any, layer: int, names: Sequence[str] = CONTRIBUTIONS) -> list[str]:
    """The values of ``names`` block ``layer`` serves (per ``support()``), in the order its forward runs them."""

    report = model.support()
    present = [name for name in names if report.available(name, layer=layer)]
    return in_execution_order(model, layer, present)


def encode(model: Any, prompt: str = PROMPTS[0]) -> dict:
    """One prompt tokenized as a trace tokenizes it (no padding)."""
    return dict(model.tokenizer(prompt, return_tensors="pt"))


def hf_block(model: Any, layer: int) -> torch.nn.Module:
    """Block ``layer`` of the unwrapped model."""
    return model._module.get_submodule(model.family.layers)[layer]


def stream_block(model: Any, layer: int) -> int | None:
    """The block whose input (or output) an idle block ``layer`` serves as its stream (`Family.idle`: the
    model does not run it), ``None`` for a block that runs."""
    return model.layers[layer].__dict__["_nncanon"].bindings["layer_input"].block


def site_module(model: Any, layer: int, name: str) -> torch.nn.Module:
    """The module of the unwrapped model at which block ``layer``'s ``name`` is read (its site's module; for
    an idle block's stream, the block it is read at)."""
    binding = host(model, layer, name)._nncanon.bindings[name]
    block = hf_block(model, layer if binding.block is None else binding.block)
    return block.get_submodule(binding.site.module) if binding.site.module else block


def block_streams(model: Any, inputs: dict) -> tuple[list, list, Any]:
    """Every block's input and output read with plain hooks on the unwrapped model, and its output.

    ``None`` for a block the forward did not call (an idle block, `Family.idle`). (Hooks, not
    ``output_hidden_states``: what a model reports there differs, e.g. Mamba's leaves the embeddings out.)
    """
    entering, leaving, handles = {}, {}, []
    for index, block in enumerate(model._module.get_submodule(model.family.layers)):

        def pre(module, args, kwargs, index=index):
            entering[index] = first_input(args, kwargs).clone()

        def post(module, args, output, index=index):
            leaving[index] = (output[0] if isinstance(output, (tuple, list)) else output).clone()

        handles += [block.register_forward_pre_hook(pre, with_kwargs=True), block.register_forward_hook(post)]
    try:
        with torch.no_grad():
            output = model._module(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    count = model.num_layers
    entering_served = [None if entering.get(i) is None else stream_as_served(model, entering[i]) for i in range(count)]
    leaving_served = [None if leaving.get(i) is None else stream_as_served(model, leaving[i]) for i in range(count)]
    return entering_served, leaving_served, output


def stream_as_served(model: Any, tensor: torch.Tensor) -> torch.Tensor:
    """A block's own stream tensor laid out as ``layer_input`` serves it: ``[b, s, k·d]`` where the blocks take
    stacked (``[k, b, s, d]``) or merged (``[b, s, k, d]``) streams, else as it is."""
    if model.family.stacked_streams:
        return stacked_as_served(tensor)
    return tensor.flatten(-2) if model.family.merged_streams else tensor


def site_reference(model: Any, layer: int, name: str, inputs: dict) -> torch.Tensor:
    """A value read with plain forward hooks on the unwrapped model, at the site its family names."""
    found = site_references(model, [(layer, name)], inputs)[layer, name]
    if isinstance(found, Exception):
        raise found
    return found


def site_references(model: Any, keys: Sequence[tuple[int, str]], inputs: dict
                    ) -> dict[tuple[int, str], torch.Tensor | Exception]:
    """`site_reference` of each ``(layer, name)`` of ``keys``: every module site read by a hook in one plain
    forward; an operation site (inside a forward) by nnsight's source hooks on a plain copy, one run each. A
    key whose reading raised maps to the exception."""
    found: dict[tuple[int, str], torch.Tensor | Exception] = {}
    hooked: dict[tuple[int, str], tuple] = {}
    for key in keys:
        binding = host(model, *key)._nncanon.bindings[key[1]]
        site = binding.site
        try:
            if site.weighted is not None:
                found[key] = _finish(_weighted_reference(model, key[0], site, inputs), binding, inputs)
            elif site.op is not None:
                found[key] = _finish(_operation_reference(model, key[0], site, inputs), binding, inputs)
            else:
                hooked[key] = (binding, site, site_module(model, *key))
        except Exception as error:
            found[key] = error
    if not hooked:
        return found
    raw: dict[tuple[int, str], Any] = {}

    def pre(key: tuple[int, str], site: Any) -> Callable:
        def hook(mod: Any, args: tuple, kwargs: dict) -> None:
            raw[key] = (args, kwargs)  # (picked after the forward, as the model left it)
        return hook

    def post(key: tuple[int, str], site: Any) -> Callable:
        def hook(mod: Any, args: tuple, output: Any) -> None:
            value = _pick(output, site).clone()
            if site.bias is not None and isinstance(output, (tuple, list)) and output[site.bias] is not None:
                value = value + output[site.bias]
            raw[key] = value
        return hook

    handles = [module.register_forward_pre_hook(pre(key, site), with_kwargs=True) if site.key == "input"
               else module.register_forward_hook(post(key, site)) for key, (_, site, module) in hooked.items()]
    try:
        with torch.no_grad():
            model._module(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    for key, (binding, site, _) in hooked.items():
        try:
            found[key] = _finish(_pick(raw[key], site).clone() if site.key == "input" else raw[key], binding, inputs)
        except Exception as error:
            found[key] = error
    return found


def _operation_reference(model: Any, layer: int, site: Any, inputs: dict) -> torch.Tensor:
    """An operation site's tensor (``site.op`` inside a forward, where no module hook reaches), read by
    nnsight's own source hooks on a plain ``NNsight`` over a copy of the model."""
    plain = plain_copy(model)
    path = ".".join(part for part in (model.family.layers, str(layer), site.module) if part)
    with torch.no_grad(), plain.trace(**inputs):
        source = plain.get(path).source
        operation = getattr(source, operation_name(source.names, site.op))
        raw = (operation.output if site.key == "output" else operation.inputs).save()
    return _pick(raw, site).clone()


def _weighted_reference(model: Any, layer: int, site: Any, inputs: dict) -> torch.Tensor:
    """A ``weighted`` site's product (what a sublayer writes into the streams): its two operations' outputs,
    read by nnsight's own source hooks on a plain ``NNsight`` over a copy of the model, multiplied."""
    plain = plain_copy(model)
    path = ".".join(part for part in (model.family.layers, str(layer), site.module) if part)
    weight_op, output_op = site.weighted
    with torch.no_grad(), plain.trace(**inputs):
        source = plain.get(path).source
        weight = getattr(source, weight_op).output.save()
        output = getattr(source, output_op).output.save()
    return weight * output


def _weighted_gradient(model: Any, key: tuple[int, str], site: Any, inputs: dict, metric: Callable,
                       keep: _Kept) -> None:
    """The gradient at a ``weighted`` site's product, which no hook reaches: on a plain ``NNsight`` over a copy
    of the model, the product is made a tensor of its own (the weight's operation returns zeros, the product
    is added to the streams' operation, as the model's sum has it) and hooked."""
    plain = plain_copy(model)
    path = ".".join(part for part in (model.family.layers, str(key[0]), site.module) if part)
    weight_op, output_op = site.weighted
    with torch.enable_grad():
        with plain.trace(**inputs):
            source = plain.get(path).source
            weight = getattr(source, weight_op).output
            getattr(source, weight_op).output = torch.zeros_like(weight)
            product = weight * getattr(source, output_op).output
            keep(key, product)
            streams = getattr(source, site.op)
            streams.output = streams.output + product
            output = plain.output.save()
        keep.backward(output, metric)


#: The copies of models one `verify` run shares (`shared_copies`), by the copied module's id: a plain
#: ``NNsight`` over a copy, and copies running another attention implementation. Outside a run, none is kept.
_COPIES: ContextVar[dict | None] = ContextVar("nncanon_proof_copies", default=None)


@contextmanager
def shared_copies() -> Iterator[None]:
    """Within this block, the checks make each copy of a model once and share it (see `plain_copy`)."""
    token = _COPIES.set({})
    try:
        yield
    finally:
        _COPIES.reset(token)


def _shared(key: tuple, make: Callable[[], Any]) -> Any:
    copies = _COPIES.get()
    if copies is None:
        return make()[1]
    if key not in copies:
        copies[key] = make()
    return copies[key][1]


def plain_copy(model: Any) -> Any:
    """A plain ``NNsight`` over a copy of ``model``'s module, for references read by nnsight's own source hooks
    (which change the module they hook: never the model's). Made once per `shared_copies` block."""
    from nnsight import NNsight

    def make() -> tuple:
        return model._module, NNsight(_fresh_copy(model._module))  # (the module is kept, so its id stays its own)

    return _shared(("plain", id(model._module)), make)


def _fresh_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module``; tensors a gradient-tracking forward left on its modules (RecurrentGemma's
    cached states, not leaves: torch cannot deep-copy them) are copied detached. The original is untouched."""
    memo: dict = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(module, memo)


def _finish(tensor: torch.Tensor, binding: Any, inputs: dict, divide: bool = False) -> torch.Tensor:
    """A raw site tensor as the binding serves it: token axis restored, heads split, scaled (``divide``:
    divided by the scale, as a gradient with respect to the served value is)."""
    site = binding.site
    batch, seq = inputs["input_ids"].shape
    if site.flat:
        tensor = tensor.view(batch, -1, *tensor.shape[1:])
    if site.merge:
        tensor = tensor.flatten(-2)
    if site.stacked:
        tensor = stacked_as_served(tensor)
    if binding.heads is not None:
        tensor = tensor.view(batch, seq, binding.heads, -1)
    if site.transposed:
        tensor = tensor.transpose(-1, -2)
    if site.heads_first:
        tensor = tensor.transpose(1, 2)
    if site.scale is not None:
        factor = site.factor(binding.config)
        tensor = tensor / factor if divide else tensor * factor
    return tensor


def gradient_reference(model: Any, layer: int, names: Sequence[str], inputs: dict,
                       metric: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradient of ``metric(logits)`` (a scalar) with respect to each value of ``names`` on block
    ``layer``, by plain PyTorch (`gradient_references` of that one block)."""
    found = gradient_references(model, {layer: names}, inputs, metric)
    return {name: grad for (_, name), grad in found.items()}


def gradient_references(model: Any, names: dict[int, Sequence[str]], inputs: dict,
                        metric: Callable[[torch.Tensor], torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """The gradient of ``metric(logits)`` (a scalar) with respect to each value of ``names[layer]`` on each
    block ``layer``, by plain PyTorch, keyed ``(layer, name)``: a hook at each value's site registers a tensor
    hook on the model's own tensor, and ``torch.autograd.grad`` runs the backward. One forward and one
    backward for every module site (forward hooks) of every block; one each per operation site (nnsight's
    source hook on a plain ``NNsight`` over a copy of the model). Laid out as the value is served (token
    axis restored, heads split) and divided by the site's scale (``value = tensor · scale``). A value the
    backward does not reach has no entry.

    ``attention_probabilities`` is the tensor the model returns with ``output_attentions=True``; where the
    model does not run eager attention (the probabilities are recomputed beside the kernel), the tensor an
    eager copy of it (the same weights) returns.
    """
    grads: dict[tuple[int, str], torch.Tensor] = {}

    keep = _Kept(grads)

    sites = {(layer, name): host(model, layer, name)._nncanon.bindings[name].site
             for layer, listed in names.items() for name in listed if name != "attention_probabilities"}
    modules = {key: site for key, site in sites.items() if site.op is None and site.weighted is None}
    attentions = [layer for layer, listed in names.items() if "attention_probabilities" in listed]
    recomputed = [layer for layer in attentions if not model.layers[layer].self_attn._eager()]
    _module_gradients(model, modules, [layer for layer in attentions if layer not in recomputed], inputs,
                      metric, keep)
    if recomputed:  # probabilities recomputed beside the kernel (sdpa): eager's, on a copy with the same weights
        twin = _implementation_copy(model, "eager")
        if twin is not None:
            _module_gradients(twin, {}, recomputed, inputs, metric, keep)
    for key, site in sites.items():
        if site.weighted is not None:
            _weighted_gradient(model, key, site, inputs, metric, keep)
        elif site.op is not None:
            _operation_gradient(model, key, site, inputs, metric, keep)
    finished = {}
    for (layer, name), grad in grads.items():
        binding = host(model, layer, name)._nncanon.bindings.get(name)
        finished[layer, name] = grad if binding is None else _finish(grad, binding, inputs, divide=True)
    return finished


class _Kept:
    """Keeps, for each tensor it is given, the edge of the autograd graph where the tensor is made at that moment
    (a tensor the model changes in place later, Falcon's MLP output, keeps its value there); `backward` asks the
    gradients of those edges alone (no weight's gradient is computed) and stores them by key."""

    def __init__(self, grads: dict) -> None:
        self.grads = grads
        self.edges: list[tuple[tuple[int, str], Any]] = []

    def __call__(self, key: tuple[int, str], tensor: torch.Tensor) -> None:
        if tensor.requires_grad:
            self.edges.append((key, torch.autograd.graph.get_gradient_edge(tensor)))

    def backward(self, output: Any, metric: Callable) -> None:
        """The gradients of ``metric(output.logits)`` at the edges kept since the last backward."""
        edges, self.edges = self.edges, []
        for (key, _), grad in zip(edges, _gradients_at(output, metric, [edge for _, edge in edges]), strict=True):
            if grad is not None:
                self.grads[key] = grad


def _gradients_at(output: Any, metric: Callable, inputs: Sequence[Any]) -> tuple:
    """``torch.autograd.grad`` of ``metric(output.logits)`` at ``inputs`` (tensors or gradient edges); ``None``
    for an input the metric does not reach."""
    target = metric(output.logits)
    if not inputs or not target.requires_grad:
        return (None,) * len(inputs)
    return torch.autograd.grad(target, list(inputs), allow_unused=True)


def _module_gradients(model: Any, sites: dict, attentions: list[int], inputs: dict, metric: Callable,
                      keep: _Kept) -> None:
    """One forward with a hook at each module site (and the probabilities of ``attentions`` returned), one
    backward."""
    handles = []
    for key, site in sites.items():
        module = site_module(model, *key)
        if site.key == "input":
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, kwargs, key=key, site=site: keep(key, _pick((args, kwargs), site)),
                with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(
                lambda mod, args, output, key=key, site=site: keep(key, _pick(output, site))))
    try:
        with torch.enable_grad():
            output = model._module(**inputs, output_attentions=bool(attentions))
            for layer in attentions:
                keep((layer, "attention_probabilities"), _attentions_of(model, output.attentions, layer))
            keep.backward(output, metric)
    finally:
        for handle in handles:
            handle.remove()


def _attentions_of(model: Any, attentions: Sequence[Any], layer: int) -> torch.Tensor:
    """Block ``layer``'s probabilities among those a model returns: one per block (MiniMax returns its
    linear blocks' weights too), or for each attention block (a hybrid's) in order, as many as it has
    attention sublayers (LongCat-Flash: two), the first being ``self_attn``'s."""
    if len(attentions) == model.num_layers and attentions[layer] is not None:
        return attentions[layer]
    report = model.support()
    present = [a for a in attentions if a is not None]
    blocks = [i for i in range(model.num_layers) if report.available("self_attn", layer=i)]
    each = len(present) // len(blocks)
    return present[blocks.index(layer) * each]


def _operation_gradient(model: Any, key: tuple[int, str], site: Any, inputs: dict, metric: Callable,
                        keep: _Kept) -> None:
    """One forward of a copy of the model as a plain ``NNsight``, a tensor hook on the operation's tensor."""
    plain = plain_copy(model)
    path = ".".join(part for part in (model.family.layers, str(key[0]), site.module) if part)
    with torch.enable_grad():
        with plain.trace(**inputs):
            source = plain.get(path).source
            operation = getattr(source, operation_name(source.names, site.op))
            keep(key, _pick(operation.output if site.key == "output" else operation.inputs, site))
            output = plain.output.save()
        keep.backward(output, metric)


# -- the checks -------------------------------------------------------------------------------


_READ_VALUES = (*KERNEL_INPUTS, *HEAD_VALUES, *CONTRIBUTIONS, *ROUTING, "shared_expert_output")


def check_read(model: Any) -> list[CheckResult]:
    """Every served value, the block streams and the logits against plain hooks, bit for bit."""
    inputs = encode(model)
    entering, leaving, reference = block_streams(model, inputs)
    results = []
    with torch.no_grad(), model.trace(PROMPTS[0]):
        logits = model.logits.save()
    results.append(_compare("read", None, ("logits",), logits, reference.logits, 0.0, "against a plain forward"))
    for index in range(model.num_layers):
        names = ["layer_input", *served(model, index, _READ_VALUES), "layer_output"]
        block = stream_block(model, index)
        if block is not None:  # idle: the stream where it enters the next block that runs (or leaves the last)
            stream = entering[block] if block > index else leaving[block]
            results += _guarded("read", index, names, lambda index=index, stream=stream, block=block: _read_idle(
                model, index, stream, block, entering[index] is not None or leaving[index] is not None))
            continue
        results += _guarded("read", index, names, lambda index=index, names=names: _read_layer(
            model, index, names, inputs, entering[index], leaving[index]))
    return results


def _read_idle(model: Any, index: int, stream: torch.Tensor, block: int, ran: bool) -> list[CheckResult]:
    """An idle block's ``layer_input`` and ``layer_output`` against the stream read by a plain hook at
    ``block``; fails where the model ran the block after all."""
    names = ("layer_input", "layer_output")
    if ran:
        return [CheckResult("read", index, names, False, None, 0.0,
                            "the model ran this block, which the family says it does not run (idle)")]
    saved: list = []  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS[0]):
        saved.append(model.layers[index].layer_input.save())
        saved.append(model.layers[index].layer_output.save())
    side = "input" if block > index else "output"
    return [_compare("read", index, (name,), value, stream, 0.0, f"against a hook at layers[{block}]'s {side}")
            for name, value in zip(names, saved, strict=True)]


def _read_layer(model: Any, index: int, names: list[str], inputs: dict, entering: torch.Tensor,
                leaving: torch.Tensor) -> list[CheckResult]:
    saved = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for name in names:
            saved[name] = getattr(host(model, index, name), name).save()
    results = [
        _compare("read", index, ("layer_input",), saved["layer_input"], entering, 0.0, "against a block hook"),
        _compare("read", index, ("layer_output",), saved["layer_output"], leaving, 0.0, "against a block hook"),
    ]
    references = site_references(model, [(index, name) for name in names[1:-1]], inputs)
    for name in names[1:-1]:
        results += _guarded("read", index, (name,), lambda name=name: [_compare(
            "read", index, (name,), saved[name], _raised_or(references[index, name]), 0.0,
            "against a hook at its site")])
    return results


def _raised_or(found: torch.Tensor | Exception) -> torch.Tensor:
    if isinstance(found, Exception):
        raise found
    return found


def check_identity(model: Any) -> list[CheckResult]:
    """``layer_input + contributions == layer_output`` on every block that serves all its contributions; a
    block the model does not run (`Family.idle`) adds nothing: the stream leaving the block that runs before
    it enters the one after it unchanged (plain hooks)."""
    results = []
    for index in _whole_layers(model):
        names = served(model, index)
        results += _guarded("identity", index, names, lambda index=index, names=names: [_identity(model, index, names)])
    idle = [index for index in range(model.num_layers) if stream_block(model, index) is not None]
    if idle:
        entering, leaving, _ = block_streams(model, encode(model))
        for index in idle:
            results += _guarded("identity", index, ("layer_input", "layer_output"), lambda index=index: [
                _idle_identity(index, entering, leaving)])
    return results


def _idle_identity(index: int, entering: list, leaving: list) -> CheckResult:
    """An idle block adds nothing: the model does not call it, and the stream leaving the block that runs
    before it enters the one that runs after it unchanged (plain hooks)."""
    names = ("layer_input", "layer_output")
    if entering[index] is not None or leaving[index] is not None:
        return CheckResult("identity", index, names, False, None, 0.0, "the model ran this block (idle by its family)")
    before = next((i for i in range(index - 1, -1, -1) if leaving[i] is not None), None)
    after = next((i for i in range(index + 1, len(entering)) if entering[i] is not None), None)
    if before is None or after is None:
        return CheckResult("identity", index, names, True, None, None,
                           "the model does not call it (no block runs on one side to compare)")
    return _compare("identity", index, names, entering[after], leaving[before], 0.0,
                    f"not called; layers[{before}]'s output enters layers[{after}] unchanged")


def _whole_layers(model: Any) -> list[int]:
    """The layers that serve every contribution their block has (whose identity can be asked)."""
    report = model.support()
    layers = []
    for index in range(model.num_layers):
        present = [v for v in CONTRIBUTIONS if report.available(COMPONENT_OF[v], layer=index)]
        if present and all(report.available(v, layer=index) for v in present):
            layers.append(index)
    return layers


def _identity(model: Any, index: int, names: list[str]) -> CheckResult:
    parts: list = []  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS[0]):
        x = model.layers[index].layer_input.save()
        for name in names:
            parts.append(getattr(host(model, index, name), name).save())
        y = model.layers[index].layer_output.save()
    return _compare("identity", index, names, x + sum(parts), y, TOLERANCE, "layer_input + contributions")


def check_ablation(model: Any) -> list[CheckResult]:
    """Each contribution zeroed, the block's later ones held at their clean values: ``layer_output``
    moves by exactly the contribution."""
    results = []
    for index in range(model.num_layers):
        names = served(model, index)
        clean: dict = {}  # the block's contributions and output with no write: one run for all of them
        for position, name in enumerate(names):
            later = names[position + 1:]
            results += _guarded("ablation", index, (name,), lambda index=index, name=name, later=later, names=names,
                                clean=clean: [_ablation(model, index, name, later, names, clean)])
    return results


def _ablation(model: Any, index: int, name: str, later: list[str], names: list[str], clean: dict) -> CheckResult:
    if not clean:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for each in names:
                clean[each] = getattr(host(model, index, each), each).save()
            clean["layer_output"] = model.layers[index].layer_output.save()
    value = clean[name]
    with torch.no_grad(), model.trace(PROMPTS[0]):
        setattr(host(model, index, name), name, torch.zeros_like(value))
        for other in later:
            setattr(host(model, index, other), other, clean[other])
        ablated = model.layers[index].layer_output.save()
    return _compare("ablation", index, (name,), clean["layer_output"] - ablated, value, TOLERANCE,
                    "the stream's change when it is zeroed" + (f", {', '.join(later)} held" if later else ""),
                    magnitude=torch.maximum(clean["layer_output"].abs(), ablated.abs()))


def check_invokes(model: Any) -> list[CheckResult]:
    """A write in the middle invoke of three leaves the other two bit-identical and reaches its own."""
    results = []
    writable = KERNEL_INPUTS + HEAD_VALUES + CONTRIBUTIONS
    clean: list = []  # the three invokes' logits with no write: one run for every value
    for index in range(model.num_layers):
        for name in served(model, index, writable):
            results += _guarded("invokes", index, (name,), lambda index=index, name=name: [
                _invokes(model, index, name, clean)])
    return results


def _three_invokes(model: Any, write: tuple[int, str] | None) -> tuple[torch.Tensor, ...]:
    """The logits of three invokes (the first prompt twice, then the second), ``write``'s value zeroed past
    the first position in the middle one."""
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            first = model.logits.save()
        with tracer.invoke(PROMPTS[0]):
            if write is not None:
                getattr(host(model, *write), write[1])[:, 1:] = 0
            middle = model.logits.save()
        with tracer.invoke(PROMPTS[1]):
            last = model.logits.save()
    return first, middle, last


def _invokes(model: Any, index: int, name: str, clean: list) -> CheckResult:
    if not clean:
        clean.append(_three_invokes(model, None))
    runs = {False: clean[0], True: _three_invokes(model, (index, name))}
    # A mixture of experts runs each expert on the batch's tokens routed to it: a write that reroutes
    # invoke 2's tokens changes how many rows each expert's matmul has, which moves the other rows'
    # results at the last bit (7.5e-9 measured). A write that leaked would move them by far more.
    moe = bool(model.support().layers_with("expert_indices"))
    tolerance = 1e-6 if moe else 0.0
    moved = max(float((runs[True][i] - runs[False][i]).abs().max()) for i in (0, 2))
    reached = not torch.equal(runs[True][1], runs[False][1])
    passed = moved <= tolerance and reached
    note = "the other invokes' logits" + ("" if reached else "; the write did not reach its own invoke")
    return CheckResult("invokes", index, (name,), passed, moved, tolerance, note)


def check_locality(model: Any) -> list[CheckResult]:
    """In bf16, a write at one position of a contribution leaves every other position of the layer's
    output bit-identical (the earlier ones only where a later sublayer reads the previous token:
    the family's ``token_shift_after``)."""
    token_shift_after = model.family.token_shift_after
    bf16 = _bf16_copy(model)
    results = []
    clean: dict = {}  # every block's layer_output with no write: one run for all of them
    for index in _whole_layers(bf16):
        for name in served(bf16, index):
            results += _guarded("locality", index, (name,), lambda index=index, name=name: [
                _locality(bf16, index, name, name in token_shift_after, clean)])
    return results


def _bf16_copy(model: Any) -> Any:
    module = copy.deepcopy(model._module).to(torch.bfloat16)
    return MountedModel(module, family=model.family, tokenizer=model.tokenizer)


def _locality(model: Any, index: int, name: str, shifted: bool, clean: dict) -> CheckResult:
    position = 2
    layer = model.layers[index]
    if not clean:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for each in _whole_layers(model):
                clean[each] = model.layers[each].layer_output.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        getattr(host(model, index, name), name)[:, position] += 0.5
        written = layer.layer_output.save()
    later = range(position + 1, clean[index].shape[1]) if not shifted else ()
    others = [*range(position), *later]
    moved = float((written[:, others].float() - clean[index][:, others].float()).abs().max())
    reached = not torch.equal(written[:, position], clean[index][:, position])
    note = "other positions of layer_output, bf16" + ("" if reached else "; the write did not reach the stream")
    return CheckResult("locality", index, (name,), moved == 0.0 and reached, moved, 0.0, note)


def check_heads(model: Any) -> list[CheckResult]:
    """Each block's heads through their slices of the output projection sum to the projection's output."""
    results = []
    for index in range(model.num_layers):
        for name in served(model, index, HEAD_VALUES):
            results += _guarded("heads", index, (name,), lambda index=index, name=name: [_heads(model, index, name)])
    return results


def _heads(model: Any, index: int, name: str) -> CheckResult:
    spec = model.family.for_layer(model._text_config, index)[0]
    if spec.head_totals is not None:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            heads = getattr(host(model, index, name), name).save()
        total, output = spec.head_totals(model, index, heads, encode(model))
        return _compare("heads", index, (name,), total, output, TOLERANCE, "the family's head totals")
    binding = host(model, index, name)._nncanon.bindings[name]
    through_norm = name == "attention_head_outputs" and spec.head_norm is not None
    # Where a norm over all heads sits before the projection (BitNet), the heads are its input.
    path = spec.head_projection if through_norm else binding.site.module
    projection = hf_block(model, index).get_submodule(path)
    seen: dict = {}

    def keep(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        seen["out"] = out.clone()

    handle = projection.register_forward_hook(keep)
    try:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            heads = getattr(host(model, index, name), name).save()
    finally:
        handle.remove()
    if through_norm:
        with torch.no_grad():
            heads = hf_block(model, index).get_submodule(spec.head_norm)(heads.flatten(-2)).view_as(heads)
    weight, bias = _projection(projection)
    per_head = weight.view(weight.shape[0], heads.shape[-2], -1)  # [out, H, head_dim]
    with torch.no_grad():
        total = torch.einsum("bshd,ohd->bso", heads, per_head)
        if bias is not None:
            total = total + bias
    return _compare("heads", index, (name,), total, seen["out"].view_as(total), TOLERANCE,
                    f"sum over heads through {path}")


def _projection(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W as [out, in], bias) of a linear output projection (``nn.Linear`` or GPT-2's ``Conv1D``)."""
    weight = module.weight
    if type(module).__name__ == "Conv1D":
        weight = weight.T
    return weight, module.bias


def check_probabilities(model: Any) -> list[CheckResult]:
    """Zeroing the last head's probabilities equals zeroing its output, on every layer serving both."""

    results = []
    report = model.support()
    clean: list = []  # the logits with no write: one run for every layer
    for index in report.layers_with("attention_probabilities"):
        if not report.available("attention_head_outputs", layer=index):
            continue
        names = ("attention_probabilities", "attention_head_outputs")
        results += _guarded("probabilities", index, names, lambda index=index: [
            _probabilities(model, index, head_count(model, index) - 1, clean)])
    return results


def _probabilities(model: Any, index: int, head: int, clean_run: list) -> CheckResult:
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.layers[index].self_attn.attention_head_outputs[..., head, :] = 0
        by_head = model.logits.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.layers[index].self_attn.attention_probabilities[:, head] = 0
        by_probabilities = model.logits.save()
    if not clean_run:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            clean_run.append(model.logits.save())
    clean = clean_run[0]
    result = _compare("probabilities", index, ("attention_probabilities", "attention_head_outputs"),
                      by_probabilities, by_head, TOLERANCE, f"logits with head {head} zeroed both ways")
    if torch.equal(by_head, clean):
        return CheckResult(result.check, index, result.values, False, result.error, TOLERANCE,
                           f"zeroing head {head} did not reach the logits")
    return result


def check_kernel(model: Any) -> list[CheckResult]:
    """The kernel's inputs are what it attends with: ``softmax(q·kᵀ·scale + mask)`` (with the call's
    softcap, position bias and sinks, or the module's ALiBi argument where an inline kernel adds it; where the
    kernel masks positions itself, from buffers no argument holds, over the rest, on token rows) reproduces the
    eager probabilities, and zeroing one group of ``value_states`` zeroes exactly its heads' kernel output.
    Where the forward calls its kernel only under another attention implementation (Falcon's sdpa call before
    transformers 5.25), on a
    copy of the model running that one: the inputs read there against plain source hooks, and
    ``softmax(q·kᵀ·scale + mask) · v`` against the kernel's own output."""
    results = []
    report = model.support()
    for index in report.layers_with("query_states"):
        if report.available("attention_probabilities", layer=index) and _runs_eager(model):
            values = ("query_states", *(("key_states",) if report.available("key_states", layer=index) else ()),
                      "attention_probabilities")
            results += _guarded("kernel", index, values, lambda index=index, values=values: [
                _attends(model, index, values)])
        if report.available("value_states", layer=index):
            results += _guarded("kernel", index, ("value_states",), lambda index=index: [
                _values_reach(model, index)])
    return results + _kernel_elsewhere(model)


def _kernel_elsewhere(model: Any) -> list[CheckResult]:
    """The kernel inputs of blocks whose forward calls the kernel only under another implementation (not
    served on ``model``), proved on a copy running it: read, their scores, and the values' reach."""
    results = []
    for other, layers in _kernel_copies(model):
        results += _kernel_on(other, layers)
    return results


def _kernel_copies(model: Any) -> list[tuple[Any, list[int]]]:
    """For blocks whose forward calls its kernel only under another implementation than ``model`` runs (Falcon's
    sdpa call before transformers 5.25), a copy of ``model`` running that one, with those blocks (none where the
    class cannot run it)."""
    by_implementation: dict[str, list[int]] = {}
    for index in model.support().layers_with("self_attn"):
        kernel = model.layers[index].self_attn._nncanon.kernel
        now = kernel_implementation(model.layers[index].self_attn._module)
        if isinstance(kernel, Kernel) and not kernel.runs_under(now):
            by_implementation.setdefault(kernel.implementations[0], []).append(index)
    copies = []
    for implementation, layers in by_implementation.items():
        other = _implementation_copy(model, implementation)
        if other is not None:
            copies.append((other, layers))
    return copies


def _kernel_on(other: Any, layers: list[int]) -> list[CheckResult]:
    """`_kernel_elsewhere` on ``other``, the copy running the kernel."""
    inputs, report, results = encode(other), other.support(), []
    for index in layers:
        names = [name for name in KERNEL_INPUTS if report.available(name, layer=index)]
        results += _guarded("read", index, names, lambda index=index, names=names: _read_kernel(
            other, index, names, inputs))
        if "query_states" in names:
            values = tuple(names)
            results += _guarded("kernel", index, values, lambda index=index, values=values: [
                _attends(other, index, values)])
        if "value_states" in names:
            results += _guarded("kernel", index, ("value_states",), lambda index=index: [
                _values_reach(other, index)])
    return results


def _read_kernel(model: Any, index: int, names: list[str], inputs: dict) -> list[CheckResult]:
    """The kernel inputs ``names`` of block ``index`` against nnsight's source hooks on a plain copy."""
    saved = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for name in names:
            saved[name] = getattr(model.layers[index].self_attn, name).save()
    references = site_references(model, [(index, name) for name in names], inputs)
    return [_compare("read", index, (name,), saved[name], _raised_or(references[index, name]), 0.0,
                     f"against a source hook at its call, under {kernel_implementation(model._module)}")
            for name in names]


def _runs_eager(model: Any) -> bool:
    return all(model.layers[i].self_attn._eager() for i in model.support().layers_with("attention_probabilities"))


def _kernel(model: Any, index: int) -> Kernel:
    return model.layers[index].self_attn._nncanon.kernel


def _interface(model: Any, index: int, output: bool = False) -> Any:
    """Block ``index``'s kernel call (transformers' attention interface, or the family's), as an nnsight
    operation (inside a trace); ``output``: the call whose output is the attention output (`Kernel.output_op`)."""
    source = model.layers[index].self_attn.source
    kernel = _kernel(model, index)
    return getattr(source, operation_name(source.names, kernel.output_op if output else kernel.op))


def _bias(module: torch.nn.Module, kernel: Kernel, inputs: tuple, kwargs: dict, batch: int, keys: int
          ) -> torch.Tensor:
    """The position bias the kernel adds to the scores (`Kernel.bias`): the module's argument of that name (of
    its forward's ``inputs``), laid out to broadcast over ``[b, heads, q, k]`` (its last ``keys`` positions;
    heads out of the batch where the kernel folds them in), times the call's ``beta``."""
    import inspect

    bound = inspect.signature(type(module).forward).bind(module, *inputs[0], **inputs[1])  # (the class's own)
    bias = bound.arguments[kernel.bias][..., -keys:]
    if kernel.batch_heads:
        bias = bias.unflatten(0, (batch, -1))  # [b·heads, 1, k]
    return bias * kwargs.get("beta", 1.0)


def _attends(model: Any, index: int, values: tuple[str, ...]) -> CheckResult:
    """``values``: the kernel inputs served on the block (where ``key_states`` is declined, the keys are the
    call's own argument, and likewise the values), held to the eager probabilities; where the model runs a
    kernel that computes none, the probabilities times the values are held to the kernel's own output."""

    attention = model.layers[index].self_attn
    kernel = _kernel(model, index)
    eager = attention._eager()
    saved: dict = {}  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS):
        if kernel.bias is not None:
            saved["module"] = attention.inputs.save()
        for name in values:
            if name in KERNEL_INPUTS:
                saved[name] = getattr(attention, name).save()
        saved["call"] = _interface(model, index).inputs.save()
        if eager:
            saved["probabilities"] = attention.attention_probabilities.save()
        else:
            saved["output"] = _interface(model, index, output=True).output.save()
    args, kwargs = saved["call"]
    called = kernel.inputs(args, kwargs)
    q = saved["query_states"].transpose(1, 2)  # [b, H, s, d]
    k = called[1] if "key_states" not in saved else saved["key_states"].transpose(1, 2)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) * kernel.scale(attention._module, kwargs, q.shape[-1])
    if kwargs.get("softcap"):
        scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
    if kwargs.get("position_bias") is not None:  # an additive bias the interface takes (relative positions)
        scores = scores + kwargs["position_bias"]
    if kernel.bias is not None:  # the module's own position bias (ALiBi), added to the scaled scores
        scores = scores + _bias(attention._module, kernel, saved["module"], kwargs, q.shape[0], k.shape[-2])
    causal = kwargs.get(kernel.causal, False) if kernel.causal else getattr(attention._module, "is_causal", True)
    mask = _additive_mask(kernel.call_mask(args, kwargs), q, k, bool(causal))
    if mask is not None:
        scores = scores + mask[..., : k.shape[-2]]
    how = "q·kᵀ·scale + mask" if kernel.bias is None else f"q·kᵀ·scale + {kernel.bias} + mask"
    if kernel.structural_mask:  # masked inside the kernel, by buffers no argument holds: as it masked them
        scores = scores.masked_fill(saved["probabilities"] == 0, float("-inf"))
        how += ", over the positions the kernel does not mask itself"
    expected = {"softmax": torch.softmax(scores.float(), dim=-1).to(q.dtype)}
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # a sink is one more logit of the softmax (GPT-OSS), or only scales the output after
        sunk = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
        expected["softmax with the sink logit"] = torch.softmax(sunk.float(), dim=-1)[..., :-1].to(q.dtype)
    real = encode_batch(model)["attention_mask"].bool()  # the query rows that are tokens, not padding
    if eager:
        probabilities = saved["probabilities"]
        if kernel.structural_mask:  # a padding row attends where the kernel's own mask puts it: its rows only
            probabilities, expected = probabilities.transpose(1, 2)[real], {
                name: formula.transpose(1, 2)[real] for name, formula in expected.items()}
            how += ", on the rows that are tokens"
        results = [_compare("kernel", index, values, probabilities, formula, TOLERANCE,
                            f"{name}({how}) against the eager probabilities") for name, formula in expected.items()]
    else:  # no probabilities: what they make of the values, on the rows that are tokens, against the kernel's output
        v = called[2] if "value_states" not in saved else saved["value_states"].transpose(1, 2)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        output = kernel.attention_output(saved["output"], q.shape[0])[real]
        results = [_compare("kernel", index, values, (formula @ v).transpose(1, 2)[real], output, TOLERANCE,
                            f"{name}({how}) · v against the kernel's output under "
                            f"{kernel_implementation(model._module)}") for name, formula in expected.items()]
    return next((result for result in results if result.passed), results[0])


def _values_reach(model: Any, index: int) -> CheckResult:
    attention = model.layers[index].self_attn
    kernel = _kernel(model, index)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        groups = attention.value_states.save()
        clean = _interface(model, index, output=True).output.save()
    groups = groups.shape[-2]
    with torch.no_grad(), model.trace(PROMPTS[0]):
        attention.value_states[..., -1, :] = 0
        written = _interface(model, index, output=True).output.save()
    clean, written = kernel.attention_output(clean, 1), kernel.attention_output(written, 1)
    heads = written.shape[-2]
    silenced = torch.arange(heads) // (heads // groups) == groups - 1
    zeroed = float(written[..., silenced, :].abs().max())
    moved = float((written[..., ~silenced, :] - clean[..., ~silenced, :]).abs().max()) if (~silenced).any() else 0.0
    reached = not torch.equal(written, clean)
    passed = zeroed == 0.0 and moved == 0.0 and reached
    note = (f"value group {groups - 1} zeroed: its {int(silenced.sum())} heads' kernel output max |x| {zeroed:.1e}, "
            f"the other heads moved {moved:.1e}")
    return CheckResult("kernel", index, ("value_states",), passed, max(zeroed, moved), 0.0, note)


def check_recomputed(model: Any) -> list[CheckResult]:
    """Under sdpa, the probabilities recomputed from the kernel's inputs equal eager's and multiply the
    values to sdpa's own output (left-padded batch)."""
    layers = [i for i in model.support().layers_with("attention_probabilities")
              if _recomputable(model.layers[i].self_attn._nncanon.kernel)
              and model.layers[i].self_attn._nncanon.reason(RECOMPUTED) is None]
    if not layers:
        return []
    sdpa = _implementation_copy(model, "sdpa")
    if sdpa is None:  # the model class has no sdpa path: nothing runs without eager
        return []
    eager = model if _runs_eager(model) else _implementation_copy(model, "eager")
    results = []
    for index in layers:
        results += _guarded("recomputed", index, (RECOMPUTED,), lambda index=index: _recomputed(
            eager, sdpa, index))
    return results


def _recomputable(kernel: Any) -> bool:
    """Whether probabilities are recomputed from ``kernel`` (a `Kernel`, or why the block has none) under sdpa."""
    return isinstance(kernel, Kernel) and kernel.recompute is not None and kernel.runs_under("sdpa")


def _implementation_copy(model: Any, implementation: str) -> Any:
    """A copy of ``model`` running ``implementation`` (``None``: its class does not support it); made once per
    `shared_copies` block."""
    return _shared(("implementation", id(model._module), implementation),
                   lambda: (model._module, _make_implementation_copy(model, implementation)))


def _make_implementation_copy(model: Any, implementation: str) -> Any:
    module = _fresh_copy(model._module)
    try:
        module.set_attn_implementation(implementation)
    except (ValueError, ImportError):
        return None
    if kernel_implementation(module) != implementation and _branches_on(model, implementation):
        # transformers will not switch a class without the attention interface (it warns), but a forward
        # that makes its kernel call under this implementation reads the config at each call (Falcon before 5.25)
        module.config._attn_implementation = implementation
    copy_ = MountedModel(module, family=model.family, tokenizer=model.tokenizer)
    attentions = [copy_.layers[i].self_attn._module for i in copy_.support().layers_with("attention_probabilities")]
    if any(kernel_implementation(attention) != implementation for attention in attentions):
        return None  # the class only warns that it cannot switch (GOT-OCR2): no copy runs it
    return copy_


def _branches_on(model: Any, implementation: str) -> bool:
    """Whether some block's forward makes its kernel call under ``implementation`` only (`Kernel.implementations`:
    it reads the config's implementation at each call)."""
    kernels = [model.layers[i].self_attn._nncanon.kernel for i in model.support().layers_with("self_attn")]
    return any(isinstance(k, Kernel) and k.implementations and implementation in k.implementations for k in kernels)


def _recomputed(eager: Any, sdpa: Any, index: int) -> list[CheckResult]:
    with torch.no_grad(), eager.trace(PROMPTS):
        reference = eager.layers[index].self_attn.attention_probabilities.save()
    attention = sdpa.layers[index].self_attn
    kernel = _kernel(sdpa, index)
    with torch.no_grad(), sdpa.trace(PROMPTS):
        call = _interface(sdpa, index).inputs.save()
        probabilities = attention.attention_probabilities.save()
        output = _interface(sdpa, index, output=True).output.save()
    output = kernel.attention_output(output, probabilities.shape[0])
    real = encode_batch(sdpa)["attention_mask"].bool()  # the query rows that are tokens, not padding
    v = kernel.inputs(*call)[2]  # the values the kernel received, [b, KV, k, d]
    v = v.repeat_interleave(probabilities.shape[1] // v.shape[1], dim=1)
    mixed = (probabilities @ v).transpose(1, 2)  # [b, q, H, d]
    return [
        _compare("recomputed", index, (RECOMPUTED,), probabilities, reference, TOLERANCE,
                 "recomputed under sdpa against eager's probabilities"),
        _compare("recomputed", index, (RECOMPUTED,), mixed[real], output[real], TOLERANCE,
                 "recomputed probabilities · values against sdpa's output"),
    ]


def encode_batch(model: Any) -> dict:
    """`PROMPTS` tokenized as a trace tokenizes a batch of them (left-padded)."""
    return dict(model.tokenizer(PROMPTS, return_tensors="pt", padding=True))


def check_routing(model: Any) -> list[CheckResult]:
    """The chosen experts are distinct and in range; masking one expert reroutes exactly its tokens."""
    results = []
    report = model.support()
    for index in report.layers_with("expert_indices"):
        names = tuple(name for name in ROUTING if report.available(name, layer=index))
        results += _guarded("routing", index, names, lambda index=index, names=names: [
            _routing(model, index, names)])
    return results


def _routing(model: Any, index: int, names: tuple[str, ...]) -> CheckResult:
    mlp = model.layers[index].mlp
    ordered = served(model, index, names)  # (asks the model: not inside the trace)
    saved = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for name in ordered:
            saved[name] = getattr(mlp, name).save()
    indices = saved["expert_indices"]
    problems = []
    if indices.dtype != torch.long:
        problems.append(f"expert_indices has dtype {indices.dtype}")
    flat = indices.reshape(-1, indices.shape[-1])
    if any(len(set(row.tolist())) != len(row) for row in flat):
        problems.append("a token has an expert twice")
    if "expert_weights" in saved and saved["expert_weights"].shape != indices.shape:
        problems.append(f"expert_weights {tuple(saved['expert_weights'].shape)} vs indices {tuple(indices.shape)}")
    if "router_logits" in saved:
        logits = saved["router_logits"]
        if int(indices.max()) >= logits.shape[-1] or logits.shape[:2] != indices.shape[:2]:
            problems.append(f"router_logits {tuple(logits.shape)} do not index the experts {tuple(indices.shape)}")
        else:
            problems += _reroute(model, index, indices)
    return CheckResult("routing", index, names, not problems, None, None,
                       "; ".join(problems) or "distinct experts; masking one reroutes exactly its tokens")


def _reroute(model: Any, index: int, before: torch.Tensor) -> list[str]:
    mlp = model.layers[index].mlp
    expert = int(before.flatten()[0])
    with torch.no_grad(), model.trace(PROMPTS[0]):
        mlp.router_logits[..., expert] = float("-inf")
        after = mlp.expert_indices.save()
    routed = (before == expert).any(-1)
    problems = []
    if (after == expert).any():
        problems.append(f"expert {expert} masked with -inf is still chosen")
    if not torch.equal(after[~routed], before[~routed]):
        problems.append(f"masking expert {expert} moved tokens not routed to it")
    return problems


def check_lens(model: Any) -> list[CheckResult]:
    """``project_on_vocab(layers[-1].layer_output) == logits``, bit for bit, on a left-padded batch."""

    def run() -> list[CheckResult]:
        with torch.no_grad(), model.trace(PROMPTS):
            lens = model.project_on_vocab(model.layers[-1].layer_output).save()
            logits = model.logits.save()
        return [_compare("lens", None, ("project_on_vocab",), lens, logits, 0.0, "at the last layer")]

    return _guarded("lens", None, ("project_on_vocab",), run)


def check_skip(model: Any) -> list[CheckResult]:
    """Every block skipped: the stream leaves as it entered, and the logits are its lens."""

    def run() -> list[CheckResult]:
        last = model.num_layers - 1
        with torch.no_grad(), model.trace(PROMPTS[0]):
            entering = model.layers[0].layer_input.save()
            model.skip_layers(0, last)
            leaving = model.layers[last].layer_output.save()
            lens = model.project_on_vocab(entering).save()
            logits = model.logits.save()
        passed = _compare("skip", None, ("skip_layers",), leaving, entering, 0.0, "the stream through the skip")
        if not passed.passed:
            return [passed]
        return [_compare("skip", None, ("skip_layers",), logits, lens, 0.0, "logits after the skip vs the lens")]

    return _guarded("skip", None, ("skip_layers",), run)


def check_resume(model: Any) -> list[CheckResult]:
    """A forward resumed at layer 0 and at the middle layer with the recorded stream gives the forward's
    logits bit for bit; last-position-only logits equal the last row."""

    if "resume" in model._model_declines:  # the family says why a resumed forward is not the forward
        return []

    def run() -> list[CheckResult]:
        middle = model.num_layers // 2 or 1 if model.num_layers > 1 else 0
        streams = streams_entering(model, PROMPTS[0], [0, middle])
        with torch.no_grad(), model.trace(PROMPTS[0]):
            whole = model.logits.save()
        results = []
        for layer, stream in streams.items():
            with torch.no_grad(), model.trace(PROMPTS[0]):
                resume_at(model, layer, stream)
                resumed = model.logits.save()
            results.append(_compare("resume", None, ("resume",), resumed, whole, 0.0, f"resumed at layers[{layer}]"))
        with torch.no_grad(), model.trace(PROMPTS[0], **next_token_only(model)):
            last = model.logits.save()
        results.append(_compare("resume", None, ("resume",), last[:, -1], whole[:, -1], TOLERANCE,
                                "last-position logits only"))
        return results

    return _guarded("resume", None, ("resume",), run)


def gradient_inputs(model: Any) -> dict:
    """The gradient checks' forward: `encode` without a cache (`NO_CACHE`)."""
    return {**encode(model), **NO_CACHE}


def gradient_target(model: Any) -> tuple[int, int, int]:
    """The logit the gradient checks differentiate: ``logits[0, -1, GRADIENT_TOKEN]`` as an index."""
    return (0, encode(model)["input_ids"].shape[1] - 1, GRADIENT_TOKEN)


def served_gradients(model: Any, names: dict[int, Sequence[str]]) -> dict[tuple[int, str], torch.Tensor]:
    """``value.grad`` of each value of ``names[layer]`` (each block's in execution order) for the logit
    `gradient_target`, through nncanon: one trace, one ``with logit.backward():`` block, the gradients asked
    in the reverse of the forward order. Keyed ``(layer, name)``.

    Raises:
        GradientNotAvailable: a gradient never arrived (and what else the trace raises).
    """
    target = gradient_target(model)
    values: dict = {}  # bound outside the trace, filled inside
    grads: dict = {}
    with torch.enable_grad(), model.trace(PROMPTS[0], **NO_CACHE):
        for layer, listed in names.items():
            for name in listed:
                values[layer, name] = getattr(host(model, layer, name), name)
        logit = model.logits[target]
        with logit.backward():
            for key in reversed(list(values)):
                grads[key] = values[key].grad.save()
    return grads


def check_gradients(model: Any) -> list[CheckResult]:
    """``value.grad`` of every served value, inside ``with logit.backward():``, equals the gradient of the
    same logit at the value's site by plain PyTorch (tensor hooks, ``torch.autograd.grad``), laid out and
    scaled as the value is served (kernel inputs served under another implementation only: on a copy running it)."""
    names = {layer: served(model, layer, GRADIENT_VALUES) for layer in range(model.num_layers)}
    results = _gradients(model, names)
    for other, layers in _kernel_copies(model):  # kernel inputs served under another implementation only
        results += _gradients(other, {layer: served(other, layer, KERNEL_INPUTS) for layer in layers})
    return results


def _gradients(model: Any, names: dict[int, list[str]]) -> list[CheckResult]:
    """`check_gradients` of the values ``names[layer]`` of each block."""

    inputs = gradient_inputs(model)
    target = gradient_target(model)
    reference = gradient_references(model, names, inputs, lambda logits: logits[target])
    try:  # every value in one backward; where that fails, each value alone says which one
        ours: dict | None = served_gradients(model, names)
    except Exception:
        ours = None
    results = []
    for layer, listed in names.items():
        for name in listed:
            def run(layer: int = layer, name: str = name) -> list[CheckResult]:
                key = (layer, name)
                if ours is not None:
                    grad = ours[key]
                else:
                    try:
                        grad = served_gradients(model, {layer: [name]})[key]
                    except GradientNotAvailable:
                        grad = None
                return [_gradient_result(layer, name, grad, reference.get(key))]

            results += _guarded("gradients", layer, (name,), run)
    return results


def _gradient_result(layer: int, name: str, grad: torch.Tensor | None, expected: torch.Tensor | None
                     ) -> CheckResult:
    """nncanon's gradient of ``name`` (``None``: it never arrived) against plain PyTorch's (``None``: the
    backward does not reach the site): one missing is a zero gradient."""
    if expected is None:
        error = 0.0 if grad is None else float(grad.detach().abs().max())
        note = "the backward does not reach it in the plain model" + (
            "" if grad is None else "; nncanon's gradient should be zero")
        return CheckResult("gradients", layer, (name,), error == 0.0, error, 0.0, note)
    if grad is None:
        return CheckResult("gradients", layer, (name,), False, float(expected.detach().abs().max()), GRADIENT_TOLERANCE,
                           "the backward never reached the served value; plain PyTorch's gradient is not zero")
    return _compare("gradients", layer, (name,), grad, expected, GRADIENT_TOLERANCE,
                    "against tensor hooks at its site and torch.autograd.grad", absolute=GRADIENT_ABSOLUTE)


def check_gradient_writes(model: Any) -> list[CheckResult]:
    """``value.grad = 0`` on a value of the last block equals the plain model with the value's site detached:
    the gradient reaching the stream entering block 0 is the same."""
    layer = model.num_layers - 1
    results = []
    for name in served(model, layer, GRADIENT_VALUES):
        binding = host(model, layer, name)._nncanon.bindings.get(name)
        if binding is None or binding.site.op is not None or (layer == 0 and name == "layer_input"):
            continue  # no module hook detaches an operation's tensor or the probabilities; the stream is block 0's
        results += _guarded("gradient_writes", layer, (name,), lambda name=name: [
            _gradient_write(model, layer, name)])
    return results


def _gradient_write(model: Any, layer: int, name: str) -> CheckResult:
    target = gradient_target(model)
    with torch.enable_grad(), model.trace(PROMPTS[0], **NO_CACHE):
        stream = model.layers[0].layer_input
        value = getattr(host(model, layer, name), name)
        logit = model.logits[target]
        with logit.backward():
            value.grad = torch.zeros_like(value.grad)
            ours = stream.grad.save()
    expected = _stream_gradient_with_site_detached(model, layer, name)
    return _compare("gradient_writes", layer, (name,), ours, expected, GRADIENT_TOLERANCE,
                    "the stream's gradient against the plain model with the site detached", absolute=GRADIENT_ABSOLUTE)


def _stream_gradient_with_site_detached(model: Any, layer: int, name: str) -> torch.Tensor:
    """d logit / d (block 0's input) in the plain model, with ``name``'s site tensor on ``layer`` detached."""
    site = host(model, layer, name)._nncanon.bindings[name].site
    module = site_module(model, layer, name)
    seen: dict = {}

    def entering(mod: Any, args: Any, kwargs: Any) -> None:
        seen["x"] = first_input(args, kwargs)

    if site.key == "input":
        cut = module.register_forward_pre_hook(
            lambda mod, args, kwargs: _put((args, kwargs), site, _pick((args, kwargs), site).detach()),
            with_kwargs=True)
    else:
        cut = module.register_forward_hook(lambda mod, args, output: _put(output, site, _pick(output, site).detach()))
    watch = site_module(model, 0, "layer_input").register_forward_pre_hook(entering, with_kwargs=True)
    try:
        with torch.enable_grad():
            output = model._module(**gradient_inputs(model))
            if seen["x"].requires_grad:
                seen["grad"] = _gradients_at(output, lambda logits: logits[gradient_target(model)], [seen["x"]])[0]
    finally:
        cut.remove()
        watch.remove()
    grad = seen.get("grad")
    grad = torch.zeros_like(seen["x"]) if grad is None else grad  # (no path left from the stream to the logit)
    return stream_as_served(model, grad)  # laid out as layer_input is served


@dataclass(frozen=True)
class Check:
    """A named check and the function that runs it.

    ``gradient``: it proves the values' gradients (``value.grad``), not the values: a value whose gradient
    check fails is served, its ``.grad`` is not.
    """

    name: str
    run: Callable[[Any], list[CheckResult]]
    doc: str = field(default="", compare=False)
    gradient: bool = False


def _check(function: Callable[[Any], list[CheckResult]], gradient: bool = False) -> Check:
    doc = " ".join((function.__doc__ or "").split("\n\n")[0].split())
    return Check(function.__name__.removeprefix("check_"), function, doc, gradient)


#: Every check, in the order `verify` runs them: the values' checks, then the gradients'.
CHECKS: tuple[Check, ...] = (
    *(_check(function) for function in (
        check_read, check_identity, check_ablation, check_invokes, check_locality, check_heads,
        check_probabilities, check_kernel, check_recomputed, check_routing, check_lens, check_skip, check_resume,
    )),
    *(_check(function, gradient=True) for function in (check_gradients, check_gradient_writes)),
)
