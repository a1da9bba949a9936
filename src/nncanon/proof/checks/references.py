"""The references the checks compare against: each value's site read with plain PyTorch hooks (or nnsight's
source hooks on a plain copy) on the unwrapped model, and the copies of a model a verify run shares.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from nnsight.intervention.util import first_input

from ...components.kernel import Kernel
from ...components.kernel import implementation as kernel_implementation
from ...mounted import MountedModel
from ...quantization import copied_tensor
from ...reading import CONTRIBUTIONS, host, in_execution_order
from ...served import _part, _pick, operation_name, stacked_as_served
from ...support import COMPONENT_OF
from ..prompts import PROMPTS


def served(model: Any, layer: int, names: Sequence[str] = CONTRIBUTIONS) -> list[str]:
    """The values of ``names`` block ``layer`` serves (per ``support()``), in the order its forward runs them."""

    report = model.support()
    present = [name for name in names if report.available(name, layer=layer)]
    return in_execution_order(model, layer, present)


@contextmanager
def hooks_removed(handles: list) -> Iterator[None]:
    """Removes the plain hook ``handles`` when the block ends (raised or not)."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def encode(model: Any, prompt: str = PROMPTS[0]) -> dict:
    """One prompt tokenized as a trace tokenizes it (no padding)."""
    return dict(model.tokenizer(prompt, return_tensors="pt"))


def encode_batch(model: Any) -> dict:
    """`PROMPTS` tokenized as a trace tokenizes a batch of them (left-padded)."""
    return dict(model.tokenizer(PROMPTS, return_tensors="pt", padding=True))


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
    inside: dict[tuple[int, str], Any] = {}
    for key in keys:
        binding = host(model, *key)._nncanon.bindings[key[1]]
        site = binding.site
        if site.weighted is not None or site.op is not None:
            inside[key] = binding
        else:
            try:
                hooked[key] = (binding, site, site_module(model, *key))
            except Exception as error:
                found[key] = error
    found.update(_inside_references(model, inside, inputs))
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
            found[key] = finish(_pick(raw[key], site).clone() if site.key == "input" else raw[key], binding, inputs)
        except Exception as error:
            found[key] = error
    return found


def _inside_references(model: Any, bindings: dict[tuple[int, str], Any], inputs: dict
                       ) -> dict[tuple[int, str], torch.Tensor | Exception]:
    """The operation and ``weighted`` sites of ``bindings`` (keys in the forward's order), finished as served: all in
    one run of a plain copy; where that raises, one run each (a key whose run raised maps to the exception)."""
    if len(bindings) > 1:
        try:
            raw = _inside_run(model, list(bindings), inputs)
            return {key: finish(raw[key], binding, inputs) for key, binding in bindings.items()}
        except Exception:
            pass
    found: dict[tuple[int, str], torch.Tensor | Exception] = {}
    for key, binding in bindings.items():
        try:
            found[key] = finish(_inside_run(model, [key], inputs)[key], binding, inputs)
        except Exception as error:
            found[key] = error
    return found


def _inside_run(model: Any, keys: list[tuple[int, str]], inputs: dict) -> dict[tuple[int, str], torch.Tensor]:
    """The raw tensor at each operation or ``weighted`` site of ``keys`` (in the forward's order), read by nnsight's
    own source hooks on a plain ``NNsight`` over a copy of the model, in one run."""
    plain = plain_copy(model)
    sites = {key: host(model, *key)._nncanon.bindings[key[1]].site for key in keys}
    saved: dict = {}  # bound outside the trace, filled inside; by (module path, operation, output or inputs)
    reads: dict = {}  # each key's reads
    with torch.no_grad(), plain.trace(**inputs):
        for key, site in sites.items():
            path = ".".join(part for part in (model.family.layers, str(key[0]), site.module) if part)
            source = plain.get(path).source
            reads[key] = [(path, op, "output") for op in site.weighted] if site.weighted is not None else [
                (path, operation_name(source.names, site.op), site.key)]
            for read in reads[key]:  # (an operation read once: the kernel call's inputs hold q, k and v)
                if read not in saved:
                    operation = getattr(source, read[1])
                    saved[read] = (operation.output if read[2] == "output" else operation.inputs).save()
    found = {}
    for key, site in sites.items():
        if site.weighted is not None:
            found[key] = saved[reads[key][0]] * saved[reads[key][1]]
        else:
            found[key] = _pick(saved[reads[key][0]], site).clone()
    return found


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
        return model._module, NNsight(fresh_copy(model._module))  # (the module is kept, so its id stays its own)

    return _shared(("plain", id(model._module)), make)


def fresh_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module``; tensors a gradient-tracking forward left on its modules (RecurrentGemma's
    cached states, not leaves: torch cannot deep-copy them) are copied detached. The original is untouched."""
    memo: dict = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
        for parameter in sub.parameters(recurse=False):  # quantized weights torch cannot deep-copy (quanto's)
            copied = None if id(parameter) in memo else copied_tensor(parameter)
            if copied is not None:
                memo[id(parameter)] = copied
    return copy.deepcopy(module, memo)


def finish(tensor: torch.Tensor, binding: Any, inputs: dict, divide: bool = False) -> torch.Tensor:
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
    if site.part is not None:
        tensor = _part(tensor, site.part)
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


def whole_layers(model: Any) -> list[int]:
    """The layers that serve every contribution their block has (whose identity can be asked)."""
    report = model.support()
    layers = []
    for index in range(model.num_layers):
        present = [v for v in CONTRIBUTIONS if report.available(COMPONENT_OF[v], layer=index)]
        if present and all(report.available(v, layer=index) for v in present):
            layers.append(index)
    return layers


def implementation_copy(model: Any, implementation: str) -> Any:
    """A copy of ``model`` running ``implementation`` (``None``: its class does not support it); made once per
    `shared_copies` block."""
    return _shared(("implementation", id(model._module), implementation),
                   lambda: (model._module, _make_implementation_copy(model, implementation)))


def _make_implementation_copy(model: Any, implementation: str) -> Any:
    module = fresh_copy(model._module)
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


def kernel_copies(model: Any) -> list[tuple[Any, list[int]]]:
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
        other = implementation_copy(model, implementation)
        if other is not None:
            copies.append((other, layers))
    return copies
