"""Where an attention module keeps its query and key norms and its output gate, found on the module.

- The q/k norms: a child module named as transformers names them (``q_norm``/``k_norm``, ``q_layernorm``/
  ``k_layernorm``, ``query_layernorm``/``key_layernorm``), read at its input. Whether it receives its tensor
  sequence-first (``[b, s, H, d]`` or ``[b, s, H·d]``) or heads-first (``[b, H, s, d]``: Gemma-3, Apertus,
  StableLM, HunYuan) is read from the forward's code: heads-first where the expression the norm is called on
  transposes (``.transpose(1, 2)``) or reads a variable that does, as last assigned. The ``qk_norm`` check proves
  the layout at load (the value's leading axes are the queries').
- The output gate: the last ``sigmoid`` (or ``softplus``) call of the forward after its attention-interface call
  (``attn_output * torch.sigmoid(gate)``), read at its output, found among the forward's operations at the first
  read.

Read once per attention class (a `ProcessCache`), from the class's code and children: nothing runs.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch

from ..served import Site
from ..threads import ProcessCache

#: The names transformers gives an attention's query and key norms, in pairs.
NORM_NAMES = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"), ("query_layernorm", "key_layernorm"))

#: The values, and which of a pair each reads.
BEFORE_NORM = {"query_states_before_norm": 0, "key_states_before_norm": 1}

#: The activations an output gate applies, by the name their operation carries.
GATE_ACTIVATIONS = ("sigmoid", "softplus")

NO_NORM = "its attention does not norm queries and keys"
NO_KEY_NORM = "its attention norms its queries but has no key norm of its own here (it reads another block's keys)"
NO_GATE = "its attention does not gate its output"

_FOUND: dict = ProcessCache()


def inside_sites(module: torch.nn.Module, path: str) -> tuple[dict[str, Site], dict[str, str]]:
    """The sites of the q/k values before their norms and of the output gate of attention ``module`` (at ``path``
    in its block), and the reason for each of them it has not: ``(sites, reasons)``."""
    cls = type(module)
    children = tuple(name for pair in NORM_NAMES for name in pair if isinstance(getattr(module, name, None),
                                                                                torch.nn.Module))
    key = (cls, path, children)
    found = _FOUND.get(key)
    if found is None:
        found = _FOUND[key] = _find(cls, path, children)
    return found


def _find(cls: type, path: str, children: tuple[str, ...]) -> tuple[dict[str, Site], dict[str, str]]:
    sites: dict[str, Site] = {}
    reasons: dict[str, str] = {}
    pair = next((pair for pair in NORM_NAMES if pair[0] in children or pair[1] in children), None)
    tree = _forward_tree(cls)
    for name, index in BEFORE_NORM.items():
        norm = None if pair is None else pair[index]
        if norm is None or norm not in children:
            reasons[name] = NO_NORM if pair is None or pair[0] not in children else NO_KEY_NORM
            continue
        sites[name] = Site(f"{path}.{norm}", key="input", heads_first=_heads_first(tree, norm))
    gate = _gate_activation(tree)
    if gate is None:
        reasons["attention_gate"] = NO_GATE
    else:
        sites["attention_gate"] = Site(path, op=f"*{gate}*")
    return sites, reasons


def _forward_tree(cls: type) -> ast.AST | None:
    """The parsed source of ``cls.forward`` (``None`` where it has none to read)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return None


def _transposes(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "transpose" for n in ast.walk(node))


def _heads_first(tree: ast.AST | None, norm: str) -> bool:
    """Whether the forward calls ``self.<norm>`` on a heads-first tensor: its argument transposes (``.transpose``),
    or reads a variable that was heads-first when the call is made (a variable is heads-first where the expression
    last assigned to it transposes or reads a heads-first variable: rotary applied to heads-first queries keeps
    them so)."""
    if tree is None:
        return False
    heads_first: dict[str, bool] = {}
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.Call))]
    for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset, isinstance(n, ast.Call))):  # source order
        if isinstance(node, ast.Call) and _is_norm(node.func, norm):
            return bool(node.args) and _layout(node.args[0], heads_first)
        if isinstance(node, ast.Assign) and not _calls(node.value, norm):
            layout = _layout(node.value, heads_first)
            for target in node.targets:
                for each in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(each, ast.Name):
                        heads_first[each.id] = layout
    return False


def _layout(node: ast.AST, heads_first: dict[str, bool]) -> bool:
    """Whether expression ``node`` is heads-first: it transposes, or reads a heads-first variable."""
    return _transposes(node) or any(isinstance(n, ast.Name) and heads_first.get(n.id, False) for n in ast.walk(node))


def _is_norm(func: ast.AST, norm: str) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == norm and isinstance(func.value, ast.Name) and (
        func.value.id == "self")


def _calls(node: ast.AST, norm: str) -> bool:
    return any(isinstance(n, ast.Call) and _is_norm(n.func, norm) for n in ast.walk(node))


def _gate_activation(tree: ast.AST | None) -> str | None:
    """The activation of an output gate (``"sigmoid"``, ``"softplus"``): the last such call the forward makes after
    its attention-interface call (one before it is no output gate: Doge's dynamic mask); ``None`` for none."""
    if tree is None:
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    kernel = [n.lineno for n in calls if isinstance(n.func, ast.Name) and n.func.id == "attention_interface"]
    if not kernel:
        return None
    after = sorted((n for n in calls if n.lineno > max(kernel) and _activation(n.func) is not None),
                   key=lambda n: (n.lineno, n.col_offset))
    return _activation(after[-1].func) if after else None


def _activation(func: ast.AST) -> str | None:
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name if name in GATE_ACTIVATIONS else None


def with_inside(sites: tuple, inner: dict[str, Site], attention: str) -> tuple:
    """An attention's ``sites`` with those inside its forward (`nncanon.components.inside`): the q/k values before
    their norms (their module's input, read with the attention's operation hooks installed), the output gate (an
    operation found at its first read). Kept per ``(sites, inner)`` so blocks of a layout share one tuple."""
    if not inner:
        return sites
    key = (id(sites), id(inner))
    known = _WITH_INSIDE.get(key)
    if known is None or known[0] is not sites or known[1] is not inner:
        extra = tuple((name, site, None, True) if site.op is not None else (name, site, None, False, attention)
                      for name, site in inner.items())
        known = _WITH_INSIDE[key] = (sites, inner, (*extra, *sites))
    return known[2]


_WITH_INSIDE: dict[tuple[int, int], tuple] = ProcessCache()


#: The q/k norms' roles, and the value whose site says how each norm receives its input.
QK_ROLES = {"query_norm": "query_states_before_norm", "key_norm": "key_states_before_norm"}


def norm_heads_first(attention: torch.nn.Module, path: str, role: str) -> bool:
    """Whether the attention calls the q/k norm of ``role`` on a heads-first tensor (`inside_sites` reads it)."""
    site = inside_sites(attention, path)[0].get(QK_ROLES[role])
    return site is not None and site.heads_first
