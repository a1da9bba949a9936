"""Graphs and transcoder sets in circuit-tracer's formats.

- `write_graph_json`: the graph JSON circuit-tracer's frontend and Neuronpedia's graph viewer read (circuit-tracer's
  ``create_graph_files``: the graph pruned by influence, its nodes and links, ``graph-metadata.json`` beside it),
  each file written whole or not at all, one writer of a folder at a time (`nncanon.files`).
- `load_transcoders`: a circuit-tracer transcoder set (a YAML config naming ``feature_input_hook``,
  ``feature_output_hook`` as TransformerLens hook names and one file per layer: ``.safetensors`` in its ReLU
  layout, ``W_enc [d_sae, d_model]``, ``W_dec [d_sae, d_model]``, optional ``W_skip`` and JumpReLU's
  ``activation_function.threshold``; or a Gemma Scope ``.npz`` with ``threshold``), as `nncanon.sae.Dictionary`
  transcoders reading the names through the one name table; or a cross-layer transcoder (``model_kind:
  cross_layer_transcoder``: `load_clt`).
- `load_clt`, `save_clt`: circuit-tracer's cross-layer transcoder folder (``W_enc_<i>.safetensors`` holding
  ``W_enc_<i> [F, d]``, ``b_enc_<i> [F]``, ``b_dec_<i> [d]``, optional ``threshold_<i> [F]``;
  ``W_dec_<i>.safetensors`` holding ``W_dec_<i> [F, n_layers - i, d]``) as a
  `nncanon.graphs.coders.CrossLayerTranscoder`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

from .. import files
from ..errors import CannotWrite, InvalidArgument, InvalidDictionary
from ..sae import Dictionary
from .coders import CrossLayerTranscoder
from .graph import Graph
from .prune import prune


def _token(text: str) -> str:
    return text.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def _nodes(graph: Graph, node_mask: torch.Tensor, scores: torch.Tensor, decode: Any,
           n_features_per_layer: int | None) -> dict[int, dict]:
    """The frontend's node records of the kept nodes, by node index."""
    nodes: dict[int, dict] = {}
    errors_end = graph.n_features + graph.n_pos * graph.n_layers
    tokens_end = errors_end + graph.n_pos
    offset = 10 ** math.ceil(math.log10(n_features_per_layer)) if n_features_per_layer else 0
    for index in node_mask.nonzero().flatten().tolist():
        influence = float(scores[index])
        if index < graph.n_features:
            active = graph.selected_features[index]
            layer, pos, feature = graph.active_features[active].tolist()
            node = {"node_id": f"{layer}_{feature}_{pos}", "feature": feature + offset * layer, "layer": str(layer),
                    "ctx_idx": pos, "feature_type": "cross layer transcoder", "jsNodeId": f"{layer}_{feature}-0",
                    "activation": float(graph.activation_values[active])}
        elif index < errors_end:
            layer, pos = divmod(index - graph.n_features, graph.n_pos)
            # (circuit-tracer's ids: feature -1 in them, so no feature's node_id or jsNodeId is an error's)
            node = {"node_id": f"{layer}_-1_{pos}", "feature": -1, "layer": str(layer), "ctx_idx": pos,
                    "feature_type": "mlp reconstruction error", "jsNodeId": f"{layer}_-1-{pos}"}
        elif index < tokens_end:
            pos = index - errors_end
            vocab = int(graph.input_tokens[pos])
            node = {"node_id": f"E_{vocab}_{pos}", "feature": pos, "layer": "E", "ctx_idx": pos,
                    "feature_type": "embedding", "jsNodeId": f"E_{vocab}-{pos}"}
        else:
            k = index - tokens_end
            vocab, prob = int(graph.logit_targets[k]), float(graph.logit_probabilities[k])
            layer, pos = str(graph.n_layers + 1), graph.n_pos - 1
            node = {"node_id": f"{layer}_{vocab}_{pos}", "feature": vocab, "layer": layer, "ctx_idx": pos,
                    "feature_type": "logit", "token_prob": prob, "is_target_logit": k == 0,
                    "jsNodeId": f"L_{vocab}-{pos}", "clerp": f'Output "{_token(decode(vocab))}" (p={prob:.3f})'}
        defaults = {"token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0, "clerp": "",
                    "influence": influence, "activation": None}
        nodes[index] = {**defaults, **node}
    return nodes


def graph_json(graph: Graph, slug: str, tokenizer: Any, scan: str | list[str] | None = None,
               node_threshold: float = 0.8, edge_threshold: float = 0.98,
               n_features_per_layer: int | None = None) -> dict:
    """The frontend's graph record (``metadata``, ``qParams``, ``nodes``, ``links``) of ``graph`` pruned by
    influence (`nncanon.graphs.prune`)."""
    scan = scan if scan is not None else (graph.scan or f"nncanon-{graph.cfg.get('model_type', 'model')}")
    node_mask, edge_mask, scores = prune(graph, node_threshold, edge_threshold)
    def decode(token: int) -> str:
        return tokenizer.decode([token])
    nodes = _nodes(graph, node_mask, scores, decode, n_features_per_layer)
    targets, sources = edge_mask.nonzero(as_tuple=True)
    weights = graph.adjacency_matrix[targets, sources].tolist()
    links = [{"source": nodes[s]["node_id"], "target": nodes[t]["node_id"], "weight": w}
             for s, t, w in zip(sources.tolist(), targets.tolist(), weights, strict=True) if s in nodes and t in nodes]
    connected = {link["source"] for link in links} | {link["target"] for link in links}
    used = [node for node in nodes.values()
            if node["node_id"] in connected or node["feature_type"] in ("embedding", "logit")]
    transcoders = list(scan) if isinstance(scan, list) else []
    metadata = {"slug": slug, "scan": scan if isinstance(scan, str) else "custom-" + "-".join(scan),
                "transcoder_list": transcoders,
                "prompt_tokens": [_token(decode(int(t))) for t in graph.input_tokens],
                "prompt": graph.input_string, "node_threshold": node_threshold}
    return {"metadata": metadata,
            "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
            "nodes": used, "links": links}


#: The folder's list of graphs (circuit-tracer's frontend shows it), and the lock of a folder's writers.
LISTING, LOCK = "graph-metadata.json", ".nncanon-graph.lock"

#: Seconds a writer waits for another writing the same folder before `CannotWrite` names it.
LOCK_WAIT = 30.0


def check_slug(slug: str) -> None:
    """`InvalidArgument` unless ``slug`` names a file in the folder (no separator, not hidden, not empty)."""
    if (not isinstance(slug, str) or not slug or slug.startswith(".") or "/" in slug or os.sep in slug
            or "\0" in slug):
        raise InvalidArgument(f"the graph's slug {slug!r} must name a file in the folder: no '/', not empty, not "
                              "starting with '.'")


def read_listing(out_dir: str | os.PathLike) -> dict:
    """The folder's ``graph-metadata.json`` (``{"graphs": [metadata, ...]}``; an empty list where there is none).

    Raises:
        CannotWrite: a listing that is not a regular file (a FIFO, a link), or not the JSON nncanon and
            circuit-tracer write (cut or edited): a new graph cannot be added to it.
    """
    path = Path(out_dir) / LISTING
    if not os.path.lexists(path):
        return {"graphs": []}
    data = files.read_regular(path, "the folder's list of graphs", CannotWrite)
    try:
        listing = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        listing = error
    if not (isinstance(listing, dict) and isinstance(listing.get("graphs"), list)
            and all(isinstance(g, dict) for g in listing["graphs"])):
        what = f"not valid JSON ({listing})" if isinstance(listing, Exception) else 'not {"graphs": [...]}'
        raise CannotWrite(f"{path} is not a list of graphs nncanon or circuit-tracer wrote: it is {what}; it was cut "
                          "or edited. Move it away, or write into another folder")
    return listing


def graph_files(graph: Graph, out_dir: str | os.PathLike, slug: str, tokenizer: Any, **options: Any
                ) -> dict[str, bytes]:
    """The files `write_graph_json` writes: ``<slug>.json`` (`graph_json`) and the folder's listing with the graph's
    entry (an entry of the same slug replaced), by name, the listing last."""
    check_slug(slug)
    record = graph_json(graph, slug, tokenizer, **options)
    listing = read_listing(out_dir)
    listing["graphs"] = [g for g in listing["graphs"] if g.get("slug") != slug] + [record["metadata"]]
    return {f"{slug}.json": json.dumps(record, indent=2).encode("utf-8"),
            LISTING: json.dumps(listing, indent=2).encode("utf-8")}


def writing(out_dir: str | os.PathLike, wait: float | None = None) -> Any:
    """A context holding ``out_dir``'s writers' lock (created, checked: `nncanon.files.folder_problem`), waiting up to
    ``wait`` seconds (default `LOCK_WAIT`) for another writer; `CannotWrite` naming the path where it cannot."""
    out = Path(out_dir)
    problem = files.folder_problem(out)
    if problem is not None:
        raise CannotWrite(f"{os.fspath(out_dir)}: {problem}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CannotWrite(f"{os.fspath(out_dir)} cannot be created ({error.strerror})") from None
    return files.locked(out, LOCK, CannotWrite, "two writers of one graph folder would mix their listings; wait for "
                        "the other to finish, or write into another folder", LOCK_WAIT if wait is None else wait)


def write_graph_json(graph: Graph, out_dir: str | os.PathLike, slug: str, tokenizer: Any, **options: Any) -> Path:
    """Write ``<out_dir>/<slug>.json`` (`graph_json`) and add it to ``<out_dir>/graph-metadata.json`` (the list
    the frontend shows: an entry of the same slug is replaced, the others kept); returns the graph file's path.

    Each file is written whole or not at all (a temporary file renamed over its name, the listing last), one
    writer of the folder at a time (`writing`).

    Raises:
        CannotWrite: ``out_dir`` is a symbolic link, a FIFO, a file or read-only; a listing there that is cut or
            edited; a full disk; another writer holding the folder longer than `LOCK_WAIT`.
        InvalidArgument: a slug that does not name a file in the folder.
    """
    check_slug(slug)
    out = Path(out_dir)
    if out.is_dir() and not out.is_symlink():
        read_listing(out)  # (a listing that cannot take the graph refused before the folder's lock file is made)
    with writing(out):
        files.write_all(out, graph_files(graph, out, slug, tokenizer, **options), CannotWrite, "write_graph_json")
    return out / f"{slug}.json"


def load_transcoders(config: str | os.PathLike, *, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None) -> list[Dictionary] | CrossLayerTranscoder:
    """A circuit-tracer transcoder set from its YAML config (local files; ``filepath`` relative to the config), or
    its cross-layer transcoder (``model_kind: cross_layer_transcoder``: the folder's safetensors beside the config,
    or in its ``subfolder``; `load_clt`).

    Raises:
        InvalidDictionary: a config or file that is missing or not in circuit-tracer's layout, a remote
            (``hf://``) path, layers missing from the set.
    """
    path = Path(config)
    if not path.is_file():
        raise InvalidDictionary(f"the transcoder config {os.fspath(config)!r} does not exist")
    try:
        cfg = yaml.safe_load(path.read_text())
        if isinstance(cfg, dict) and cfg.get("model_kind") == "cross_layer_transcoder":
            folder = path.parent / str(cfg.get("subfolder") or "")
            return load_clt(folder, feature_input_hook=cfg.get("feature_input_hook", "hook_resid_mid"),
                            feature_output_hook=cfg.get("feature_output_hook", "hook_mlp_out"),
                            name=str(cfg.get("scan") or folder.name), device=device, dtype=dtype)
        entries = sorted(cfg["transcoders"], key=lambda entry: int(entry["layer"]))
        reads, writes = cfg["feature_input_hook"], cfg["feature_output_hook"]
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as error:
        raise InvalidDictionary(f"{path} is not a circuit-tracer transcoder config (feature_input_hook, "
                                f"feature_output_hook, transcoders: [{{id, layer, filepath}}]): {error}") from None
    layers = [int(entry["layer"]) for entry in entries]
    if layers != list(range(len(layers))):
        raise InvalidDictionary(f"{path} has transcoders for layers {layers}: a set has one per layer from 0")
    out = []
    for entry in entries:
        file = str(entry["filepath"])
        if "://" in file:
            raise InvalidDictionary(f"{path}: {file} is remote; nncanon reads local files (download it and give its "
                                    "path, relative to the config)")
        layer = int(entry["layer"])
        weights = _read_layer(path.parent / file)
        architecture = (("jumprelu_" if "threshold" in weights else "")
                        + ("skip_transcoder" if "W_skip" in weights else "transcoder"))
        out.append(Dictionary.from_tensors(
            **weights, architecture=architecture,
            hook_name=f"blocks.{layer}.{_hook(reads)}", hook_name_out=f"blocks.{layer}.{_hook(writes)}",
            name=str(entry.get("id", f"layer-{layer}"))).to(device=device, dtype=dtype))
    return out


def _hook(name: str) -> str:
    """circuit-tracer's MLP wrapper hooks as the name table's names (its ``mlp.hook_in`` is the MLP module's input,
    a name of the table; its ``mlp.hook_out`` the MLP's contribution, ``hook_mlp_out``)."""
    return {"mlp.hook_out": "hook_mlp_out"}.get(name, name)


def _read_layer(file: Path) -> dict[str, torch.Tensor]:
    """One layer's weights as `Dictionary.from_tensors` takes them."""
    if not file.is_file():
        raise InvalidDictionary(f"the transcoder file {file} does not exist")
    if file.suffix == ".npz":
        raw = {key: torch.from_numpy(value) for key, value in np.load(file).items()}
        weights = {"W_enc": raw["W_enc"], "b_enc": raw["b_enc"], "W_dec": raw["W_dec"], "b_dec": raw["b_dec"],
                   "threshold": raw["threshold"]}
    else:
        raw = load_file(str(file))
        if "W_enc" not in raw or "W_dec" not in raw:
            raise InvalidDictionary(f"{file} has no W_enc or W_dec (it holds {sorted(raw)})")
        weights = {"W_enc": raw["W_enc"].T.contiguous(), "W_dec": raw["W_dec"],  # circuit-tracer's to_safetensors
                   "b_enc": raw.get("b_enc"), "b_dec": raw.get("b_dec")}
        if raw.get("W_skip") is not None:
            weights["W_skip"] = raw["W_skip"]
        threshold = raw.get("activation_function.threshold", raw.get("threshold"))
        if threshold is not None:
            weights["threshold"] = threshold
    return weights


def load_clt(folder: str | os.PathLike, *, feature_input_hook: str = "hook_resid_mid",
             feature_output_hook: str = "hook_mlp_out", name: str | None = None, device: str | torch.device = "cpu",
             dtype: torch.dtype | None = None) -> CrossLayerTranscoder:
    """circuit-tracer's cross-layer transcoder folder (``W_enc_<i>`` / ``W_dec_<i>`` safetensors; module docstring).

    Raises:
        InvalidDictionary: no ``W_enc_0.safetensors``, layers missing, a file without its tensors.
    """
    root = Path(folder)
    count = len(list(root.glob("W_enc_*.safetensors")))
    if count == 0:
        raise InvalidDictionary(f"{root} holds no W_enc_<layer>.safetensors: not a circuit-tracer cross-layer "
                                "transcoder folder")
    enc, dec, b_enc, b_dec, thresholds = [], [], [], [], []
    for layer in range(count):
        files = root / f"W_enc_{layer}.safetensors", root / f"W_dec_{layer}.safetensors"
        missing = [str(file.name) for file in files if not file.is_file()]
        if missing:
            raise InvalidDictionary(f"{root} has {count} encoder files but not {', '.join(missing)}")
        one, two = load_file(str(files[0])), load_file(str(files[1]))
        try:
            enc.append(one[f"W_enc_{layer}"].T)
            b_enc.append(one[f"b_enc_{layer}"])
            b_dec.append(one[f"b_dec_{layer}"])
            thresholds.append(one.get(f"threshold_{layer}"))
            dec.append(two[f"W_dec_{layer}"])
        except KeyError as error:
            raise InvalidDictionary(f"{root}: layer {layer}'s files have no {error}") from None
    if any(t is None for t in thresholds) and not all(t is None for t in thresholds):
        raise InvalidDictionary(f"{root}: some layers have a JumpReLU threshold and others none")
    threshold = None if thresholds[0] is None else torch.stack([t.reshape(-1) for t in thresholds])
    clt = CrossLayerTranscoder(torch.stack(enc).contiguous(), torch.stack(b_enc), dec, torch.stack(b_dec),
                               threshold, None, feature_input_hook, feature_output_hook, name or root.name)
    return clt.to(device=device, dtype=dtype)


def save_clt(clt: CrossLayerTranscoder, folder: str | os.PathLike, *, scan: str | None = None) -> Path:
    """Write ``clt`` in circuit-tracer's layout (its ``to_safetensors``) with a ``config.yaml`` (``model_kind:
    cross_layer_transcoder``, the hooks) that `load_transcoders` and circuit-tracer read; returns the config's path.
    (A skip connection is not part of the layout and is not written.)"""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    for layer in range(clt.n_layers):
        tensors = {f"W_enc_{layer}": clt.W_enc[layer].T, f"b_enc_{layer}": clt.b_enc[layer],
                   f"b_dec_{layer}": clt.b_dec[layer]}
        if clt.threshold is not None:
            tensors[f"threshold_{layer}"] = clt.threshold[layer]
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                  str(root / f"W_enc_{layer}.safetensors"))
        save_file({f"W_dec_{layer}": clt.W_dec[layer].detach().cpu().contiguous()},
                  str(root / f"W_dec_{layer}.safetensors"))
    config = {"model_kind": "cross_layer_transcoder", "scan": scan or clt.name,
              "feature_input_hook": clt.feature_input_hook, "feature_output_hook": clt.feature_output_hook}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
