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
from dataclasses import replace
from typing import Any

import torch
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
from .components.anatomy import NEURON_VALUES, discover, neuron_sites
from .components.attention import SCORES_GRADIENT_REASON
from .components.inside import QK_ROLES, inside_sites, norm_heads_first, with_inside
from .components.kernel import (
    RECOMPUTED,
    STATES,
    Kernel,
    kernel_for,
    kernel_reason,
    recompute_reason,
)
from .components.kernel import implementation as kernel_implementation
from .components.norms import ROLES, NormBinding, NormSite, is_reason, norm_anatomy, norm_roles
from .errors import ValueNotAvailable
from .families import Family, MLPAnatomy
from .order import block_order
from .served import Binding, Site, operation_name
from .support import COMPONENT_OF, NO_MLP
from .threads import ProcessCache


def adopt(envoy: Envoy, role: type) -> None:
    """Give ``envoy`` the standard ``role`` class (kept together with a custom class the user chose)."""
    current = type(envoy)
    if issubclass(current, role):
        return
    if current is not Envoy:
        role = _combined(role, current)
        envoy.__class__ = role  # through the custom class's own __setattr__, if it has one
    else:
        object.__setattr__(envoy, "__class__", role)  # what Envoy.__setattr__ does with a class, one call less


_COMBINED: dict[tuple[type, type], type] = ProcessCache()


def _combined(role: type, custom: type) -> type:
    key = (role, custom)
    if key not in _COMBINED:
        _COMBINED[key] = type(f"{role.__name__}With{custom.__name__}", (role, custom), {})
    return _COMBINED[key]


class ProbabilitiesReason:
    """The reason ``attention_probabilities`` (or, ``name``, ``attention_scores``) is not served, or ``None``:
    under eager attention they are
    read where they multiply the values; under another implementation, recomputed from the attention
    interface's inputs (`nncanon.components.kernel`) where that is exact for the module and proved.

    Read from the model's config at each call (nnsight can switch the implementation of a loaded
    model), through the envoy tree, so it travels with a remote request.
    """

    def __init__(self, attention: Envoy, name: str = "attention_probabilities") -> None:
        self.attention, self.name = attention, name

    def __call__(self) -> str | None:
        if self.attention._eager():
            return None
        implementation = kernel_implementation(self.attention._module) or kernel_implementation(
            self.attention.root._module)
        reason = recompute_reason(type(self.attention._module), implementation, self.attention._nncanon.kernel)
        if reason is None:
            reason = self.attention._nncanon.reason(RECOMPUTED)
        if reason is not None and self.name == "attention_scores":  # recomputed as the probabilities are
            reason = reason.replace("attention probabilities are", "attention scores are", 1).replace(
                "to read them", "to read the scores")
        return reason


class ScoresGradientReason:
    """Why ``attention_scores.grad`` is not served (``None`` under eager, where the scores are the model's own):
    under another implementation the scores are recomputed beside the kernel, which computes none to differentiate."""

    def __init__(self, attention: Envoy) -> None:
        self.attention = attention

    def __call__(self) -> str | None:
        if self.attention._eager():
            return None
        implementation = kernel_implementation(self.attention._module) or kernel_implementation(
            self.attention.root._module)
        return SCORES_GRADIENT_REASON.format(implementation=implementation)


class KernelReason:
    """The reason the kernel's inputs are not served under the attention implementation the model runs now
    (``None`` under one whose forward makes the kernel call: Falcon, before transformers 5.25, calls sdpa
    directly under sdpa only)."""

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


def _bind(layer: Envoy, config: Any, label: str, order: str, name: str, site: Site,
          heads: int | None = None, lazy: bool = False, inside: str | None = None) -> Binding:
    """``name`` bound to ``site`` of block ``layer``; ``label`` names it in messages (``"layers[3].self_attn"``).
    A ``lazy`` operation site is found in the forward's operations at its first read, like a pattern. ``inside``:
    the module (a path under the block) whose forward calls the site's module, whose operation hooks are installed
    before a read (a read pauses the model inside that forward, where hooks installed later would not fire: a
    query norm's input, then the kernel's inputs, in one trace)."""
    if site.op is None:
        if not site.module:
            return Binding(name, f"{layer.path}.{site.key}", site, config, label, heads, None, order)
        _child(layer, site.module)  # fail at load if the path is wrong
        prepare = None
        if inside is not None:
            outer = _child(layer, inside)

            def prepare(outer: Envoy = outer) -> None:
                outer.source  # noqa: B018 - installs nnsight's operation hooks (idempotent)

        return Binding(name, f"{layer.path}.{site.module}.{site.key}", site, config, label, heads, prepare, order)
    module = _child(layer, site.module) if site.module else layer
    path = f"{layer.path}.{site.module}" if site.module else layer.path
    if site.op.endswith("*") or lazy:
        # Found in the forward's operations at the first read (nnsight parses a forward in 6-130 ms:
        # too slow for every attention module at load). Only for operations no earlier value of the
        # module is read inside (the attention kernel's call: nothing inside attention precedes it).
        binding = Binding(name, "", site, config, label, heads, None, order)

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
    weighted = None
    if site.weighted is not None:
        weighted = tuple(f"{path}.source.{op}.output" for op in site.weighted)
    path = f"{path}.source.{site.op}"

    def prepare(module: Envoy = module) -> None:
        module.source  # noqa: B018 - installs nnsight's operation hooks (idempotent)

    # Now, not at the first read: a forward already running when they are installed
    # (the router's MoE block, mid-trace) would never reach them.
    prepare()
    return Binding(name, f"{path}.{site.key}", site, config, label, heads, prepare, order, weighted=weighted)


def _kernel_sites(attention: Envoy, path: str, declared: Kernel | str | None) -> tuple[Kernel, dict[str, Site]] | str:
    """The attention's kernel call and the sites of its per-head inputs on ``attention`` (at ``path``), or
    why it has none."""
    key = (type(attention._module), path, declared)
    known = _KERNEL_SITES.get(key)
    if known is None:  # once per attention class, path and kernel: the same for every block of a layout
        kernel = kernel_for(type(attention._module), declared)
        known = _KERNEL_SITES[key] = kernel if isinstance(kernel, str) else (kernel, {
            name: Site(path, key="input", op=kernel.output_op if name == "value_states" else kernel.op, arg=arg,
                       heads_first=True, transposed=kernel.key_transposed and name == "key_states",
                       flat=kernel.batch_heads, private=name != "query_states")
            for name, arg in zip(STATES, kernel.args, strict=True)})
    return known


def _made(layer: Envoy, config: Any, where: str, order: str, sites: tuple) -> dict[str, Binding]:
    """The bindings of one component of block ``layer``: ``sites`` are ``(name, site, heads)``, or
    ``(name, site, heads, True)`` for a site found in the forward's operations at its first read, or
    ``(name, site, heads, False, inside)`` for a site inside the forward of module ``inside`` (`_bind`)."""
    return {entry[0]: _bind(layer, config, where, order, *entry) for entry in sites}


#: ``(attention class, path, the family's kernel)``: its kernel and the sites of its inputs, or why it has
#: none (a plain dict: remote requests carry it by value).
_KERNEL_SITES: dict[tuple[type, str, Any], Any] = ProcessCache()


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


def _other_block(blocks: list, index: int, family: Family, config: Any, spec: Family) -> Any:
    """Another block of the same layout as block ``index`` (its module), ``None`` where there is none."""
    for other in range(len(blocks)):
        if other != index and family.for_layer(config, other)[0] is spec:
            return blocks[other]._module
    return None


def _stream_width(config: Any) -> int:
    """The width of the stream a block's MLP reads and writes (``hidden_size``, GPT-2's ``n_embd``)."""
    for attribute in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, attribute, None)
        if isinstance(value, int):
            return value
    raise AttributeError(f"{type(config).__name__} names no hidden size")


def _block_sites(tupled: bool, stacked: bool, merged: bool) -> tuple[Site, Site]:
    """The sites every block has: its input, and its output (a tensor, or a tuple's first element).

    Made once (a `Site` is frozen): kept in a plain dict, which a remote request can carry by value."""
    sites = _BLOCK_SITES.get((tupled, stacked, merged))
    if sites is None:
        sites = _BLOCK_SITES[(tupled, stacked, merged)] = (
            Site(key="input", stacked=stacked, merge=merged),
            Site(index=0 if tupled else None, stacked=stacked, merge=merged))
    return sites


_BLOCK_SITES: dict[tuple[bool, bool, bool], tuple[Site, Site]] = ProcessCache()


class _Shape:
    """What a block layout (a family record, or one of its `Family.layouts`) mounts the same on every
    block of a model: worked out once per layout in `mount`, not once per block."""

    def __init__(self, spec: Family, config: Any, heads: int | None) -> None:
        self.spec = spec
        # Native names this block uses for a role other than the standard name's own.
        self.hidden = {n for n in (spec.attention, spec.mixer, spec.mlp) if n is not None}
        layer_input, layer_output = _block_sites(bool(spec.block_extras or spec.block_tuple),
                                                 spec.stacked_streams, spec.merged_streams)
        self.layer = (("layer_input", layer_input, None), ("layer_output", layer_output, None))
        self.probabilities = spec.probabilities(config) if callable(spec.probabilities) else spec.probabilities
        self.kernel = spec.kernel(config) if callable(spec.kernel) else spec.kernel
        present = {"self_attn": spec.attention, "linear_attn": spec.mixer, "mlp": spec.mlp_output}
        self.components = [c for c in spec.component_order if present.get(c) is not None]
        # The mixers' inputs are handed to the mixer as a copy at the first read (`Site.private`): on a parallel
        # block the MLP reads the same normed tensor, which a write to attention's input must leave as it is.
        self.attention_input = (("attention_input", Site(spec.attention, key="input", private=True), None)
                                if spec.attention else None)
        self.attention = (self.attention_input, ("attention_head_outputs", spec.head_outputs, heads),
                          ("attention_output", spec.attention_output, None))
        self.with_kernel: dict[int, tuple] = {}  # the attention's sites after its kernel inputs, by their sites' id
        self.mixer = (("linear_attention_output", spec.mixer_output, None),
                      ("linear_attention_input", Site(spec.mixer, key="input", private=True), None) if spec.mixer
                      else None)
        if spec.mixer is not None and spec.mixer_head_outputs is not None:
            heads_of_mixer = getattr(config, spec.mixer_heads)
            self.mixer += (("linear_attention_head_outputs", spec.mixer_head_outputs, heads_of_mixer),)
        sites = [(name, getattr(spec, name)) for name in (*_ROUTING, "shared_expert_output")]
        self.mlp = (("mlp_output", spec.mlp_output, None),
                    *((name, site, None) for name, site in sites if site is not None))
        # What an MLP of this layout does not have, with the reason after the block's label.
        self.mlp_absent = {name: ": its MLP is dense, not a mixture of experts: it has no router" if name in _ROUTING
                           else ": its MLP has no shared expert" for name, site in sites if site is None}
        self.moe = spec.router_logits is not None or spec.expert_indices is not None
        self.neurons: tuple | None = None  # the neuron sites, or the reason there are none: at the first block
        self.neuron_reasons: dict[str, str] = {}
        self.neuron_absent: set[str] = set()
        self.anatomy: MLPAnatomy | None = None
        bound = [*self.layer, *(self.attention if spec.attention else ()), *(self.mixer if spec.mixer else ()),
                 *(self.mlp if spec.mlp_output else ())]
        # Bindings are made at their first use (`ComponentState.deferred`), unless one installs operation
        # hooks, which must be in place before a forward (kernel inputs are found at their first read).
        self.deferred = not any(site.op is not None and not site.op.endswith("*") for _, site, _ in bound)
        # The module paths the sites name, checked on every block at load (a wrong path fails there), but
        # the components' own, which `mount` reaches anyway.
        components = {spec.attention, spec.mixer, spec.mlp}
        self.paths = list(dict.fromkeys(site.module for _, site, _ in bound
                                        if site.module and site.module not in components))
        # The values no block of this layout serves, whatever is declined later: `apply_proof` passes them.
        missing = {component for component, name in present.items() if name is None}
        self.unserved = frozenset({*missing, *(v for v, c in COMPONENT_OF.items() if c in missing), *self.mlp_absent,
                                   *(["linear_attention_head_outputs"] if len(self.mixer) == 2 and spec.mixer else [])})

    def neuron_sites(self, layer: Envoy, config: Any, other: Callable[[], torch.nn.Module | None]) -> tuple:
        """The MLP's neuron sites (`nncanon.components.anatomy`) on blocks of this layout, found on the first one;
        what it does not serve is in ``neuron_reasons`` (declined: the MLP has them) and ``neuron_absent`` (it has
        no such value: the linear path of an MLP without a gate). ``other()`` is another block of this layout (to
        tell a module every block shares)."""
        if self.neurons is not None:
            return self.neurons
        spec = self.spec
        anatomy = spec.mlp_anatomy
        if self.moe:
            anatomy = ("its MLP is a mixture of experts: each token's neurons are those of the experts it is "
                       "routed to, computed inside the experts' fused module on the tokens routed to each, so "
                       "no one [b, s, d_mlp] tensor holds them")
        elif isinstance(anatomy, str) and anatomy == "auto":
            mlp = layer._module if spec.mlp is None else layer._module.get_submodule(spec.mlp)
            anatomy = discover(mlp, spec.mlp or "", _stream_width(config))
            if isinstance(anatomy, MLPAnatomy) and spec.mlp is None and spec.mlp_output is not None:
                anatomy = replace(anatomy, flat=spec.mlp_output.flat)
        if isinstance(anatomy, str):
            self.neuron_reasons = dict.fromkeys(NEURON_VALUES, anatomy)
            if self.moe:  # absent, not declined: a mixture of experts has no one tensor of neurons to decline
                self.neuron_absent = set(NEURON_VALUES)
            self.neurons = ()
        else:
            found = neuron_sites(anatomy, layer._module, other())
            self.neuron_absent = {name for name in NEURON_VALUES if name not in found}
            self.neuron_reasons = dict.fromkeys(
                self.neuron_absent, "its MLP has no linear path (it is not gated): activation(pre) is its neurons")
            self.anatomy = anatomy
            self.neurons = tuple((name, site, None) for name, site in found.items())
            for name in self.neurons:
                _child(layer, name[1].module)  # fail at load if a family's path is wrong
        self.unserved = self.unserved | frozenset(self.neuron_reasons)
        return self.neurons

    def state(self, layer: Envoy, config: Any, where: str, order: str, sites: tuple, reasons: dict,
              absent: set[str] | None = None, probabilities: tuple[str, ...] | None = None,
              kernel: Any = None, anatomy: Any = None) -> ComponentState:
        """The state of one component of block ``layer``, its bindings made now or at their first use."""
        absent = set() if absent is None else absent
        if self.deferred:
            return ComponentState.deferred(where, (_made, (layer, config, where, order, sites)), reasons, absent,
                                           probabilities, kernel, anatomy)
        return ComponentState(where, _made(layer, config, where, order, sites), reasons, absent, probabilities,
                              kernel=kernel, anatomy=anatomy)


def mount(model: Any, family: Family, config: Any) -> list[frozenset[str] | None]:
    """Bind every block of ``model`` (a `StandardizedTransformer`) to ``family``'s sites.

    ``config`` is the text config (heads and scale factors are read from it). Returns, per block, the values
    its layout does not serve at all (``None`` for a block the model does not run): what a proof need not
    decline there.
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
    unserved: list[frozenset[str] | None] = []
    for index, layer in enumerate(blocks):
        adopt(layer, LayerEnvoy)
        idle = idle_reasons[index]
        if idle is not None:
            _mount_idle(model, family, config, index, idle, running)
            unserved.append(None)
            continue
        spec, kind = family.for_layer(config, index)
        shape = shapes.get(id(spec))
        if shape is None or shape.spec is not spec:
            shape = shapes[id(spec)] = _Shape(spec, config, heads)
        where = f"layers[{index}]"
        label = _label(index, kind, layer)
        order = block_order(shape.components, index, count, model_type)
        hidden = shape.hidden
        if shape.deferred:
            for path in shape.paths:
                _child(layer, path)  # fail at load if the path is wrong

        state = layer._nncanon = shape.state(layer, config, where, order, shape.layer, {})

        if spec.attention is not None:
            attention = _child(layer, spec.attention)
            adopt(attention, AttentionEnvoy)
            _route(layer, "self_attn", spec.attention, attention, hidden)
            sites = shape.attention
            if spec.head_shape is not None:
                sites = (sites[0], ("attention_head_outputs", spec.head_outputs, spec.head_shape(config, index)[0]),
                         sites[2])
            known = _kernel_sites(attention, spec.attention, shape.kernel)
            if isinstance(known, str):
                kernel = known
                reasons = dict.fromkeys(STATES, f"{label}: {known}")
            else:
                kernel, inputs = known
                reasons = ({} if kernel.implementations is None
                           else dict.fromkeys(STATES, KernelReason(attention, kernel, label)))
                if sites is shape.attention:
                    cached = shape.with_kernel.get(id(inputs))
                    if cached is None or cached[0] is not inputs:
                        cached = shape.with_kernel[id(inputs)] = (inputs, (
                            *((name, site, None, True) for name, site in inputs.items()), *sites))
                    sites = cached[1]
                else:
                    sites = (*((name, site, None, True) for name, site in inputs.items()), *sites)
            inner, absent = inside_sites(attention._module, spec.attention)
            sites = with_inside(sites, inner, spec.attention)
            reasons.update({name: f"{label}: {reason}" for name, reason in absent.items()})
            reasons["attention_probabilities"] = ProbabilitiesReason(attention)
            reasons["attention_scores"] = ProbabilitiesReason(attention, "attention_scores")
            reasons[RECOMPUTED] = None
            attention._nncanon = shape.state(layer, config, f"{where}.self_attn", order, sites, reasons, set(absent),
                                             probabilities=shape.probabilities, kernel=kernel)
            attention._nncanon.gradient_reasons["attention_scores"] = ScoresGradientReason(attention)
        else:
            _route(layer, "self_attn", None, None, hidden)
            mixer_note = f"; its token mixer is layers[{index}].linear_attn" if spec.mixer else ""
            state.reasons["self_attn"] = f"{label}: it has no softmax attention{mixer_note}"

        if spec.mixer is not None:
            mixer = _child(layer, spec.mixer)
            adopt(mixer, LinearAttentionEnvoy)
            _route(layer, "linear_attn", spec.mixer, mixer, hidden)
            reasons = {}
            if spec.mixer_head_outputs is None:
                reasons["linear_attention_head_outputs"] = (
                    f"{label}: its mixer ({type(mixer._module).__name__}) has no per-head structure "
                    f"before its output projection"
                )
            mixer._nncanon = shape.state(layer, config, f"{where}.linear_attn", order, shape.mixer, reasons,
                                         set(reasons))
        else:
            note = f"; its token mixer is softmax attention: layers[{index}].self_attn" if spec.attention else ""
            state.reasons["linear_attn"] = f"{label}: it has no linear-attention or state-space mixer{note}"

        if spec.mlp_output is not None:
            neuron_sites = shape.neuron_sites(
                layer, config, lambda index=index, spec=spec: _other_block(blocks, index, family, config, spec))
            mlp_state = shape.state(layer, config, f"{where}.mlp", order, (*shape.mlp, *neuron_sites),
                                    {**{name: label + reason for name, reason in shape.mlp_absent.items()},
                                     **{name: f"{label}: {reason}" for name, reason in shape.neuron_reasons.items()}},
                                    {*shape.mlp_absent, *shape.neuron_absent}, anatomy=shape.anatomy)
            if spec.mlp is None:
                object.__setattr__(layer, "mlp", VirtualMLP(mlp_state))
            else:
                mlp = _child(layer, spec.mlp)
                adopt(mlp, MLPEnvoy)
                _route(layer, "mlp", spec.mlp, mlp, hidden)
                mlp._nncanon = mlp_state
        else:
            _route(layer, "mlp", None, None, hidden)
            state.reasons["mlp"] = f"{label}: {NO_MLP}"

        _mount_norms(layer, spec, where, label, order)
        declined = spec.declined(config, index)
        if "attention_probabilities" in declined:  # the scores are the probabilities' softmax input: declined alike
            declined = {"attention_scores": declined["attention_probabilities"], **declined}
        for name, reason in declined.items():
            decline(layer, name, reason)
        unserved.append(shape.unserved)
    return unserved


_NORM_ROLES: dict[tuple, dict[str, str]] = ProcessCache()

def _mount_norms(layer: Envoy, spec: Family, where: str, label: str, order: str) -> None:
    """Bind block ``layer``'s norm values (`nncanon.components.norms`) on the components serving them; a norm the
    block has not is absent there (with the reason), one it has but cannot serve is declined (with the reason)."""
    block = layer._module
    attention = block.get_submodule(spec.attention) if spec.attention else None
    key = (type(block), id(spec), *(tuple((name, type(child)) for name, child in module.named_children())
                                     for module in (block, attention) if module is not None))
    roles = _NORM_ROLES.get(key)
    if roles is None:
        roles = _NORM_ROLES[key] = norm_roles(block, spec)
    states = {name: getattr(layer.__dict__.get(name), "__dict__", {}).get("_nncanon")
              for name in ("self_attn", "linear_attn", "mlp")}
    if states["mlp"] is None and isinstance(layer.__dict__.get("mlp"), VirtualMLP):
        states["mlp"] = layer.__dict__["mlp"]._nncanon
    for role, found in roles.items():
        component, scale, normalized = ROLES[role]
        state = states[component]
        if state is None:
            continue
        names = [name for name in (scale, normalized) if name is not None]
        if is_reason(found):  # (a parallel block's MLP norm too: the one norm is served once, as the mixer's)
            for name in names:
                state.reasons[name] = f"{label}: {found}"
                state.absent.add(name)
            continue
        anatomy = norm_anatomy(block.get_submodule(found))
        if isinstance(anatomy, str):
            for name in names:
                state.reasons[name] = f"{label}: {anatomy}"
            continue
        heads_first = role in QK_ROLES and norm_heads_first(attention, spec.attention, role)
        site = NormSite(found, _child(layer, found), anatomy, state.where, order, scale, heads_first)
        state.norms.update({name: NormBinding(name, site, "scale" if name == scale else "normalized")
                            for name in names})


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
    sites = (("layer_input", site, None), ("layer_output", site, None))
    bindings = _made(model.layers[block], config, where, "", sites)
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
        if name in state.bindings or name in state.reasons or name in state.norms:
            state.reasons[name] = reason
            state.absent.discard(name)


def decline_gradient(layer: Envoy, name: str, reason: str) -> None:
    """Stop serving ``name``'s gradient on the mounted block ``layer``: the value is still served, and
    ``support()`` and ``value.grad`` give ``reason`` (`nncanon.errors.GradientNotAvailable`)."""
    for state in component_states(layer):
        if name in state.bindings or name in state.reasons or name in state.norms:
            state.gradient_reasons[name] = reason
