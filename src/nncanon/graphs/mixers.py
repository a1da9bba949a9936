"""A linear mixer's gates on the frozen replacement model: read on the clean run, written back on the frozen one.

`nncanon.components.mixer_gates` says which values of a mixer's forward are its data-dependent gates
(`nncanon.components.mixer_gates.Gate`). `read` saves them inside the clean run's trace; `freeze` writes them back,
detached and repeated over the frozen run's batch, inside the frozen run's trace, through nnsight's ``.source``
(an operation's output or arguments) and a child module's call arguments: the wrapper changes no module's forward.
The causal convolution's SiLU is frozen as its slope: the call's output ``silu(u)`` is written as
``u · sigmoid(u_clean)``, ``u`` the depthwise causal convolution of the call's live input with the convolution
module's own weights (as transformers' PyTorch path computes it), so the frozen forward's value is the clean run's
and the gradient flows through ``u`` only. Both are called at the mixer's place in the block's execution order.
A mixer's gates are spelt per transformers version (`nncanon.components.mixer_gates.GATES`): the first spelling whose
calls the loaded forward makes is used, and `check` declines the mixer where none is. The same functions read and
write the frozen values of another module of the block, named by ``owner``: ``"self_attn"``, an attention block's
(`nncanon.components.attention_gates`: inner norms' scales, clamps' bounds, attention experts' routing), at the
attention's step; a child norm's path (``"input_layernorm"``), a gated norm's (`nncanon.components.norm_gates`); a
hyper-connection's (``"attn_hc"``: `nncanon.components.stream_gates`), or with ``layer`` ``None`` a model-level module's
path (the final collapse of the streams, ``"model.hc_head"``).
A clamp (part ``"bounds"``) is frozen as its bounds: ``-inf``/``inf`` where the clean run's value is inside them,
its clipped value as both where the clean run clipped it (a tensor of bounds, broadcast over the batch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..components import attention_gates, norm_gates, stream_gates
from ..components.mixer_gates import Gate, spellings_of
from ..components.norms import formula, norm_anatomy, statistics
from ..errors import ValueNotAvailable

#: The activations whose slope is frozen (SiLU under its two names).
SILU = ("silu", "swish")
#: The owner of a block's linear mixer's gates, of its attention's frozen values, and of the block's own
#: (`nncanon.components.norm_gates.block_gates_of`).
MIXER, ATTENTION, BLOCK, BLOCK_ENTRY, BLOCK_MLP = "linear_attn", "self_attn", "<block>", "<block entry>", "<block mlp>"
#: The owners of a block's own values, per place in the block (`nncanon.components.norm_gates.BLOCK_GATES`): its
#: entry, before its attention's pattern, before its transcoder's input, before its linear mixer, after all else.
BLOCK_PLACES = {BLOCK_ENTRY: "first", "<block attention>": "attention", BLOCK_MLP: "mlp", "<block mixer>": "mixer",
                BLOCK: "last"}


def _mixer(model: Any, layer: int | None, owner: str = MIXER) -> Any:
    """Block ``layer``'s module whose frozen values are read: its linear mixer, its attention, or its child
    ``owner`` (a gated norm, a hyper-connection); with ``layer`` ``None``, the model's module at path ``owner``."""
    if layer is None:
        return model._optional(owner)
    block = model.layers[layer]
    return block if owner in BLOCK_PLACES else getattr(block, owner)


def _child(envoy: Any, path: str | None) -> Any:
    """``envoy``'s descendant at dotted ``path`` (``None``: ``envoy``; a missing one: ``None``)."""
    for part in path.split(".") if path else ():
        if part in getattr(envoy, "_aliases", {}):  # (a standard name routed to another module: its native child)
            native = f"{envoy.path}.{part}"
            envoy = next(iter(envoy.modules(include_fn=lambda child, native=native: child.path == native)), None)
        else:
            envoy = getattr(envoy, part, None)
        if envoy is None:
            return None
    return envoy


def _spellings(module: Any, owner: str) -> tuple[tuple[Gate, ...], ...]:
    """The spellings of the frozen values of ``module``, the block's ``owner``."""
    if owner == MIXER:
        return spellings_of(module)
    if owner == ATTENTION:
        return (attention_gates.gates_of(module),)
    if owner in BLOCK_PLACES:
        return (norm_gates.block_gates_of(module, BLOCK_PLACES[owner]),)
    return (norm_gates.gates_of(module) or stream_gates.gates_of(module),)


def _site(mixer: Any, gate: Gate) -> Any:
    """The nnsight handle of ``gate``'s call: a ``.source`` operation, or a child module's envoy."""
    owner = _child(mixer, gate.module)
    if gate.op is None:
        return owner
    *calls, op = gate.op.split(".")
    source = owner.source
    for call in calls:  # (drilled into inside the trace: a call's own operations)
        source = getattr(source, call).source
    return getattr(source, op)


def _runs(mixer: Any, gate: Gate, known: dict[tuple[str, str], bool]) -> bool:
    """Whether ``gate``'s call runs on this prompt (`Gate.runs_from`): read inside the trace from its module's first
    input, once per module (kept in ``known``: its input cannot be asked for again once the model ran past it)."""
    if gate.runs_from is None:
        return True
    if gate.runs_from not in known:
        path, attribute = gate.runs_from
        owner = _child(mixer, path)
        args, kwargs = owner.inputs
        first = args[0] if args else next(iter(kwargs.values()))
        known[gate.runs_from] = int(first.shape[1]) >= int(getattr(owner._module, attribute))
    return known[gate.runs_from]


def _pick(args: tuple, kwargs: dict, item: int | str) -> Any:
    return kwargs[item] if isinstance(item, str) else args[item]


def _convolved(args: tuple, kwargs: dict, where: tuple[int | str, ...] = ()) -> torch.Tensor:
    """The causal depthwise convolution of a convolution call's input, before its activation: ``[b, channels, n]``.
    The call is ``causal_conv1d_forward(conv1d, x, ...)`` (``where`` empty) or has its input ``x``, weight
    ``[channels, k]`` and bias at ``where`` among its arguments (``causal_conv1d_fn``)."""
    activation = kwargs.get("activation")
    if activation not in SILU:
        raise ValueNotAvailable(f"the mixer's convolution applies {activation!r}, not a SiLU whose slope is frozen")
    if where:
        x, weight, bias = (_pick(args, kwargs, item) for item in where)
        weight = weight.unsqueeze(1) if weight.dim() == 2 else weight
    else:
        conv, x = args[0], args[1]
        weight, bias = conv.weight, conv.bias
    n = x.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight, bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
    return out[..., :n]


def _missing(mixer: Any, gates: tuple[Gate, ...]) -> str | None:
    """The first call of ``gates`` that ``mixer``'s forward (or its child's) does not make, as ``Class[.child]'s
    forward makes no call 'op'``; ``None`` where it makes them all."""
    for gate in gates:
        owner = _child(mixer, gate.module)
        if owner is None or (gate.op is not None and gate.op.split(".")[0] not in owner.source.names):
            where = f"{type(mixer._module).__name__}" + (f".{gate.module}" if gate.module else "")
            return f"{where}'s forward makes no call {gate.op or gate.module!r}"
    return None


def _gates(model: Any, layer: int | None, owner: str = MIXER) -> tuple[Gate, ...]:
    """The gates of block ``layer``'s mixer (or ``owner``) in the first spelling whose calls its forward makes; raise
    `ValueNotAvailable` naming each spelling's first missing call where there is none (this transformers version
    spells its forward otherwise)."""
    mixer = _mixer(model, layer, owner)
    spellings = _spellings(mixer._module, owner)
    missing = [_missing(mixer, gates) for gates in spellings]
    for gates, lacks in zip(spellings, missing, strict=True):
        if lacks is None:
            return gates
    kind = {MIXER: "linear mixer", ATTENTION: "attention"}.get(owner, f"module {owner}")
    where = "the model" if layer is None else f"layers[{layer}]"
    raise ValueNotAvailable(f"{where}'s {kind}: {'; '.join(dict.fromkeys(missing))} in this "
                            "transformers version, so its gates cannot be frozen (nncanon.components.mixer_gates "
                            "spells transformers 5.21 to 5.25's calls)")


def check(model: Any, layer: int | None, owner: str = MIXER) -> None:
    """Raise `ValueNotAvailable` where block ``layer``'s mixer (or ``owner``) forward lacks a call of each spelling
    of its gates: checked before any trace, outside one."""
    _gates(model, layer, owner)


def read(model: Any, layer: int | None, owner: str = MIXER) -> dict[str, Any]:
    """The clean run's gates of block ``layer``'s mixer (or ``owner``), saved (inside the clean run's trace): per
    gate key, the tuple of its frozen values (``[1, ...]`` or the batch folded in the first dimension), for
    ``"slope"`` the clean ``sigmoid(u)``, for ``"bounds"`` the lower and upper bounds, for ``"scale"`` the norm's
    scale (``[1, ..., 1]``: the normalised axes 1), for ``"ratio"`` the activation's ``act(u) / u``."""
    mixer = _mixer(model, layer, owner)
    saved: dict[str, Any] = {}
    runs: dict[tuple[str, str], bool] = {}
    for gate in _gates(model, layer, owner):
        if not _runs(mixer, gate, runs):
            continue
        site = _site(mixer, gate)
        if gate.part == "bounds":
            values = list(_bounds(site))
        elif gate.part in MODULE_PARTS:
            values = [read_module(site, gate.part)]
        elif gate.part == "output":
            output = site.output
            values = [output[i] for i in gate.items] if gate.items else [output]
        elif gate.part == "inputs":
            args, kwargs = site.inputs
            values = [_pick(args, kwargs, item) for item in gate.items]
        else:
            args, kwargs = site.inputs
            values = [torch.sigmoid(_convolved(args, kwargs, gate.items))]
        saved[gate.key] = [value.save() for value in values]
    return saved


def detached(saved: dict[str, Any]) -> dict[str, tuple[torch.Tensor, ...]]:
    """`read`'s values after the trace, detached."""
    return {key: tuple(value.detach() for value in values) for key, values in saved.items()}


def _like(clean: torch.Tensor, live: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``clean`` (batch 1) repeated over ``live``'s batch (its dimension ``dim``, the batch or the batch folded in)."""
    other = [size for i, size in enumerate(clean.shape) if i != dim]
    if clean.dim() != live.dim() or other != [size for i, size in enumerate(live.shape) if i != dim] \
            or live.shape[dim] % clean.shape[dim]:
        raise ValueNotAvailable(f"a mixer gate of shape {tuple(live.shape)} on the frozen run does not match its clean "
                                f"value's {tuple(clean.shape)}")
    return clean.repeat(*[live.shape[dim] // clean.shape[dim] if i == dim else 1 for i in range(clean.dim())])


#: The parts frozen as a whole module's call: a norm by its scale, an activation by its slope through the origin.
MODULE_PARTS = ("scale", "ratio")


def read_module(site: Any, part: str) -> torch.Tensor:
    """On the clean run, the frozen value of module call ``site`` (an envoy): its norm's scale ``[1, ..., 1]``
    (``"scale"``) or its activation's ``act(u) / u`` (``"ratio"``)."""
    u = site.input  # (before the output: the order the call makes them)
    if part == "scale":
        return statistics(norm_anatomy(site._module), u)[1]
    return ratio(site.output, u)


def write_module(site: Any, part: str, value: torch.Tensor) -> None:
    """On the frozen run, write module call ``site``'s output as its live input's frozen form: the norm over the clean
    scale ``value`` times its weight, or the input times the clean slope ``value``."""
    x = site.input
    if part == "scale":
        site.output = formula(norm_anatomy(site._module), site._module, x, scale=value)
    else:
        site.output = (x.float() * _like(value, x)).to(x.dtype)


def ratio(y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``y / u`` in float32, 0 where ``u`` is 0: an activation's slope through the origin (``act(0) = 0``)."""
    u = u.float()
    return torch.where(u == 0, torch.zeros_like(u), y.float() / torch.where(u == 0, torch.ones_like(u), u))


def _limits(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """A clamp call's ``min`` and ``max`` (keywords, else its first two arguments; ``None``: no bound)."""
    low = kwargs["min"] if "min" in kwargs else args[0] if args else None
    high = kwargs["max"] if "max" in kwargs else args[1] if len(args) > 1 else None
    return low, high


def _bounds(site: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A clamp's frozen bounds on the clean run: ``-inf``/``inf`` where its output is strictly inside its bounds, its
    output where it clipped (``[1, ...]``)."""
    low, high = _limits(*site.inputs)
    clipped = site.output
    inside = torch.ones_like(clipped, dtype=torch.bool)
    if low is not None:
        inside = inside & (clipped > low)
    if high is not None:
        inside = inside & (clipped < high)
    infinity = torch.full_like(clipped, float("inf"))
    return torch.where(inside, -infinity, clipped), torch.where(inside, infinity, clipped)


def freeze(model: Any, layer: int | None, clean: dict[str, tuple[torch.Tensor, ...]], owner: str = MIXER) -> None:
    """Write block ``layer``'s mixer (or ``owner``) gates back with ``clean`` (`detached` of `read`), inside the
    frozen run's trace."""
    mixer = _mixer(model, layer, owner)
    runs: dict[tuple[str, str], bool] = {}
    for gate in _gates(model, layer, owner):
        if not _runs(mixer, gate, runs):
            continue
        site = _site(mixer, gate)
        values = clean[gate.key]
        if gate.part == "bounds":
            args, kwargs = site.inputs
            kwargs = {**kwargs, "min": values[0], "max": values[1]}
            site.inputs = (tuple(args[2:]), kwargs)
        elif gate.part in MODULE_PARTS:
            write_module(site, gate.part, values[0])
        elif gate.part == "output":
            output = site.output
            if not gate.items:
                site.output = _like(values[0], output, gate.batch)
                continue
            parts = list(output)
            for item, value in zip(gate.items, values, strict=True):
                parts[item] = _like(value, parts[item], gate.batch)
            site.output = type(output)(parts)
        elif gate.part == "inputs":
            args, kwargs = site.inputs
            args, kwargs = list(args), dict(kwargs)
            for item, value in zip(gate.items, values, strict=True):
                if isinstance(item, str):
                    kwargs[item] = _like(value, kwargs[item], gate.batch)
                else:
                    args[item] = _like(value, args[item], gate.batch)
            site.inputs = (tuple(args), kwargs)
        else:
            args, kwargs = site.inputs
            slope = values[0]
            x = args[1] if not gate.items else _pick(args, kwargs, gate.items[0])
            site.output = (_convolved(args, kwargs, gate.items) * slope).to(x.dtype)
