"""Mount a family's sites on a model's envoy tree: the only place family data meets a model.

`mount` gives each block's envoy, and the envoys of its attention, linear mixer and MLP, the
class of the role they play in that block (by block kind, not by the family's attribute names),
binds each standard value to the site its family names for the block's kind, routes the standard
component names, and records what a block does not serve with the reason.

The classes are adopted after nnsight built the tree (``envoy.__class__``), rather than chosen
by an ``envoys=`` map while it builds: a map is matched against every module's path spellings,
which made loading ~1.7x slower than plain nnsight; adoption costs a few microseconds a block.
Our classes add values only (no state of their own), so an adopted envoy is exactly the envoy
nnsight built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nnsight.intervention.envoy import Envoy

from .components import (
    AttentionEnvoy,
    ComponentState,
    LayerEnvoy,
    LayersEnvoy,
    LinearAttentionEnvoy,
    MLPEnvoy,
    VirtualMLP,
)
from .components.kernel import (
    RECOMPUTED,
    STATES,
    Kernel,
    kernel_for,
    kernel_reason,
    recompute_reason,
)
from .components.kernel import implementation as kernel_implementation
from .errors import ValueNotAvailable
from .families import Family
from .order import block_order
from .served import Binding, Site, operation_name


def adopt(envoy: Envoy, role: type) -> None:
    """Give ``envoy`` the standard ``role`` class (kept together with a custom class the user chose)."""
    current = type(envoy)
    if issubclass(current, role):
        return
    if current is not Envoy:
        role = _combined(role, current)
    envoy.__class__ = role


_COMBINED: dict[tuple[type, type], type] = {}


def _combined(role: type, custom: type) -> type:
    key = (role, custom)
    if key not in _COMBINED:
        _COMBINED[key] = type(f"{role.__name__}With{custom.__name__}", (role, custom), {})
    return _COMBINED[key]


class ProbabilitiesReason:
    """The reason ``attention_probabilities`` is not served, or ``None``: under eager attention they are
    read where they multiply the values; under another implementation, recomputed from the attention
    interface's inputs (`nncanon.components.kernel`) where that is exact for the module and proved.

    Read from the model's config at each call (nnsight can switch the implementation of a loaded
    model), through the envoy tree, so it travels with a remote request.
    """

    def __init__(self, attention: Envoy) -> None:
        self.attention = attention

    def __call__(self) -> str | None:
        if self.attention._eager():
            return None
        implementation = kernel_implementation(self.attention._module) or kernel_implementation(
            self.attention.root._module)
        reason = recompute_reason(type(self.attention._module), implementation, self.attention._nncanon.kernel)
        if reason is None:
            reason = self.attention._nncanon.reason(RECOMPUTED)
        return reason


class KernelReason:
    """The reason the kernel's inputs are not served under the attention implementation the model runs now
    (``None`` under one whose forward makes the kernel call: Falcon calls sdpa directly under sdpa only)."""

    def __init__(self, attention: Envoy, kernel: Kernel, label: str) -> None:
        self.attention, self.kernel, self.label = attention, kernel, label

    def __call__(self) -> str | None:
        implementation = kernel_implementation(self.attention._module) or kernel_implementation(
            self.attention.root._module)
        reason = kernel_reason(self.kernel, implementation)
        return None if reason is None else f"{self.label}: {reason}"


def _child(layer: Envoy, path: str) -> Envoy:
    """The envoy at ``path`` under ``layer``, by the module's own entry names (routing may hide attributes)."""
    first, _, rest = path.partition(".")
    envoy = layer._child_map.get(first)
    if envoy is None:
        raise AttributeError(f"{layer.path} has no submodule {first!r}")
    return envoy.get(rest) if rest else envoy


def _binder(layer: Envoy, where: str, config: Any) -> Callable[..., Binding]:
    def bind(name: str, site: Site, heads: int | None = None, component: str = "", lazy: bool = False) -> Binding:
        module = _child(layer, site.module) if site.module else layer  # fail at load if the path is wrong
        path = f"{layer.path}.{site.module}" if site.module else layer.path
        prepare = None
        weighted = None
        if site.op is not None and (site.op.endswith("*") or lazy):
            # Found in the forward's operations at the first read (nnsight parses a forward in 6-130 ms:
            # too slow for every attention module at load). Only for operations no earlier value of the
            # module is read inside (the attention kernel's call: nothing inside attention precedes it).
            binding = Binding(name, "", site, config, f"{where}.{component}" if component else where, heads)

            def prepare(module: Envoy = module, binding: Binding = binding, path: str = path) -> None:
                if not binding.location:
                    op = operation_name(module.source.names, site.op)
                    if op is None:
                        raise ValueNotAvailable(
                            f"{binding.where}.{name} is not available: {type(module._module).__name__}.forward "
                            f"calls no operation named {site.op!r}"
                        )
                    binding.location = f"{path}.source.{op}.{site.key}"
                module.source  # noqa: B018 - installs nnsight's operation hooks (idempotent)

            binding.prepare = prepare
            return binding
        if site.op is not None:
            if site.weighted is not None:
                weighted = tuple(f"{path}.source.{op}.output" for op in site.weighted)
            path = f"{path}.source.{site.op}"

            def prepare(module: Envoy = module) -> None:
                module.source  # noqa: B018 - installs nnsight's operation hooks (idempotent)

            # Now, not at the first read: a forward already running when they are installed
            # (the router's MoE block, mid-trace) would never reach them.
            prepare()

        label = f"{where}.{component}" if component else where
        return Binding(name, f"{path}.{site.key}", site, config, label, heads, prepare, weighted=weighted)

    return bind


def _kernel_inputs(attention: Envoy, path: str, bind: Callable[..., Binding], label: str,
                   declared: Kernel | str | None) -> tuple[Kernel | str, dict, dict]:
    """The attention's kernel call (or why it has none), the bindings of its per-head inputs, and the reason
    each is not served (now, or under the implementations whose forward does not make the call)."""
    key = (type(attention._module), path, declared)
    known = _KERNEL_SITES.get(key)
    if known is None:  # once per attention class, path and kernel: the same for every block of a layout
        kernel = kernel_for(type(attention._module), declared)
        known = _KERNEL_SITES[key] = kernel if isinstance(kernel, str) else (kernel, {
            name: Site(path, key="input", op=kernel.output_op if name == "value_states" else kernel.op, arg=arg,
                       heads_first=True, transposed=kernel.key_transposed and name == "key_states",
                       flat=kernel.batch_heads)
            for name, arg in zip(STATES, kernel.args, strict=True)})
    if isinstance(known, str):
        return known, {}, dict.fromkeys(STATES, f"{label}: {known}")
    kernel, sites = known
    bindings = {name: bind(name, site, component="self_attn", lazy=True) for name, site in sites.items()}
    reasons = {} if kernel.implementations is None else dict.fromkeys(STATES, KernelReason(attention, kernel, label))
    return kernel, bindings, reasons


#: ``(attention class, path, the family's kernel)``: its kernel and the sites of its inputs, or why it has
#: none (a plain dict: remote requests carry it by value).
_KERNEL_SITES: dict[tuple[type, str, Any], Any] = {}


def _route(layer: Envoy, standard: str, native: str | None, target: Any, hidden: set) -> None:
    """Make ``layer.<standard>`` the component, and hide a native attribute that names another role."""
    if native is not None and native != standard:
        object.__setattr__(layer, standard, target)
        layer._aliases[standard] = native
    elif native is None and standard in hidden:
        layer.__dict__.pop(standard, None)


def _label(index: int, kind: str | None, layer: Envoy) -> str:
    block = type(layer._module).__name__
    return f"layers[{index}] is a {kind} block ({block})" if kind else f"layers[{index}] ({block})"


_ROUTING = ("router_logits", "expert_weights", "expert_indices")


def _block_sites(tupled: bool, stacked: bool, merged: bool) -> tuple[Site, Site]:
    """The sites every block has: its input, and its output (a tensor, or a tuple's first element).

    Made once (a `Site` is frozen): kept in a plain dict, which a remote request can carry by value."""
    sites = _BLOCK_SITES.get((tupled, stacked, merged))
    if sites is None:
        sites = _BLOCK_SITES[(tupled, stacked, merged)] = (
            Site(key="input", stacked=stacked, merge=merged),
            Site(index=0 if tupled else None, stacked=stacked, merge=merged))
    return sites


_BLOCK_SITES: dict[tuple[bool, bool, bool], tuple[Site, Site]] = {}


class _Shape:
    """What a block layout (a family record, or one of its `Family.layouts`) mounts the same on every
    block of a model: worked out once per layout in `mount`, not once per block."""

    def __init__(self, spec: Family, config: Any) -> None:
        self.spec = spec
        # Native names this block uses for a role other than the standard name's own.
        self.hidden = {n for n in (spec.attention, spec.mixer, spec.mlp) if n is not None}
        self.layer_input, self.layer_output = _block_sites(bool(spec.block_extras or spec.block_tuple),
                                                           spec.stacked_streams, spec.merged_streams)
        self.probabilities = spec.probabilities(config) if callable(spec.probabilities) else spec.probabilities
        self.kernel = spec.kernel(config) if callable(spec.kernel) else spec.kernel
        present = {"self_attn": spec.attention, "linear_attn": spec.mixer, "mlp": spec.mlp_output}
        self.components = [c for c in spec.component_order if present.get(c) is not None]
        self.mlp_sites = [(name, getattr(spec, name)) for name in (*_ROUTING, "shared_expert_output")]


def mount(model: Any, family: Family, config: Any) -> None:
    """Bind every block of ``model`` (a `StandardizedTransformer`) to ``family``'s sites.

    ``config`` is the text config (heads and scale factors are read from it).
    """
    # SSMs (Mamba) have none; a family with ``head_shape`` reads each block's own (a per-layer config may
    # refuse the global attribute)
    heads = None if family.head_shape is not None else getattr(config, "num_attention_heads", None)
    adopt(model.layers, LayersEnvoy)
    blocks = list(model.layers)
    count, model_type = len(blocks), config.model_type
    idle_reasons = [family.idle_reason(config, i) for i in range(count)]
    running = [i for i, idle in enumerate(idle_reasons) if idle is None]
    shapes: dict[int, _Shape] = {}
    for index, layer in enumerate(blocks):
        adopt(layer, LayerEnvoy)
        idle = idle_reasons[index]
        if idle is not None:
            _mount_idle(model, family, config, index, idle, running)
            continue
        spec, kind = family.for_layer(config, index)
        shape = shapes.get(id(spec))
        if shape is None or shape.spec is not spec:
            shape = shapes[id(spec)] = _Shape(spec, config)
        where = f"layers[{index}]"
        label = _label(index, kind, layer)
        bind = _binder(layer, where, config)
        hidden = shape.hidden

        state = ComponentState(
            where,
            {
                "layer_input": bind("layer_input", shape.layer_input),
                "layer_output": bind("layer_output", shape.layer_output),
            },
        )
        layer._nncanon = state
        components: list[ComponentState] = [state]

        if spec.attention is not None:
            attention = _child(layer, spec.attention)
            adopt(attention, AttentionEnvoy)
            _route(layer, "self_attn", spec.attention, attention, hidden)
            kernel, bindings, reasons = _kernel_inputs(attention, spec.attention, bind, label, shape.kernel)
            attention._nncanon = ComponentState(
                f"{where}.self_attn",
                {
                    **bindings,
                    "attention_head_outputs": bind(
                        "attention_head_outputs",
                        spec.head_outputs,
                        spec.head_shape(config, index)[0] if spec.head_shape else heads,
                        "self_attn",
                    ),
                    "attention_output": bind("attention_output", spec.attention_output, component="self_attn"),
                },
                {**reasons, "attention_probabilities": ProbabilitiesReason(attention), RECOMPUTED: None},
                probabilities=shape.probabilities,
                kernel=kernel,
            )
            components.append(attention._nncanon)
        else:
            _route(layer, "self_attn", None, None, hidden)
            mixer_note = f"; its token mixer is layers[{index}].linear_attn" if spec.mixer else ""
            state.reasons["self_attn"] = f"{label}: it has no softmax attention{mixer_note}"

        if spec.mixer is not None:
            mixer = _child(layer, spec.mixer)
            adopt(mixer, LinearAttentionEnvoy)
            _route(layer, "linear_attn", spec.mixer, mixer, hidden)
            output = bind("linear_attention_output", spec.mixer_output, component="linear_attn")
            bindings = {"linear_attention_output": output}
            reasons = {}
            if spec.mixer_head_outputs is not None:
                bindings["linear_attention_head_outputs"] = bind(
                    "linear_attention_head_outputs",
                    spec.mixer_head_outputs,
                    getattr(config, spec.mixer_heads),
                    "linear_attn",
                )
            else:
                reasons["linear_attention_head_outputs"] = (
                    f"{label}: its mixer ({type(mixer._module).__name__}) has no per-head structure "
                    f"before its output projection"
                )
            mixer._nncanon = ComponentState(f"{where}.linear_attn", bindings, reasons, set(reasons))
            components.append(mixer._nncanon)
        else:
            note = f"; its token mixer is softmax attention: layers[{index}].self_attn" if spec.attention else ""
            state.reasons["linear_attn"] = f"{label}: it has no linear-attention or state-space mixer{note}"

        if spec.mlp_output is not None:
            mlp_binding = bind("mlp_output", spec.mlp_output, component="mlp")
            mlp_state = ComponentState(f"{where}.mlp", {"mlp_output": mlp_binding})
            for name, site in shape.mlp_sites:
                if site is not None:
                    mlp_state.bindings[name] = bind(name, site, component="mlp")
                elif name in _ROUTING:
                    mlp_state.reasons[name] = f"{label}: its MLP is dense, not a mixture of experts: it has no router"
                    mlp_state.absent.add(name)
                else:
                    mlp_state.reasons[name] = f"{label}: its MLP has no shared expert"
                    mlp_state.absent.add(name)
            if spec.mlp is None:
                object.__setattr__(layer, "mlp", VirtualMLP(mlp_state))
            else:
                mlp = _child(layer, spec.mlp)
                adopt(mlp, MLPEnvoy)
                _route(layer, "mlp", spec.mlp, mlp, hidden)
                mlp._nncanon = mlp_state
            components.append(mlp_state)
        else:
            _route(layer, "mlp", None, None, hidden)
            state.reasons["mlp"] = f"{label}: it has no MLP"

        order = block_order(shape.components, index, count, model_type)
        for component in components:
            for binding in component.bindings.values():
                binding.order = order

        for name, reason in spec.declined(config, index).items():
            decline(layer, name, reason)


def _mount_idle(model: Any, family: Family, config: Any, index: int, reason: str, running: list[int]) -> None:
    """Mount block ``index``, which the model does not run (`Family.idle`): its ``layer_input`` and
    ``layer_output`` are the stream passing it, read where it enters the next block that runs (else where
    it leaves the previous one); its components are not served, with ``reason``."""
    layer = model.layers[index]
    where, label = f"layers[{index}]", _label(index, None, layer)
    after, before = [j for j in running if j > index], [j for j in running if j < index]
    if after:
        block, site, read_at = after[0], Site(key="input"), f"where it enters layers[{after[0]}]"
    elif before:
        block, read_at = before[-1], f"where it leaves layers[{before[-1]}]"
        spec = family.for_layer(config, block)[0]
        site = Site(index=0 if spec.block_extras or spec.block_tuple else None)
    else:
        raise ValueError(f"{family.name}: no block of this model runs ({reason})")
    bind = _binder(model.layers[block], where, config)
    bindings = {name: bind(name, site) for name in ("layer_input", "layer_output")}
    for binding in bindings.values():
        binding.block = block
    state = ComponentState(where, bindings)
    for name in ("self_attn", "linear_attn", "mlp"):
        state.reasons[name] = (
            f"{label} does not run: {reason}; its layer_input and layer_output are that stream, read {read_at}"
        )
        layer.__dict__.pop(name, None)
    layer._nncanon = state


def component_states(layer: Envoy) -> list[ComponentState]:
    """The mounted states of block ``layer``: the block's own, then its components' (where it has them)."""
    states = [layer.__dict__["_nncanon"]]
    for name in ("self_attn", "linear_attn", "mlp"):
        host = layer.__dict__.get(name)
        state = getattr(host, "__dict__", {}).get("_nncanon") if host is not None else None
        if state is not None:
            states.append(state)
    return states


def decline(layer: Envoy, name: str, reason: str) -> None:
    """Stop serving ``name`` on the mounted block ``layer``; ``support()`` and a read then give ``reason``.

    ``name`` is a standard value or a component (``"self_attn"``: the block does not serve it at all).
    """
    states = component_states(layer)
    if name in ("self_attn", "linear_attn", "mlp"):
        states[0].reasons[name] = reason
    for state in states:
        if name in state.bindings or name in state.reasons:
            state.reasons[name] = reason
            state.absent.discard(name)


def decline_gradient(layer: Envoy, name: str, reason: str) -> None:
    """Stop serving ``name``'s gradient on the mounted block ``layer``: the value is still served, and
    ``support()`` and ``value.grad`` give ``reason`` (`nncanon.errors.GradientNotAvailable`)."""
    for state in component_states(layer):
        if name in state.bindings or name in state.reasons:
            state.gradient_reasons[name] = reason
