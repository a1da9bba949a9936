"""Gemma Scope transcoders (Google DeepMind's, on Gemma-2 and Gemma-3) read as nncanon's transcoders, as
circuit-tracer reads them.

- Gemma Scope 2 per-layer transcoders (`read_transcoder` of a folder): one folder per layer,
  ``transcoder_all/layer_<L>_width_<W>_l0_<size>[_affine]``, holding ``params.safetensors`` (``w_enc [d, F]``,
  ``b_enc [F]``, ``threshold [F]``, ``w_dec [F, d]``, ``b_dec [d]``; with ``_affine`` also
  ``affine_skip_connection [d, d]``, added as ``x @ affine_skip_connection``) and ``config.json``
  (``hf_hook_point_in`` / ``hf_hook_point_out``: ``model.layers.<L>.pre_feedforward_layernorm.output`` and
  ``model.layers.<L>.post_feedforward_layernorm.output``, ``width``, ``architecture: "jump_relu"``,
  ``affine_connection``, ``type: "transcoder"``, ``l0``, ``model_name``). Features are JumpReLU,
  ``pre · [pre > threshold]`` with ``pre = x @ w_enc + b_enc``.
- Gemma Scope 2 cross-layer transcoders (`read_clt`): ``clt/width_<W>_l0_<size>[_affine]/params_layer_<i>
  .safetensors``, one per layer: ``w_enc [d, F]``, ``b_enc [F]``, ``threshold [F]``, ``b_dec [d]`` (layer ``i``'s
  reconstruction bias), ``w_dec [F, n_layers, d]`` (layer ``i``'s features into every layer; the columns before
  ``i`` are not read, as circuit-tracer's ``w_dec[i, :, i:]``), optional ``affine_skip_connection [d, d]``.
- Gemma Scope 1 transcoders: ``layer_<L>/width_<W>/average_l0_<n>/params.npz`` (``W_enc [d, F]``, ``b_enc``,
  ``threshold``, ``W_dec [F, d]``, ``b_dec``), reading ``ln2.hook_normalized`` and writing ``hook_mlp_out`` (the
  points circuit-tracer's and SAELens's configs give them).

Gemma Scope 2 names its points by Gemma-3's modules; `POINTS` turns each into the TransformerLens name the one name
table (`nncanon.sae.resolve`) resolves: ``pre_feedforward_layernorm.output`` is the MLP module's input (the norm's
output, its weight applied: ``mlp.hook_in``, nncanon's ``mlp_input``), ``post_feedforward_layernorm.output`` what
the MLP adds to the stream (after the post-norm: ``hook_mlp_out``, ``mlp_output``). A point with no entry is refused
by name. Every refusal is `nncanon.InvalidDictionary` naming the file and the field.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InvalidDictionary
from ..sae import Dictionary
from ..sae.config_types import parse_config_bytes
from ..sae.dictionary import _read_weights, header_shapes
from .coders import CrossLayerTranscoder

#: Gemma Scope 2's points (the module of Gemma-3's block and ``.input`` / ``.output``, after
#: ``model.layers.<L>.``) as TransformerLens names of the name table. The MLP module's input is the pre-norm's output;
#: what the block adds is the post-norm's output.
POINTS = {"pre_feedforward_layernorm.output": "mlp.hook_in", "mlp.input": "mlp.hook_in",
          "pre_feedforward_layernorm.input": "hook_resid_mid", "post_feedforward_layernorm.output": "hook_mlp_out",
          "input": "hook_resid_pre", "output": "hook_resid_post"}

#: Points refused by name, with the reason.
REFUSED = {"mlp.output": "the MLP module's output, before the post-feedforward norm: a graph's transcoder writes what "
                         "the block adds to the stream, post_feedforward_layernorm.output (mlp_output), and nncanon "
                         "does not read one trained on the value before the norm as one trained after it"}

#: Where Gemma Scope 1's transcoders read and write (circuit-tracer's and SAELens's configs for them).
GEMMA_SCOPE_1 = ("ln2.hook_normalized", "hook_mlp_out")

PARAMS, CONFIG, NPZ = "params.safetensors", "config.json", "params.npz"
_POINT = re.compile(r"model\.(?:language_model\.)?layers\.(\d+|\{layer\})\.(.+)")
_LAYER_FILE = re.compile(r"params_layer_(\d+)\.safetensors")


def is_gemma_scope(path: Path) -> bool:
    """Whether ``path`` is in a Gemma Scope layout (a folder with ``params.safetensors`` or ``params.npz``, an
    ``.npz``, a ``.safetensors`` whose tensors are named ``w_enc``...): what `read_transcoder` reads."""
    if path.is_dir():
        return (path / PARAMS).is_file() or (path / NPZ).is_file()
    if path.suffix == ".npz":
        return True
    return path.suffix == ".safetensors" and path.is_file() and "w_enc" in header_shapes(path)


def read_transcoder(path: Path, layer: int, points: tuple[str, str] | None = None, *,
                    dtype: torch.dtype | None = None) -> Dictionary:
    """One layer's Gemma Scope transcoder (a Gemma Scope 2 folder or ``params.safetensors``, a Gemma Scope 1 folder
    or ``params.npz``) as a `Dictionary` reading and writing at block ``layer``.

    ``points``: the (read, write) TransformerLens names a circuit-tracer config gives; a Gemma Scope 2
    ``config.json`` beside the weights must name the same (its `POINTS`). Without either, a Gemma Scope 2 folder
    needs its ``config.json``; a Gemma Scope 1 file reads `GEMMA_SCOPE_1`.

    Raises:
        InvalidDictionary: a missing file, a truncated one, a field missing or of another JSON type, shapes that
            disagree, NaN or negative thresholds, a point of another block or one `POINTS` does not map.
    """
    folder = path if path.is_dir() else path.parent
    npz = path / NPZ if path.is_dir() and not (path / PARAMS).is_file() else path
    if npz.suffix == ".npz":
        weights, found = _npz(npz), points or GEMMA_SCOPE_1
    else:
        file = path / PARAMS if path.is_dir() else path
        config = folder / CONFIG
        if not file.is_file():
            raise InvalidDictionary(f"the Gemma Scope transcoder file {file} does not exist")
        cfg = _config(config, layer) if config.is_file() else None
        if cfg is None and points is None:
            raise InvalidDictionary(f"{folder} has {PARAMS} but no {CONFIG}: Gemma Scope 2's config.json names where "
                                    "the transcoder reads and writes (hf_hook_point_in, hf_hook_point_out)")
        if cfg is not None and points is not None and cfg["points"] != tuple(points):
            raise InvalidDictionary(f"{config} names {cfg['points']} (hf_hook_point_in, hf_hook_point_out) but the "
                                    f"circuit-tracer config names {tuple(points)}: one of the two is wrong")
        found = points if cfg is None else cfg["points"]
        weights = _params(file, ("w_enc", "b_enc", "threshold", "w_dec", "b_dec"), ("affine_skip_connection",))
        if weights["w_dec"].dim() != 2:
            raise InvalidDictionary(f"{file}: w_dec is {tuple(weights['w_dec'].shape)}, one layer of a cross-layer "
                                    "transcoder (params_layer_<i>.safetensors), not a per-layer transcoder's [F, d]")
        _agree(weights, cfg, config, file)
        weights = {"W_enc": weights["w_enc"], "b_enc": weights["b_enc"], "W_dec": weights["w_dec"],
                   "b_dec": weights["b_dec"], "threshold": weights["threshold"],
                   **({"W_skip": weights["affine_skip_connection"].T}
                      if "affine_skip_connection" in weights else {})}
    reads, writes = found
    skip = "W_skip" in weights
    return Dictionary.from_tensors(
        **weights, architecture="jumprelu_skip_transcoder" if skip else "jumprelu_transcoder",
        hook_name=f"blocks.{layer}.{reads}", hook_name_out=f"blocks.{layer}.{writes}",
        name=folder.name if path.is_dir() or path.name in (PARAMS, NPZ) else path.stem).to(dtype=dtype)


def read_clt(folder: Path, points: tuple[str, str] | None = None, *, name: str | None = None,
             files: list[Path] | None = None) -> CrossLayerTranscoder:
    """A Gemma Scope 2 cross-layer transcoder: ``folder``'s ``params_layer_<i>.safetensors`` (or ``files``, in layer
    order, as a circuit-tracer config lists them), reading and writing ``points`` (TransformerLens names; default:
    the folder's ``config.json``, without which the files are refused: they do not say where they read).

    Raises:
        InvalidDictionary: no layer files, a layer missing, files of other widths, a missing field, NaN or negative
            thresholds, a skip connection in some layers only.
    """
    if files is None:
        numbered = {int(m.group(1)): folder / m.group(0) for m in map(_LAYER_FILE.fullmatch,
                                                                      (p.name for p in folder.iterdir())) if m}
        if not numbered:
            raise InvalidDictionary(f"{folder} holds no params_layer_<i>.safetensors: not a Gemma Scope 2 "
                                    "cross-layer transcoder folder")
        missing = sorted(set(range(max(numbered) + 1)) - set(numbered))
        if missing:
            raise InvalidDictionary(f"{folder} has params_layer_<i>.safetensors up to {max(numbered)} but not for "
                                    f"layers {missing}: a cross-layer transcoder has one file per layer from 0")
        files = [numbered[i] for i in range(len(numbered))]
    elif not files:
        raise InvalidDictionary(f"{folder}: the cross-layer transcoder's config lists no files")
    else:
        files = _as_circuit_tracer_reads(files)
    config = folder / CONFIG
    if points is None and not config.is_file():
        raise InvalidDictionary(f"{folder} has no {CONFIG}: Gemma Scope 2's CLT files do not say where they read and "
                                "write; load them through a circuit-tracer config.yaml (feature_input_hook, "
                                "feature_output_hook, transcoders: the files) or put the folder's config.json beside")
    if points is None:
        points = _config(config, None)["points"]
    n_layers = len(files)
    layers = []
    for index, file in enumerate(files):
        if not file.is_file():
            raise InvalidDictionary(f"the Gemma Scope 2 CLT file {file} (layer {index}) does not exist")
        w = _params(file, ("w_enc", "b_enc", "threshold", "w_dec", "b_dec"), ("affine_skip_connection",))
        d, width = w["w_enc"].shape
        if w["w_dec"].dim() != 3 or tuple(w["w_dec"].shape) != (width, n_layers, d):
            raise InvalidDictionary(f"{file}: w_dec is {tuple(w['w_dec'].shape)}, not {(width, n_layers, d)} "
                                    f"(features, the {n_layers} layers of the set, width)")
        if layers and tuple(w["w_enc"].shape) != tuple(layers[0]["w_enc"].shape):
            raise InvalidDictionary(f"{file}: w_enc is {tuple(w['w_enc'].shape)} but layer 0's is "
                                    f"{tuple(layers[0]['w_enc'].shape)}: the layers of a CLT have one width")
        if layers and ("affine_skip_connection" in w) != ("affine_skip_connection" in layers[0]):
            raise InvalidDictionary(f"{file}: affine_skip_connection is in some layers' files and not in others")
        dtype = (layers[0] if layers else w)["w_enc"].dtype
        w = {key: tensor.to(dtype) for key, tensor in w.items()}
        w["w_dec"] = w["w_dec"][:, index:].contiguous()  # into layers index..: the earlier columns are not read
        layers.append(w)
    skip = "affine_skip_connection" in layers[0]
    clt = CrossLayerTranscoder(
        W_enc=torch.stack([w["w_enc"] for w in layers]), b_enc=torch.stack([w["b_enc"] for w in layers]),
        W_dec=[w["w_dec"] for w in layers],
        b_dec=torch.stack([w["b_dec"] for w in layers]), threshold=torch.stack([w["threshold"] for w in layers]),
        W_skip=torch.stack([w["affine_skip_connection"] for w in layers]) if skip else None,
        feature_input_hook=points[0], feature_output_hook=points[1], name=name or folder.name)
    return clt


def _as_circuit_tracer_reads(files: list[Path]) -> list[Path]:
    """The files of a CLT a circuit-tracer config lists: its Gemma Scope 2 configs list one file more than the
    layers the weights decode into (``w_dec [F, n_layers, d]``), and circuit-tracer 0.5.0 reads the first
    ``n_layers`` (``range(max(paths))``); nncanon reads them so, and refuses any other count by the shape check."""
    if files and files[0].is_file():
        shape = header_shapes(files[0]).get("w_dec", ())
        if len(shape) == 3 and len(files) == shape[1] + 1:
            return files[:-1]
    return files


def _params(file: Path, needed: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``file``'s tensors (Gemma Scope 2's names), each present, floating, finite, with shapes that fit
    (``w_enc [d, F]`` and the rest), thresholds not negative."""
    shapes = header_shapes(file)  # a truncated header is refused here, before any tensor is read
    missing = [key for key in needed if key not in shapes]
    unknown = sorted(set(shapes) - set(needed) - set(optional))
    if missing or unknown:
        raise InvalidDictionary(f"{file} is not in Gemma Scope 2's layout: "
                                + (f"it has no {', '.join(missing)} " if missing else "")
                                + (f"it holds tensors nncanon does not read ({', '.join(unknown)}) " if unknown else "")
                                + f"(it holds {sorted(shapes)}; Gemma Scope 2 writes {', '.join(needed + optional)})")
    weights = _read_weights(file, "cpu")
    _check(weights, file)
    return weights


def _npz(file: Path) -> dict[str, torch.Tensor]:
    """A Gemma Scope 1 ``params.npz`` as `Dictionary.from_tensors` takes it."""
    if not file.is_file():
        raise InvalidDictionary(f"the Gemma Scope transcoder file {file} does not exist")
    try:
        with np.load(file, allow_pickle=False) as raw:
            arrays = {key: raw[key] for key in raw.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise InvalidDictionary(f"{file} cannot be read as an .npz ({file.stat().st_size} bytes: {error}); the file "
                                "is truncated or not Gemma Scope's params.npz: download it again") from None
    lower = {key.lower(): key for key in arrays}
    missing = [key for key in ("w_enc", "b_enc", "threshold", "w_dec", "b_dec") if key not in lower]
    if missing:
        raise InvalidDictionary(f"{file} has no {', '.join(missing)} (it holds {sorted(arrays)}): not Gemma Scope's "
                                "params.npz (W_enc, b_enc, threshold, W_dec, b_dec)")
    try:
        weights = {key: torch.from_numpy(np.ascontiguousarray(arrays[lower[key]])) for key in lower}
    except TypeError as error:
        raise InvalidDictionary(f"{file}: an array is not numeric ({error})") from None
    _check(weights, file)
    return {"W_enc": weights["w_enc"], "b_enc": weights["b_enc"], "W_dec": weights["w_dec"],
            "b_dec": weights["b_dec"], "threshold": weights["threshold"]}


def _check(w: dict[str, torch.Tensor], file: Path) -> None:
    """Shapes that fit one another, floating finite values, thresholds not negative; `InvalidDictionary` naming the
    file and the field otherwise."""
    for key, tensor in w.items():
        if not tensor.is_floating_point():
            raise InvalidDictionary(f"{file}: {key} is {tensor.dtype}, not a floating-point tensor")
        if not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise InvalidDictionary(f"{file}: {key} holds {count} NaN or infinite value(s) of {tensor.numel()}")
    if w["w_enc"].dim() != 2:
        raise InvalidDictionary(f"{file}: w_enc is {tuple(w['w_enc'].shape)}, not [d_model, width]")
    d, width = w["w_enc"].shape
    expected = {"b_enc": (width,), "threshold": (width,), "b_dec": (d,), "affine_skip_connection": (d, d)}
    if w["w_dec"].dim() == 2:
        expected["w_dec"] = (width, d)
    elif w["w_dec"].dim() != 3 or w["w_dec"].shape[0] != width or w["w_dec"].shape[2] != d:
        raise InvalidDictionary(f"{file}: w_dec is {tuple(w['w_dec'].shape)}, not [{width}, {d}] (a transcoder) or "
                                f"[{width}, n_layers, {d}] (a cross-layer transcoder)")
    for key, shape in expected.items():
        if key in w and tuple(w[key].shape) != shape:
            raise InvalidDictionary(f"{file}: {key} is {tuple(w[key].shape)}, not {shape} (w_enc is [{d}, {width}]): "
                                    "the widths disagree")
    negative = int((w["threshold"] < 0).sum())
    if negative:
        raise InvalidDictionary(f"{file}: threshold holds {negative} negative value(s): there Gemma Scope's JumpReLU "
                                "(relu(pre) · [pre > threshold]) and circuit-tracer's (pre · [pre > threshold]) "
                                "give different features, so nncanon reads neither")


def _config(path: Path, layer: int | None) -> dict[str, Any]:
    """A Gemma Scope 2 ``config.json``'s points (TransformerLens names), checked for JSON types and for its block
    (``layer``; ``None``: any block, as a CLT folder's)."""
    raw = parse_config_bytes(path.read_bytes(), str(path))
    for key, kind in (("hf_hook_point_in", str), ("hf_hook_point_out", str), ("architecture", str), ("type", str),
                      ("width", int), ("affine_connection", bool)):
        value = raw.get(key)
        if key in ("hf_hook_point_in",) and value is None:
            raise InvalidDictionary(f"{path} has no hf_hook_point_in: not a Gemma Scope 2 config.json")
        if value is not None and (type(value) is not kind):
            raise InvalidDictionary(f"{path}: {key} is the JSON {type(value).__name__} {json.dumps(value)}, not a "
                                    f"{'true/false' if kind is bool else 'number' if kind is int else 'string'}")
    if raw.get("hf_hook_point_out") is None:
        raise InvalidDictionary(f"{path} names no hf_hook_point_out: it is a sparse autoencoder of "
                                f"{raw['hf_hook_point_in']}, not a transcoder (Gemma Scope 2's transcoders name both)")
    if raw.get("architecture", "jump_relu") != "jump_relu":
        raise InvalidDictionary(f"{path}: architecture is {raw['architecture']!r}; Gemma Scope 2's are 'jump_relu'")
    if raw.get("width") is not None and raw["width"] < 1:
        raise InvalidDictionary(f"{path}: width is {raw['width']}, not a positive number of features")
    points = tuple(_point(path, key, raw[key], layer) for key in ("hf_hook_point_in", "hf_hook_point_out"))
    return {"points": points, "width": raw.get("width"), "affine": raw.get("affine_connection")}


def _point(path: Path, key: str, value: str, layer: int | None) -> str:
    found = _POINT.fullmatch(value)
    if found is not None and found.group(2) in REFUSED:
        raise InvalidDictionary(f"{path}: {key} is {value!r}, {REFUSED[found.group(2)]}")
    if found is None or found.group(2) not in POINTS:
        raise InvalidDictionary(f"{path}: {key} is {value!r}; nncanon maps Gemma Scope 2's points "
                                f"model.layers.<L>.{{{', '.join(POINTS)}}}")
    if layer is not None and found.group(1) != str(layer):
        raise InvalidDictionary(f"{path}: {key} is {value!r}, a point of block {found.group(1)}, but the transcoder "
                                f"is the set's layer {layer}")
    return POINTS[found.group(2)]


def _agree(weights: dict[str, torch.Tensor], cfg: dict | None, config: Path, file: Path) -> None:
    """The config's ``width`` and ``affine_connection`` are the weights'."""
    if cfg is None:
        return
    width = weights["w_enc"].shape[1]
    if cfg["width"] is not None and cfg["width"] != width:
        raise InvalidDictionary(f"{config}: width is {cfg['width']} but {file.name}'s w_enc has {width} features")
    if cfg["affine"] is not None and cfg["affine"] != ("affine_skip_connection" in weights):
        raise InvalidDictionary(f"{config}: affine_connection is {str(cfg['affine']).lower()} but {file.name} "
                                f"{'has' if 'affine_skip_connection' in weights else 'has no'} affine_skip_connection")
