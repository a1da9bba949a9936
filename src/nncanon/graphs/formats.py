"""Graphs and transcoder sets in circuit-tracer's formats.

- `write_graph_json`: the graph JSON circuit-tracer's frontend and Neuronpedia's graph viewer read (circuit-tracer's
  ``create_graph_files``: the graph pruned by influence, its nodes and links, ``graph-metadata.json`` beside it),
  each file written whole or not at all, one writer of a folder at a time (`nncanon.files`).
- `load_transcoders`: a circuit-tracer transcoder set (a YAML config naming ``feature_input_hook``,
  ``feature_output_hook`` as TransformerLens hook names and one file per layer: ``.safetensors`` in its ReLU
  layout, ``W_enc [d_sae, d_model]``, ``W_dec [d_sae, d_model]``, optional ``W_skip`` and JumpReLU's
  ``activation_function.threshold``; or Gemma Scope 2's ``params.safetensors`` or Gemma Scope 1's ``.npz``:
  `nncanon.graphs.gemma_scope`), as `nncanon.sae.Dictionary` transcoders reading the names through the one name
  table; or a cross-layer transcoder (``model_kind: cross_layer_transcoder``: `load_clt`, or Gemma Scope 2's
  files); a CLT's folder (circuit-tracer's or Gemma Scope 2's ``params_layer_<i>.safetensors``); a path with
  ``{layer}`` (one folder or file per block: Gemma Scope, SAELens, nncanon).
- `load_clt`, `save_clt`: circuit-tracer's cross-layer transcoder folder (``W_enc_<i>.safetensors`` holding
  ``W_enc_<i> [F, d]``, ``b_enc_<i> [F]``, ``b_dec_<i> [d]``, optional ``threshold_<i> [F]``;
  ``W_dec_<i>.safetensors`` holding ``W_dec_<i> [F, n_layers - i, d]``) as a
  `nncanon.graphs.coders.CrossLayerTranscoder`.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch
import yaml
from huggingface_hub import try_to_load_from_cache
from safetensors.torch import load_file, save_file

from .. import files
from ..errors import CannotWrite, InvalidArgument, InvalidDictionary
from ..sae import Dictionary
from ..sae.dictionary import _read_weights
from . import gemma_scope
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
            held = (graph.cfg.get("in_errors") or [[]] * graph.n_layers)[layer]
            if held:  # (sublayers no transcoder maps, in this error node: LongCat-Flash's dense MLPs)
                node["clerp"] = f"MLP error + {' + '.join(held)} outputs"
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
    """A transcoder set from local files, by its layout (`nncanon.graphs.gemma_scope` for Google's):

    - a circuit-tracer YAML config (a ``.yaml``, or a folder holding ``config.yaml``): ``feature_input_hook`` /
      ``feature_output_hook`` as TransformerLens names, ``transcoders`` a list of files (circuit-tracer 0.5's form:
      paths relative to the config, or ``hf://org/repo/file`` URIs found in the local Hugging Face cache) or of
      ``{id, layer, filepath}``; each file in circuit-tracer's layout (``.safetensors``: ``W_enc``, ``W_dec``,
      optional ``W_skip``, JumpReLU's ``activation_function.threshold``), Gemma Scope 2's (``params.safetensors``,
      its ``config.json`` beside it, when there, naming the same points) or Gemma Scope 1's (``.npz``). With
      ``model_kind: cross_layer_transcoder``: circuit-tracer's CLT folder beside the config (or in its
      ``subfolder``; `load_clt`), or Gemma Scope 2's CLT files listed in ``transcoders``.
    - a cross-layer transcoder's folder: circuit-tracer's (``W_enc_<i>.safetensors``) or Gemma Scope 2's
      (``params_layer_<i>.safetensors``, as ``clt/width_262k_l0_medium_affine``).
    - a path with ``{layer}``: one transcoder per block from 0 while the path exists: a Gemma Scope 2 folder
      (``transcoder_all/layer_{layer}_width_16k_l0_small``), a Gemma Scope 1 ``params.npz`` or its folder, a SAELens
      or nncanon dictionary folder (`nncanon.sae.Dictionary.load`), a circuit-tracer layer file.

    Raises:
        InvalidDictionary: a config or file that is missing, truncated or in none of these layouts, a field of
            another type, widths that disagree, NaN or negative thresholds, a remote file not in the local cache,
            layers missing from the set.
    """
    text = os.fspath(config)
    if "{layer}" in text:
        return _by_layer(text, device, dtype)
    path = Path(text)
    if path.is_dir():
        if (path / "config.yaml").is_file():
            path = path / "config.yaml"
        elif any(path.glob("params_layer_*.safetensors")):
            return gemma_scope.read_clt(path).to(device=device, dtype=dtype)
        elif (path / "W_enc_0.safetensors").is_file():
            return load_clt(path, device=device, dtype=dtype)
        else:
            raise InvalidDictionary(f"{path} holds no config.yaml, params_layer_<i>.safetensors or "
                                    "W_enc_0.safetensors: not a transcoder set (for one folder per layer, give a "
                                    "path with {layer})")
    if not path.is_file():
        raise InvalidDictionary(f"the transcoder config {text!r} does not exist")
    try:
        cfg = yaml.safe_load(path.read_text())
        entries = cfg.get("transcoders")
        reads, writes = cfg.get("feature_input_hook"), cfg.get("feature_output_hook")
        cross_layer = cfg.get("model_kind") == "cross_layer_transcoder"
        if cross_layer:
            files = []
        elif not isinstance(reads, str) or not isinstance(writes, str):
            raise TypeError("feature_input_hook and feature_output_hook are TransformerLens names")
        elif not isinstance(entries, list) or not entries:
            raise TypeError(f"transcoders is {type(entries).__name__}, not a list")
        else:
            files = sorted(((int(e["layer"]), str(e["filepath"]), str(e.get("id", f"layer-{e['layer']}")))
                            if isinstance(e, dict) else (layer, str(e), None) for layer, e in enumerate(entries)))
    except (yaml.YAMLError, AttributeError, KeyError, TypeError, ValueError) as error:
        raise InvalidDictionary(f"{path} is not a circuit-tracer transcoder config (feature_input_hook, "
                                f"feature_output_hook, transcoders: [files] or [{{id, layer, filepath}}]): {error}"
                                ) from None
    if cross_layer:
        return _clt_of(cfg, path, entries, reads, writes).to(device=device, dtype=dtype)
    layers = [layer for layer, _, _ in files]
    if layers != list(range(len(layers))):
        raise InvalidDictionary(f"{path} has transcoders for layers {layers}: a set has one per layer from 0")
    out = [_read_layer(_local(file, path), layer, (reads, writes), name)
           for layer, file, name in files]
    return [t.to(device=device, dtype=dtype) for t in out]


def _clt_of(cfg: dict, path: Path, entries: Any, reads: Any, writes: Any) -> CrossLayerTranscoder:
    """The cross-layer transcoder a ``model_kind: cross_layer_transcoder`` config names."""
    scan = str(cfg.get("scan") or path.parent.name)
    if isinstance(entries, list):  # Gemma Scope 2's files, one per layer (circuit-tracer reads them so)
        files = [_local(str(e), path) for e in entries]
        points = None if reads is None else (str(reads), str(writes or "hook_mlp_out"))
        return gemma_scope.read_clt(files[0].parent if files else path.parent, points, name=scan, files=files)
    folder = path.parent / str(cfg.get("subfolder") or "")
    return load_clt(folder, feature_input_hook=reads or "hook_resid_mid", feature_output_hook=writes or "hook_mlp_out",
                    name=scan)


def _by_layer(pattern: str, device: Any, dtype: torch.dtype | None) -> list[Dictionary]:
    """One transcoder per block from ``pattern`` with ``{layer}`` 0, 1, ... while the path exists."""
    out = []
    while Path(pattern.replace("{layer}", str(len(out)))).exists():
        layer = len(out)
        path = Path(pattern.replace("{layer}", str(layer)))
        if path.is_dir() and (path / "cfg.json").is_file():
            out.append(Dictionary.load(path, device=device, dtype=dtype))
        else:
            out.append(_read_layer(path, layer, None, None).to(device=device, dtype=dtype))
    if not out:
        raise InvalidDictionary(f"{pattern!r} with layer 0 ({pattern.replace('{layer}', '0')}) does not exist")
    numbered = re.compile(re.escape(pattern).replace(re.escape("{layer}"), r"(\d+)"))
    later = sorted(int(found.group(1)) for found in map(numbered.fullmatch, glob.glob(pattern.replace("{layer}", "*")))
                   if found and int(found.group(1)) > len(out))
    if later:
        raise InvalidDictionary(f"{pattern!r} exists for layers 0..{len(out) - 1}, then not for layer {len(out)}, but "
                                f"for layer {later[0]} again: a set has one transcoder per layer from 0, none missing")
    return out


def _local(file: str, config: Path) -> Path:
    """A config's entry as a local path: relative to the config, or an ``hf://org/repo/file[?revision=...]`` URI
    found in the local Hugging Face cache (nncanon downloads nothing)."""
    if not file.startswith("hf://"):
        if "://" in file:
            raise InvalidDictionary(f"{config}: {file} is remote; nncanon reads local files (download it and give its "
                                    "path, relative to the config)")
        return config.parent / file
    parsed = urlparse(file)
    repo, _, name = parsed.path.lstrip("/").partition("/")
    revision = parse_qs(parsed.query).get("revision", [None])[0]
    found = try_to_load_from_cache(f"{parsed.netloc}/{repo}", name, revision=revision) if name else None
    if not isinstance(found, str):
        raise InvalidDictionary(f"{config}: {file} is remote and not in the local Hugging Face cache; nncanon reads "
                                f"local files: download it first (hf download {parsed.netloc}/{repo} {name}), or give "
                                "its path, relative to the config")
    return Path(found)


def _read_layer(file: Path, layer: int, points: tuple[str, str] | None, name: str | None) -> Dictionary:
    """One layer's transcoder, by its file's layout (Gemma Scope's, or circuit-tracer's ``.safetensors``)."""
    if not file.exists():
        raise InvalidDictionary(f"the transcoder file {file} does not exist")
    if gemma_scope.is_gemma_scope(file):
        return gemma_scope.read_transcoder(file, layer, points)
    if file.is_dir():
        raise InvalidDictionary(f"{file} holds no params.safetensors, params.npz or cfg.json: not a Gemma Scope, "
                                "SAELens or nncanon transcoder folder")
    if points is None:
        raise InvalidDictionary(f"{file} is a circuit-tracer layer file: its config.yaml names where it reads and "
                                "writes (feature_input_hook, feature_output_hook); load the config")
    raw = _read_weights(file, "cpu")
    if "W_enc" not in raw or "W_dec" not in raw:
        raise InvalidDictionary(f"{file} has no W_enc or W_dec (it holds {sorted(raw)}): not circuit-tracer's layout "
                                "nor Gemma Scope's")
    weights = {"W_enc": raw["W_enc"].T.contiguous(), "W_dec": raw["W_dec"],  # circuit-tracer's to_safetensors
               "b_enc": raw.get("b_enc"), "b_dec": raw.get("b_dec")}
    if raw.get("W_skip") is not None:
        weights["W_skip"] = raw["W_skip"]
    threshold = raw.get("activation_function.threshold", raw.get("threshold"))
    if threshold is not None:
        weights["threshold"] = threshold
    architecture = ("jumprelu_" if "threshold" in weights else "") + ("skip_transcoder" if "W_skip" in weights
                                                                      else "transcoder")
    reads, writes = points
    return Dictionary.from_tensors(**weights, architecture=architecture, hook_name=f"blocks.{layer}.{reads}",
                                   hook_name_out=f"blocks.{layer}.{writes}", name=name or f"layer-{layer}")


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
