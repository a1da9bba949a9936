"""A graph JSON (circuit-tracer's ``create_graph_files`` format, `nncanon.graphs.write_graph_json`) as the graph page.

The JSON holds the graph already pruned: its nodes (``node_id``, ``feature_type``, ``layer``, ``ctx_idx``,
``feature``, ``activation``, ``influence``; a logit's ``clerp`` ``Output "token" (p=...)``), its links (``source``,
``target``, ``weight``) and the prompt's tokens as text (``metadata.prompt_tokens``). `graph_json_data` turns it into
`nncanon.views.graph.graph_data`'s form, checked: a record that is cut or edited (a link to a node it does not hold,
a node without its layer or position, a weight that is no number) is `InvalidInput`, never a page drawn wrong.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import InvalidInput
from .graph import ERROR, FEATURE, LOGIT, TOKEN
from .page import Page, render, rounded

_KINDS = {"mlp reconstruction error": ERROR, "embedding": TOKEN, "logit": LOGIT}
_OUTPUT = re.compile(r'^Output "(.*)" \(p=[^)]*\)$', re.S)


def _bad(what: str) -> InvalidInput:
    return InvalidInput(f"not a graph JSON nncanon or circuit-tracer wrote ({what}): it was cut or edited")


def _integer(node: dict, key: str) -> int:
    value = node.get(key)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise _bad(f"node {node.get('node_id')!r} has {key} {value!r}, not an integer") from None
    if isinstance(value, float) and not value.is_integer():
        raise _bad(f"node {node.get('node_id')!r} has {key} {value!r}, not an integer")
    return number


def _number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{what} is {value!r}, not a number")
    return float(value)


def graph_json_data(record: Any) -> dict:
    """The graph page's data (`nncanon.views.graph.graph_data`'s form) of a graph JSON ``record`` (parsed).

    Raises:
        InvalidInput: a record without ``metadata``, ``nodes`` or ``links`` in their form, a link naming a node the
            record does not hold, a node of no layer or position, a weight that is no number.
    """
    if not isinstance(record, dict):
        raise _bad(f"it holds a {type(record).__name__}, not an object")
    metadata, nodes, links = record.get("metadata"), record.get("nodes"), record.get("links")
    if not isinstance(metadata, dict) or not isinstance(nodes, list) or not isinstance(links, list):
        raise _bad("no metadata object, nodes list and links list")
    tokens = metadata.get("prompt_tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise _bad("metadata.prompt_tokens is not a list of strings")
    if not all(isinstance(node, dict) and isinstance(node.get("node_id"), str) for node in nodes):
        raise _bad("a node without its node_id")
    logit_layers = {_integer(node, "layer") for node in nodes if node.get("feature_type") == "logit"}
    block_layers = [_integer(node, "layer") for node in nodes if node.get("feature_type") not in ("logit", "embedding")]
    n_layers = (min(logit_layers) - 1 if logit_layers else max(block_layers, default=-1) + 1)
    columns: dict[str, list] = {key: [] for key in ("kind", "layer", "pos", "feature", "act", "infl", "share")}
    index: dict[str, int] = {}
    logits: list[str] = []
    total = sum(abs(_number(node.get("influence"), "an influence") or 0.0) for node in nodes) or 1.0
    for node in nodes:
        kind = _KINDS.get(node.get("feature_type"), FEATURE)
        pos = _integer(node, "ctx_idx")
        if not 0 <= pos < max(len(tokens), 1):
            raise _bad(f"node {node['node_id']!r} is at position {pos}, but the prompt has {len(tokens)} tokens")
        act = _number(node.get("activation"), f"node {node['node_id']!r}'s activation")
        if kind == TOKEN:
            layer, feature = -1, _integer(node, "feature")
        elif kind == LOGIT:
            layer, feature = n_layers, len(logits)
            found = _OUTPUT.match(str(node.get("clerp", "")))
            logits.append(found.group(1) if found else f"#{node.get('feature')}")
            act = _number(node.get("token_prob"), f"node {node['node_id']!r}'s token_prob")
        else:
            layer = _integer(node, "layer")
            parts = node["node_id"].split("_")
            feature = int(parts[1]) if kind == FEATURE and len(parts) == 3 and parts[1].isdigit() else -1
            if kind == FEATURE and feature < 0:
                feature = _integer(node, "feature")
        if node["node_id"] in index:
            raise _bad(f"node {node['node_id']!r} appears twice")
        index[node["node_id"]] = len(columns["kind"])
        influence = _number(node.get("influence"), f"node {node['node_id']!r}'s influence") or 0.0
        for key, value in zip(columns, (kind, layer, pos, feature, None if act is None else rounded(act),
                                        rounded(influence), rounded(abs(influence) / total)), strict=True):
            columns[key].append(value)
    src, tgt, weights = [], [], []
    for link in links:
        if not isinstance(link, dict) or link.get("source") not in index or link.get("target") not in index:
            raise _bad(f"a link {link!r} names a node the record does not hold")
        weight = _number(link.get("weight"), f"the weight of the link {link['source']} -> {link['target']}")
        if weight is None or not math.isfinite(weight):
            raise _bad(f"the link {link['source']} -> {link['target']} has weight {weight!r}")
        src.append(index[link["source"]])
        tgt.append(index[link["target"]])
        weights.append(rounded(weight))
    return {"tokens": tokens, "n_layers": n_layers, "prompt": str(metadata.get("prompt", "")),
            "node_threshold": metadata.get("node_threshold"), "edge_threshold": None,
            "model": metadata.get("scan"), "scan": metadata.get("scan"), "nodes": columns, "src": src, "tgt": tgt,
            "w": weights, "contexts": {}, "logits": logits}


def graph_json_page(record: Any, title: str | None = None) -> Page:
    """The attribution graph page of a graph JSON ``record`` (parsed; pruned as it was written).

    Raises:
        InvalidInput: `graph_json_data`'s refusals (a record cut or edited).
    """
    data = graph_json_data(record)
    notes = ["Drawn from the graph JSON: the graph as it was pruned when written (its thresholds fixed)."]
    if not data["tokens"]:
        notes.append("This graph is empty: it holds no token, so there is nothing to draw.")
    name = title if title is not None else f"Attribution graph: {data['prompt']!r}"
    return render("graph", name, data, notes)
