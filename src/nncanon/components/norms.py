"""Every norm's scale and the stream it normalises, before the norm's weight: TransformerLens' ``hook_scale`` and
``hook_normalized``.

A norm computes ``output = centred / scale · (offset + weight) (+ bias)`` over its input's last axis: ``centred`` is
the input less its mean for a LayerNorm and the input itself for an RMSNorm; ``scale`` is
``sqrt(mean(centred²) + eps)`` (``[..., 1]``); ``offset`` is 1 where the norm keeps its weight as an offset from one
(Gemma's ``1 + weight``), else 0. Its `NormAnatomy` is read from its structure (`norm_anatomy`: ``torch.nn.LayerNorm``,
a class named ``*RMSNorm*``, the forward's source for a mean subtracted or a weight offset, the epsilon named ``eps``,
``variance_epsilon`` or ``epsilon``); which norm feeds which sublayer from the block's structure (`norm_roles`:
the order its forward calls them in, the sites the family reads contributions at), or from `Family.norms`. The
load-time proof (`nncanon.proof.checks.norms`) checks the formula against the norm's own output, so a wrong guess
is a declined value with the numbers, never a wrong one.

Served (`norm_value`): both are computed from the norm module's input in float32 at the first read, which then waits at
the norm's output. A write of the scale replaces the denominator: the norm's output becomes the formula with the
written scale, at the positions whose scale changed; a write of the normalised value makes the output
``written · (offset + weight) (+ bias)`` there. Nothing written: the norm's own output, bit for bit.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
from nnsight.intervention.eproperty import WriteBack
from nnsight.intervention.interleaver import Mediator
from nnsight.intervention.util import first_input

from ..errors import InvalidWrite
from ..gradients import Through, first_read_in_backward, in_backward, mark, refuse_gradient, tracks
from ..served import _model_of, _value, check_write, served
from ..threads import ProcessCache
from ..traced import outside_trace, refuse_outside_trace

#: Each norm of a block: ``role -> (component serving it, its scale's name, its normalised value's name or None)``.
ROLES: dict[str, tuple[str, str, str | None]] = {
    "attention_norm": ("self_attn", "attention_norm_scale", "attention_normalized"),
    "query_norm": ("self_attn", "query_norm_scale", None),
    "key_norm": ("self_attn", "key_norm_scale", None),
    "attention_post_norm": ("self_attn", "attention_post_norm_scale", None),
    "linear_attention_norm": ("linear_attn", "linear_attention_norm_scale", "linear_attention_normalized"),
    "linear_attention_post_norm": ("linear_attn", "linear_attention_post_norm_scale", None),
    "mlp_norm": ("mlp", "mlp_norm_scale", "mlp_normalized"),
    "mlp_post_norm": ("mlp", "mlp_post_norm_scale", None),
}

#: The final norm's values (on the model: ``model.final_norm_scale``, ``model.final_normalized``).
FINAL_VALUES = ("final_norm_scale", "final_normalized")

#: The norm values of each component, in the order a block computes them.
COMPONENT_NORM_VALUES: dict[str, tuple[str, ...]] = {
    component: tuple(name for role, (owner, scale, normalized) in ROLES.items() if owner == component
                     for name in (scale, normalized) if name is not None)
    for component in ("self_attn", "linear_attn", "mlp")
}

#: Every norm value of a block.
NORM_VALUES = tuple(name for names in COMPONENT_NORM_VALUES.values() for name in names)

#: The scales (a write must be positive and finite).
SCALES = tuple(name for name in (*NORM_VALUES, *FINAL_VALUES) if name.endswith("_scale"))

#: The names an epsilon has on a norm module.
EPS_NAMES = ("eps", "variance_epsilon", "epsilon")

_QUERY = re.compile(r"^(q|query)_?(norm|layernorm|ln|layer_norm)$")
_KEY = re.compile(r"^(k|key)_?(norm|layernorm|ln|layer_norm)$")
_MLP_NAME = re.compile(r"mlp|ffn|feed_?forward|_ff_", re.IGNORECASE)


@dataclass(frozen=True)
class NormAnatomy:
    """How a norm computes its output from its input (see the module docstring).

    Attributes:
        kind: ``"rms"`` (no mean subtracted) or ``"layer"`` (a LayerNorm: the mean subtracted).
        eps: Added to the mean square under the root.
        offset: Added to the weight (Gemma's ``1 + weight``: 1.0), 0.0 elsewhere.
        dims: How many trailing axes it normalises over (``torch.nn.LayerNorm``'s ``normalized_shape``).
    """

    kind: str
    eps: float
    offset: float = 0.0
    dims: int = 1


def is_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a norm: ``torch.nn.LayerNorm`` / ``RMSNorm``, or a leaf module whose class is named
    ``*Norm*`` (a module holding others, DBRX's ``NormAttentionNorm``, is not)."""
    if isinstance(module, (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", torch.nn.LayerNorm))):
        return True
    return "norm" in type(module).__name__.lower() and not any(True for _ in module.children())


def _source(cls: type) -> str:
    """``cls.forward``'s source with comments dropped (``""`` where there is none)."""
    try:
        text = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""
    return "\n".join(line.split("#")[0] for line in text.splitlines())


_ANATOMIES: dict[tuple[type, float | None, int], NormAnatomy | str] = ProcessCache()


def norm_anatomy(module: torch.nn.Module) -> NormAnatomy | str:
    """The anatomy of norm ``module`` from its structure, or why it has none nncanon can serve."""
    eps = next((float(v) for n in EPS_NAMES if isinstance(v := getattr(module, n, None), (int, float))), None)
    shape = getattr(module, "normalized_shape", None)
    dims = len(shape) if isinstance(shape, (tuple, list)) else 1
    key = (type(module), eps, dims)
    if key not in _ANATOMIES:
        _ANATOMIES[key] = _anatomy(module, eps, dims)
    return _ANATOMIES[key]


def _anatomy(module: torch.nn.Module, eps: float | None, dims: int) -> NormAnatomy | str:
    cls = type(module)
    if isinstance(module, torch.nn.LayerNorm):
        own = cls.forward is not torch.nn.LayerNorm.forward
        return NormAnatomy("layer", float(module.eps), _offset(_source(cls)) if own else 0.0, dims)
    rms = getattr(torch.nn, "RMSNorm", None)
    if rms is not None and isinstance(module, rms):
        if module.eps is None:
            return f"its norm ({cls.__name__}) takes its epsilon from the input's dtype"
        return NormAnatomy("rms", float(module.eps), dims=dims)
    parameters = [p for p in inspect.signature(cls.forward).parameters if p != "self"]
    if len(parameters) > 1 and any("gate" in p for p in parameters):
        return f"its norm ({cls.__name__}) is gated: it multiplies its input by a gate it is given"
    source = _source(cls)
    written = re.search(r"\beps\s*=\s*([0-9][0-9.eE+-]*)", source)  # (OLMo's F.layer_norm(..., eps=1e-5))
    eps = eps if eps is not None or written is None else float(written.group(1))
    if eps is None:
        return f"its norm ({cls.__name__}) names no epsilon ({', '.join(EPS_NAMES)})"
    layer = "layer_norm(" in source or re.search(r"-\s*(\w+\.)?mean\b", source) is not None
    if "rms" in cls.__name__.lower():
        layer = False
    return NormAnatomy("layer" if layer else "rms", eps, _offset(source), dims)


def _offset(source: str) -> float:
    """1.0 where a norm's forward adds one to its weight (Gemma's ``1 + weight``, Nemotron's ``weight + 1``), else
    0.0."""
    return 1.0 if re.search(r"1(\.0)?\s*\+\s*self\.weight|self\.weight(\.float\(\))?\s*\+\s*1", source) else 0.0


# -- the formula ---------------------------------------------------------------------------------


def statistics(anatomy: NormAnatomy, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(centred, scale)`` of input ``x``, in float32: ``centred`` as ``x``, ``scale`` with the normalised axes 1."""
    h = x.float()
    axes = tuple(range(-anatomy.dims, 0))
    centred = h - h.mean(axes, keepdim=True) if anatomy.kind == "layer" else h
    return centred, (centred.pow(2).mean(axes, keepdim=True) + anatomy.eps).sqrt()


def affine(anatomy: NormAnatomy, module: torch.nn.Module, normalized: torch.Tensor) -> torch.Tensor:
    """``normalized · (offset + weight) (+ bias)`` in float32: the norm's output by the formula."""
    out = normalized.float()
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if isinstance(weight, torch.Tensor):
        out = out * (weight.float() + anatomy.offset)
    elif anatomy.offset:
        out = out * anatomy.offset
    if isinstance(bias, torch.Tensor):
        out = out + bias.float()
    return out


def formula(anatomy: NormAnatomy, module: torch.nn.Module, x: torch.Tensor, scale: torch.Tensor | None = None
            ) -> torch.Tensor:
    """The norm's output for input ``x`` by the formula, with ``scale`` as the denominator (``None``: ``x``'s own),
    in ``x``'s dtype."""
    centred, own = statistics(anatomy, x)
    return affine(anatomy, module, centred / (own if scale is None else scale)).to(x.dtype)


# -- where the norms are ---------------------------------------------------------------------------


def _calls(source: str, names: list[str], last: tuple[str, ...] = ()) -> dict[str, int]:
    """Where ``self.<name>(...)`` first closes in ``source`` (for the names in ``last``, where its last call closes),
    per name found: the order calls finish in (an inner call, ``self.attention(self.ln1(x))``, finishes first)."""
    found = {}
    for name in names:
        matches = list(re.finditer(rf"self\.{re.escape(name)}\s*\(", source))
        if not matches:
            continue
        match = matches[-1] if name in last else matches[0]
        depth, position = 0, match.end() - 1
        for position in range(match.end() - 1, len(source)):
            depth += {"(": 1, ")": -1}.get(source[position], 0)
            if depth == 0:
                break
        found[name] = position
    return found


def norm_roles(block: torch.nn.Module, spec: Any) -> dict[str, str]:
    """``role -> reason`` where the block has no such norm, or ``role -> path`` (relative to the block) of its norms.

    ``spec`` is the block's `nncanon.families.Family` record. Pre-norms are the block's own norm modules in the order
    its forward finishes calling them: the last before the token mixer's call, then the last between it and the MLP's
    that is not the mixer's post-norm. A post-norm is the norm a family reads a contribution at, else the first norm
    the forward finishes calling after the sublayer where another follows before the next sublayer's call (a
    sandwich block). Query and key norms are the attention's children named ``q_norm``/``k_norm`` (``q_layernorm``,
    ``query_layernorm``...). `Family.norms` names a role's path where the structure does not tell.
    """
    roles: dict[str, str] = {}
    block_name = type(block).__name__
    mixer_role = "attention_norm" if spec.attention is not None else "linear_attention_norm"
    mixer = spec.attention if spec.attention is not None else spec.mixer
    norms = [name for name, child in block.named_children() if is_norm(child)]
    # (the MLP's last call: a block calling its MLP in two branches, StableLM's parallel one first and its sequential
    # one after the post-attention norm, has that norm between the mixer and the MLP where the block has it at all)
    mlp_name = spec.mlp.split(".")[0] if spec.mlp else None
    order = _calls(_source(type(block)), [*norms, *(p.split(".")[0] for p in (mixer, spec.mlp) if p)],
                   last=(mlp_name,) if mlp_name else ())
    if not order or any(name not in order for name in norms):  # no source: the order of registration
        order = {name: i for i, name in enumerate(norms)}
        for i, path in enumerate((mixer, spec.mlp)):
            if path:
                order.setdefault(path.split(".")[0], len(norms) + i if i else len(norms) - 0.5 - len(norms) // 2)
    posts = {site.module: role for role, site in (("attention_post_norm", spec.attention_output if spec.attention
                                                   else None),
                                                  ("linear_attention_post_norm", spec.mixer_output if spec.attention
                                                   is None and spec.mixer else None),
                                                  ("mlp_post_norm", spec.mlp_output))
             if site is not None and site.module in norms}
    at = {name: order.get(name, -1) for name in norms}
    mixer_at = order.get(mixer.split(".")[0], None) if mixer else None
    mlp_at = order.get(spec.mlp.split(".")[0], None) if spec.mlp else None
    if mlp_at is None and spec.mlp is None and spec.mlp_output is not None:  # an MLP run inline (OPT): after the mixer
        mlp_at = max(at.values(), default=0) + 1
    taken: set[str] = set(posts)
    for path, role in posts.items():
        roles[role] = path
    if mixer_at is not None:
        before = [n for n in sorted(norms, key=at.get) if at[n] < mixer_at and n not in taken]
        for_mlp = [n for n in before if _MLP_NAME.search(n)]
        if for_mlp and len(before) > len(for_mlp):  # (Falcon-40B norms for both sublayers before either runs)
            before = [n for n in before if n not in for_mlp]
        if before:
            roles[mixer_role] = before[-1]
            taken.add(before[-1])
        between = [n for n in sorted(norms, key=at.get) if at[n] > mixer_at and (mlp_at is None or at[n] < mlp_at)
                   and n not in taken] or [n for n in for_mlp if n not in taken][-1:]
        if "attention_post_norm" not in roles and spec.attention is not None and len(between) >= 2:
            roles["attention_post_norm"] = between[0]
            taken.add(between[0])
            between = between[1:]
    else:
        between = [n for n in sorted(norms, key=at.get) if mlp_at is not None and at[n] < mlp_at and n not in taken]
    if mlp_at is not None and spec.mlp_output is not None:
        if between:
            roles["mlp_norm"] = between[-1]
            taken.add(between[-1])
        elif mixer_role in roles:
            roles["mlp_norm"] = (f"parallel block: one norm feeds both ({block_name}.{roles[mixer_role]} feeds its "
                                 f"token mixer and its MLP; its scale is the mixer's {ROLES[mixer_role][1]})")
        after = [n for n in sorted(norms, key=at.get) if at[n] > mlp_at and n not in taken]
        if "mlp_post_norm" not in roles and "attention_post_norm" in roles and after:
            roles["mlp_post_norm"] = after[0]
    if spec.attention is not None:
        try:
            attention = block.get_submodule(spec.attention)
        except AttributeError:
            attention = None
        for name, child in attention.named_children() if attention is not None else ():
            role = "query_norm" if _QUERY.match(name) else "key_norm" if _KEY.match(name) else None
            if role is not None and is_norm(child):
                roles.setdefault(role, f"{spec.attention}.{name}")
            elif role is not None and any(is_norm(inner) for inner in child.modules() if inner is not child):
                roles.setdefault(role, f"its {role.replace('_', ' ')} ({type(child).__name__}) holds one norm module "
                                       "per head, each with its own weight: its scale is not served (the values "
                                       "before the norm are)")
    for role, path in spec.norms.items():
        roles[role] = path
    for role in ROLES:
        if role not in roles:
            roles[role] = _missing(role, block_name, spec)
    return roles


def _missing(role: str, block: str, spec: Any) -> str:
    """Why a block has no norm in ``role`` (a property of the block)."""
    if role in ("attention_norm", "attention_post_norm", "query_norm", "key_norm") and spec.attention is None:
        return "it has no softmax attention"
    if role in ("linear_attention_norm", "linear_attention_post_norm") and spec.mixer is None:
        return "it has no linear-attention or state-space mixer"
    if role.startswith("mlp") and spec.mlp_output is None:
        return "it has no MLP"
    return {
        "attention_norm": f"{block}.forward calls no norm module before its attention",
        "linear_attention_norm": f"{block}.forward calls no norm module before its mixer",
        "mlp_norm": f"{block}.forward calls no norm module before its MLP",
        "attention_post_norm": "its blocks have no post-norm: attention's output is added to the stream as it is",
        "linear_attention_post_norm": "its blocks have no post-norm: the mixer's output is added to the stream as it "
                                      "is",
        "mlp_post_norm": "its blocks have no post-norm: the MLP's output is added to the stream as it is",
        "query_norm": "its attention has no query norm",
        "key_norm": "its attention has no key norm",
    }[role]


def is_reason(path_or_reason: str) -> bool:
    """Whether a `norm_roles` entry is a reason (a sentence) rather than a module path."""
    return " " in path_or_reason


# -- serving ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class NormSite:
    """One norm of one block (or the final norm), as mounted: where its input and output are read.

    Attributes:
        path: The norm module's path relative to the block (the model's, for the final norm).
        envoy: The norm module's envoy.
        anatomy: How it computes its output.
        where: A label for messages (``"layers[3].self_attn"``).
        order: The block's order of values, for the out-of-order message.
        scale_name: The name its scale is served by (for messages).
        heads_first: The norm receives ``[b, H, s, head_dim]`` (a q/k norm called after the heads are moved first:
            Gemma-3, Apertus, HunYuan...); its values are served sequence-first (``[b, s, H, 1]``), transposed
            from and back into the norm's layout.
    """

    path: str
    envoy: Any
    anatomy: NormAnatomy
    where: str
    order: str = ""
    scale_name: str = "scale"
    heads_first: bool = False

    @property
    def location(self) -> str:
        """Where the norm's output is read (what a write replaces)."""
        return f"{self.envoy.path}.output"

    @property
    def input_location(self) -> str:
        return f"{self.envoy.path}.input"


@dataclass(eq=False)
class NormBinding:
    """A norm value bound to a `NormSite`: ``part`` is ``"scale"`` or ``"normalized"``."""

    name: str
    site: NormSite
    part: str

    @property
    def where(self) -> str:
        return self.site.where


@dataclass(eq=False)
class NormRead:
    """A norm's values at one visit: the input's ``centred`` part, the served ``scale`` and ``normalized`` and their
    clean copies (an edit is what differs from them), whether gradients are tracked."""

    centred: torch.Tensor
    scale: torch.Tensor
    normalized: torch.Tensor
    clean_scale: torch.Tensor
    clean_normalized: torch.Tensor
    graph: bool
    raw: Any = None  # the norm's raw output at this visit (what the write-back hands back, edited)


def check_scale(value: torch.Tensor, what: str, shape: tuple | None = None) -> None:
    """Raise `InvalidWrite` unless every element of a written scale is finite and positive (``shape``: the scale's,
    where ``value`` holds only the elements written)."""
    bad = ~torch.isfinite(value) | (value <= 0)
    if bool(bad.any()):
        found = value[bad].flatten()[:3].tolist()
        raise InvalidWrite(
            f"{what} cannot take the value written to it: a norm's scale is a positive, finite denominator "
            f"(sqrt(mean square + eps)), and {int(bad.sum())} element(s) are not (e.g. {found}). It expects shape "
            f"{tuple(value.shape) if shape is None else shape} of positive finite {value.dtype} numbers."
        )


def _read(site: NormSite, mediator: Mediator, label: str) -> NormRead:
    """The norm's `NormRead` at this visit: its input read, then its output waited at, with the write-back pending
    (shared by the scale and the normalised value of the same norm)."""
    location = site.location
    occurrence = mediator.wanted(location)
    waiting = mediator.transform
    if waiting is not None and waiting.key == (site, location, occurrence):
        return waiting.view
    args, kwargs = _value(site, mediator, label, site.input_location)
    x = first_input(args, kwargs)
    if site.heads_first:  # (served sequence-first: [b, H, s, d] -> [b, s, H, d])
        x = x.transpose(1, 2)
    graph = tracks(x)
    centred, scale = statistics(site.anatomy, x)
    if graph:
        scale = scale.clone()  # (sqrt keeps its result for the backward: an edit in place must not touch it)
        normalized = (centred / scale).detach().to(x.dtype).requires_grad_().clone()
    else:
        normalized = (centred / scale).to(x.dtype)
    read = NormRead(centred, scale, normalized, scale.detach().clone(), normalized.detach().clone(), graph)
    raw = _value(site, mediator, label)
    read.raw = raw
    mediator.transform = WriteBack(_Pending(site, read, raw, label), read, site, location, occurrence)
    return read


def read_norm(site: NormSite, mediator: Mediator, label: str) -> tuple[NormRead, Any]:
    """``(read, raw)``: the norm's `NormRead` at this visit (`_read`, its write-back pending) and the norm's raw output
    it is handed back into (`write_back`)."""
    read = _read(site, mediator, label)
    return read, read.raw


def write_back(site: NormSite, read: NormRead, raw: Any, label: str, normalized: torch.Tensor | None = None) -> Any:
    """The norm's output ``raw`` with the edits of ``read`` in it, its normalised value taken as ``normalized``
    (``[b, s, d]``, default ``read.normalized``): where that differs from the clean one, the output is
    ``normalized · (offset + weight) (+ bias)``; nothing changed: ``raw`` itself."""
    return _write_back(site, read, raw, label, normalized)


class _Pending:
    """A norm's pending write-back (what the worker hands the model when it moves on)."""

    def __init__(self, site: NormSite, read: NormRead, raw: Any, label: str) -> None:
        self.site, self.read, self.raw, self.label = site, read, raw, label

    def __call__(self) -> Any:
        return _write_back(self.site, self.read, self.raw, self.label)


def _write_back(site: NormSite, read: NormRead, raw: Any, label: str, normalized: torch.Tensor | None = None) -> Any:
    """The norm's output with the edits of ``read`` in it (the formula where they changed), else ``raw`` itself.
    ``read`` is sequence-first; a heads-first norm's output is transposed to it and the result back."""
    out = raw[0] if isinstance(raw, tuple) else raw
    normalized = read.normalized if normalized is None else normalized
    scale_changed = read.scale.detach() != read.clean_scale
    normalized_changed = normalized.detach() != read.clean_normalized
    if not read.graph and not bool(scale_changed.any()) and not bool(normalized_changed.any()):
        return raw
    if bool(scale_changed.any()):
        check_scale(read.scale.detach()[scale_changed], f"{site.where}.{site.scale_name}", tuple(read.scale.shape))
    by_scale = read.centred / read.scale
    kept = ~normalized_changed
    if read.graph:
        used = torch.where(kept, by_scale + (normalized - normalized.detach()), normalized.float())
    else:
        used = torch.where(kept, by_scale, normalized.float())
    if site.heads_first:
        out = out.transpose(1, 2)
    written = affine(site.anatomy, site.envoy._module, used).to(out.dtype)
    changed = (scale_changed | normalized_changed).expand_as(out)
    base = Through.apply(written, out, 1.0) if read.graph else out
    result = torch.where(changed, written, base)
    if site.heads_first:
        result = result.transpose(1, 2)
    return (result, *raw[1:]) if isinstance(raw, tuple) else result


class norm_value(served):
    """A norm's scale or normalised value (`NormBinding`), served on a component (or the model, the final norm's).

    The host answers ``_nncanon_norm(name)`` with the binding, or raises `ValueNotAvailable` with the reason.
    """

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        binding: NormBinding = obj._nncanon_norm(self.name)
        label = f"{binding.where}.{self.name}"
        if in_backward():
            raise first_read_in_backward(label)
        outside = outside_trace(_model_of(obj), label)
        if outside is not None:
            return outside
        mediator = Mediator.current(binding.site.location)
        read = _read(binding.site, mediator, label)
        view = read.scale if binding.part == "scale" else read.normalized
        mark(view, label)
        refuse_gradient(view, obj._nncanon_gradient_reason(self.name))
        return view

    def __set__(self, obj: Any, value: Any) -> None:
        binding: NormBinding = obj._nncanon_norm(self.name)
        label = f"{binding.where}.{self.name}"
        refuse_outside_trace(_model_of(obj), f"{label} was written")
        mediator = Mediator.current(binding.site.location)
        read = _read(binding.site, mediator, label)
        current = read.scale if binding.part == "scale" else read.normalized
        check_write(value, current, label)
        if binding.part == "scale":
            check_scale(value, label)
        with torch.no_grad():
            current.copy_(value.expand_as(current))


def norm_values(component: str) -> dict[str, norm_value]:
    """The `norm_value` descriptors of ``component`` (``"self_attn"``...), by name, with their docs."""
    return {name: norm_value(name, DESCRIPTIONS[name][0], DESCRIPTIONS[name][1])
            for name in COMPONENT_NORM_VALUES[component]}


_SCALE_DOC = ("``[batch, seq, 1]``: the denominator of {what} (TransformerLens ``{tl}``): "
              "``sqrt(mean(x²) + eps)`` for an RMSNorm, ``sqrt(var(x) + eps)`` for a LayerNorm, float32, from the "
              "norm's input. Writable: a write replaces the denominator (the norm's output becomes "
              "``centred / scale · weight (+ bias)`` where it changed), so writing a clean run's saved scale freezes "
              "the norm. Positive and finite.")
_NORMALIZED_DOC = ("``[batch, seq, hidden]``: the input of {what}, centred (LayerNorm) and divided by its scale, "
                   "before the norm's weight and bias (TransformerLens ``{tl}``), in the input's dtype. Writable: the "
                   "norm's output becomes ``written · weight (+ bias)`` where it changed.")

#: ``name -> (short description, docstring)``.
DESCRIPTIONS: dict[str, tuple[str, str]] = {
    "attention_norm_scale": ("scale of the norm before attention [b, s, 1]",
                             _SCALE_DOC.format(what="the norm before attention", tl="ln1.hook_scale")),
    "attention_normalized": ("stream normalised by the norm before attention, before its weight [b, s, d]",
                             _NORMALIZED_DOC.format(what="the norm before attention", tl="ln1.hook_normalized")),
    "query_norm_scale": ("scale of the query norm [b, s, H, 1] per head, [b, s, 1] over the projection",
                         _SCALE_DOC.format(what="the query norm", tl="attn.q_norm.hook_scale").replace(
                             "``[batch, seq, 1]``", "``[batch, seq, heads, 1]`` (a per-head norm) or "
                             "``[batch, seq, 1]`` (a norm over the whole projection)")),
    "key_norm_scale": ("scale of the key norm [b, s, KV, 1] per head, [b, s, 1] over the projection",
                       _SCALE_DOC.format(what="the key norm", tl="attn.k_norm.hook_scale").replace(
                           "``[batch, seq, 1]``", "``[batch, seq, kv_heads, 1]`` (a per-head norm) or "
                           "``[batch, seq, 1]`` (a norm over the whole projection)")),
    "attention_post_norm_scale": ("scale of attention's post-norm [b, s, 1]",
                                  _SCALE_DOC.format(what="the post-norm of attention's output",
                                                    tl="ln1_post.hook_scale")),
    "linear_attention_norm_scale": ("scale of the norm before the mixer [b, s, 1]",
                                    _SCALE_DOC.format(what="the norm before the linear mixer", tl="ln1.hook_scale")),
    "linear_attention_normalized": ("stream normalised by the norm before the mixer, before its weight [b, s, d]",
                                    _NORMALIZED_DOC.format(what="the norm before the linear mixer",
                                                           tl="ln1.hook_normalized")),
    "linear_attention_post_norm_scale": ("scale of the linear mixer's post-norm [b, s, 1]",
                                         _SCALE_DOC.format(what="the post-norm of the linear mixer's output (LFM3's "
                                                           "post_operator_norm)", tl="ln1_post.hook_scale")),
    "mlp_norm_scale": ("scale of the norm before the MLP [b, s, 1]",
                       _SCALE_DOC.format(what="the norm before the MLP", tl="ln2.hook_scale")),
    "mlp_normalized": ("stream normalised by the norm before the MLP, before its weight [b, s, d]",
                       _NORMALIZED_DOC.format(what="the norm before the MLP", tl="ln2.hook_normalized")),
    "mlp_post_norm_scale": ("scale of the MLP's post-norm [b, s, 1]",
                            _SCALE_DOC.format(what="the post-norm of the MLP's output", tl="ln2_post.hook_scale")),
    "final_norm_scale": ("scale of the final norm [b, s, 1]",
                         _SCALE_DOC.format(what="the final norm", tl="ln_final.hook_scale")),
    "final_normalized": ("stream normalised by the final norm, before its weight [b, s, d]",
                         _NORMALIZED_DOC.format(what="the final norm", tl="ln_final.hook_normalized")),
}
