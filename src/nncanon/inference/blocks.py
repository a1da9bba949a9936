"""`block_parts`: the roles of one block's submodules and the candidate sites of its contributions.

Attention is the block's submodule in which a softmax over ``[b, H, q, k]`` scores ran; its output
projection is the last weight matrix it ran that returns the stream's width. The MLP is the
largest other submodule with weights that returns the stream's width (or, where the MLP is not a
module, the last such projection of the block itself: OPT's ``fc2``). A block with no softmax
attention whose other weighted submodule is not the MLP has a token mixer (Mamba, a convolution).

The candidates for a contribution are the tensors that may be what it adds to the stream: the
module's output (its tuple element 0), its last projection's output (a module that adds the
residual itself, as BLOOM's and MPT's do), and a norm run on either (a post-norm).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..served import Site
from .factors import CLOSE
from .recording import Call, Recording
from .structure import has_matrix, is_norm

_MLP_NAMES = re.compile(r"mlp|ffn|feed_forward|feedforward|moe|expert|fc", re.IGNORECASE)


@dataclass
class Candidate:
    """One tensor that may be a contribution: its site (relative to the block) and its value."""

    site: Site
    value: torch.Tensor
    label: str


@dataclass
class BlockParts:
    """What one block's recorded forward shows.

    Attributes:
        block: The block's path.
        attention: The softmax attention submodule (relative), or ``None``.
        projection: Its output projection (relative), or ``None``.
        head_norm: A norm over all heads run right before the projection, on its input (BitNet), or ``None``.
        mlp: The MLP submodule (relative); ``None`` where none was found or the MLP is not a module.
        mixer: A token mixer that is not softmax attention (relative), or ``None``.
        mixer_projection: The mixer's output projection (relative), its input width, and the width of one
            head where a per-head norm runs right before it (``None``: not seen), or ``None``.
        candidates: Role (``"attention"``, ``"mixer"``, ``"mlp"``) -> its candidate contributions.
        router: A mixture of experts' router inside the MLP (relative) returning ``(logits, weights,
            indices)``, or ``None``.
        router_flat: The router runs on the flattened ``(b·s, d)`` tokens.
        shared: The site of a shared expert whose output is what it adds to the MLP's (the MLP's output is
            the routed experts' plus it, on the twin), or ``None``.
        extras: How many elements the block returns after the stream (``None``: a tensor).
        x, y: The stream entering and leaving the block.
        tried: Role -> what was looked for, where nothing was found.
    """

    block: str
    attention: str | None = None
    projection: str | None = None
    head_norm: str | None = None
    mlp: str | None = None
    mixer: str | None = None
    mixer_projection: tuple[str, int, int | None] | None = None
    router: str | None = None
    router_flat: bool = False
    shared: Site | None = None
    candidates: dict[str, list[Candidate]] = field(default_factory=dict)
    extras: int | None = None
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    tried: dict[str, str] = field(default_factory=dict)

    def shape(self) -> tuple:
        """The roles, for telling block kinds apart."""
        return (self.attention, self.projection, self.mlp, self.mixer, self.router, self.extras,
                tuple((role, tuple(c.label for c in cands)) for role, cands in self.candidates.items()))


def _relative(block: str, name: str) -> str:
    return name[len(block) + 1:]


def _stream_shaped(tensor: torch.Tensor | None, x: torch.Tensor) -> str | None:
    """``"full"`` for ``[b, s, d]``, ``"flat"`` for ``[b·s, d]``, else ``None``."""
    if tensor is None or tensor.shape[-1] != x.shape[-1]:
        return None
    if tensor.shape == x.shape:
        return "full"
    if tensor.dim() == 2 and tensor.shape[0] == x.shape[0] * x.shape[1]:
        return "flat"
    return None


def _last_projection(run: Recording, parent: str, x: torch.Tensor) -> Call | None:
    """The last weight matrix run inside ``parent`` that returns the stream's width (``[b, s, d]``)."""
    found = [c for c in run.within(parent) if has_matrix(run.modules[c.name]) and not list(
        run.modules[c.name].children()) and _stream_shaped(c.output, x)]
    return max(found, key=lambda c: c.end) if found else None


def _site(module: str, call: Call, x: torch.Tensor) -> Site:
    flat = _stream_shaped(call.output, x) == "flat"
    return Site(module, index=0 if call.tuple_length else None, flat=flat, clone=call.changed_later)


def _post_norms(run: Recording, block: str, source: Call, x: torch.Tensor) -> list[Candidate]:
    """Norms among the block's children that ran on ``source``'s output."""
    found = []
    for call in run.within(block):
        name = _relative(block, call.name)
        if "." in name or call.start < source.end or call.input is None or source.output is None:
            continue
        if is_norm(run.modules[call.name], call) and call.input.shape == source.output.shape and torch.equal(
            call.input, source.output
        ):
            found.append(Candidate(_site(name, call, x), call.output, f"post-norm {name}"))
    return found


def _contributions(run: Recording, block: str, module: str, x: torch.Tensor, projection: bool = True
                   ) -> list[Candidate]:
    """The candidate contributions of the block's submodule ``module`` (relative)."""
    call = run.calls.get(f"{block}.{module}")
    if call is None:  # a container (a ModuleList of sublayers) that does not run itself
        return []
    out: list[Candidate] = []
    if _stream_shaped(call.output, x):
        out.append(Candidate(_site(module, call, x), call.output, f"{module} output"))
        out += _post_norms(run, block, call, x)
    last = _last_projection(run, f"{block}.{module}", x) if projection else None
    if last is not None and last.name != call.name:
        projection = last
        relative = _relative(block, projection.name)
        out.append(Candidate(_site(relative, projection, x), projection.output, f"{relative} output"))
        out += _post_norms(run, block, projection, x)
    return out


def _norm_before(run: Recording, parent: str, projection: Call) -> Call | None:
    """A norm inside ``parent`` whose output is the projection's input (heads normed before it)."""
    for call in run.within(parent):
        if call.end < projection.start and call.output is not None and projection.input is not None and (
            call.output.shape == projection.input.shape and is_norm(run.modules[call.name], call)
            and torch.equal(call.output, projection.input)
        ):
            return call
    return None


def _shared_expert(run: Recording, mlp: Call, x: torch.Tensor) -> Call | None:
    """The MLP's child named as a shared expert whose output plus another child's (the routed experts')
    is the MLP's output, to `CLOSE`."""

    children = [c for c in run.within(mlp.name) if "." not in c.name[len(mlp.name) + 1:]
                and _stream_shaped(c.output, x) and c.output is not None]
    total = mlp.output.reshape(-1, x.shape[-1]).double()
    for shared in (c for c in children if "shared" in c.name.rpartition(".")[2]):
        rest = total - shared.output.reshape(-1, x.shape[-1]).double()
        for routed in (c for c in children if c is not shared):
            if ((routed.output.reshape(-1, x.shape[-1]).double() - rest).abs() <= CLOSE * (1 + rest.abs())).all():
                return shared
    return None


def _head_width(run: Recording, mixer: str, projection: Call, width: int) -> int | None:
    """The width of one head, where the last module the mixer ran before its projection is a norm over
    narrower rows (a per-head gated norm: ``[.., head_dim]``)."""
    before = [c for c in run.within(mixer) if c.end < projection.start and c.input is not None]
    if not before:
        return None
    last = max(before, key=lambda c: c.end)
    narrow = last.input.shape[-1]
    if is_norm(run.modules[last.name], last) and narrow < width and width % narrow == 0:
        return narrow
    return None


def _router(run: Recording, mlp: str) -> Call | None:
    """The module inside ``mlp`` that returns ``(logits [.., E], weights [.., k], indices [.., k])``."""
    for call in run.within(mlp):
        items = call.items
        if len(items) >= 3 and items[0][1] and items[1][1] and not items[2][1] and items[2][0] and (
            items[1][0] == items[2][0] and items[0][0][:-1] == items[2][0][:-1]
        ):
            return call
    return None


def block_parts(run: Recording, block: str) -> BlockParts:
    """The roles and candidate contributions of the block at path ``block``."""
    call = run.calls[block]
    parts = BlockParts(block, extras=None if call.tuple_length is None else call.tuple_length - 1,
                       x=call.input, y=call.output)
    x = call.input
    softmax = [name for name in run.softmax_in if name.startswith(f"{block}.")]
    if softmax:
        parts.attention = _relative(block, softmax[0])
        projection = _last_projection(run, f"{block}.{parts.attention}", x)
        if projection is not None:
            parts.projection = _relative(block, projection.name)
            norm = _norm_before(run, f"{block}.{parts.attention}", projection)
            parts.head_norm = None if norm is None else _relative(block, norm.name)
        else:
            parts.tried["attention_head_outputs"] = (
                f"no weight matrix inside {parts.attention} returns the stream's width: no output projection"
            )
        parts.candidates["attention"] = _contributions(run, block, parts.attention, x)
        outer = parts.attention
        while "." in outer:  # the modules around it, up to the block's child (a wrapper may add a norm)
            outer = outer.rpartition(".")[0]
            parts.candidates["attention"] += _contributions(run, block, outer, x, projection=False)
    else:
        parts.tried["self_attn"] = "no softmax over [batch, heads, queries, keys] scores ran inside the block"
    children = [c for c in run.within(block) if "." not in _relative(block, c.name)]
    top = parts.attention.split(".")[0] if parts.attention else None
    weighted = [c for c in children if _relative(block, c.name) != top
                and has_matrix(run.modules[c.name]) and _stream_shaped(c.output, x)]
    modules = [c for c in weighted if list(run.modules[c.name].children())]
    named = [c for c in modules if _MLP_NAMES.search(_relative(block, c.name))]
    mlp_call = None
    if named:
        mlp_call = named[-1]
    elif modules and (parts.attention is not None or len(modules) > 1):
        mlp_call = modules[-1]
    if mlp_call is not None:
        parts.mlp = _relative(block, mlp_call.name)
        parts.candidates["mlp"] = _contributions(run, block, parts.mlp, x)
        router = _router(run, mlp_call.name)
        if router is not None:
            parts.router = _relative(block, router.name)
            parts.router_flat = len(router.items[2][0]) == 2
            shared = _shared_expert(run, mlp_call, x)
            if shared is not None:
                parts.shared = Site(_relative(block, shared.name), flat=_stream_shaped(shared.output, x) == "flat")
    else:
        leaves = [c for c in weighted if not list(run.modules[c.name].children())]
        if leaves and parts.attention is not None:
            last = leaves[-1]
            relative = _relative(block, last.name)
            parts.candidates["mlp"] = [Candidate(_site(relative, last, x), last.output, f"{relative} output")]
        else:
            parts.tried["mlp"] = "no submodule with weights besides the token mixer returns the stream's width"
    mixers = [c for c in modules if c is not mlp_call]
    if parts.attention is None and mixers:
        parts.mixer = _relative(block, mixers[0].name)
        parts.candidates["mixer"] = _contributions(run, block, parts.mixer, x)
        projection = _last_projection(run, mixers[0].name, x)
        if projection is not None and projection.input is not None:
            width = projection.input.shape[-1]
            parts.mixer_projection = (_relative(block, projection.name), width, _head_width(run, mixers[0].name,
                                                                                            projection, width))
    return parts
