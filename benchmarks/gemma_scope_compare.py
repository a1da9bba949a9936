"""Gemma Scope transcoders and CLTs: nncanon's loading against circuit-tracer 0.5.0's own loaders, bit for bit.

Random weights are written in the published layouts (Gemma Scope 2's ``transcoder_all/layer_<L>_width_<W>_l0_small
[_affine]/{params.safetensors, config.json}`` and ``clt/width_<W>_l0_medium_affine/params_layer_<i>.safetensors``,
Gemma Scope 1's ``layer_<L>/width_<W>/average_l0_<n>/params.npz``); circuit-tracer's venv loads them with
``load_gemma_scope_2_transcoder``, ``load_gemma_scope_2_clt`` and ``load_gemma_scope_transcoder`` (this file run by
the venv's Python with ``--side reference``) and nncanon with ``nncanon.graphs.load_transcoders``. Compared: every
parameter (circuit-tracer's ``W_enc [F, d]`` is nncanon's ``W_enc [d, F]`` transposed; its JumpReLU threshold;
``W_skip``), each layer's features of the same inputs and the per-layer reconstructions:

    python benchmarks/gemma_scope_compare.py            # needs /tmp/ct-venv (see circuit_tracer_compare.py)

circuit-tracer 0.5.0's ``load_gemma_scope_2_clt`` reads the layers ``range(max(paths))``: given one path per layer it
drops the last one, so it is handed one key more (circuit-tracer's hub configs list one entry more than the model's
layers for this reason). Exits 1 where anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve()
D, WIDTH, LAYERS = 48, 96, 3


def write_files(root: Path) -> dict:
    """Random Gemma Scope files under ``root``; the paths each side loads."""
    g = torch.Generator().manual_seed(0)

    def tensors(n_out: int | None, affine: bool) -> dict[str, torch.Tensor]:
        w = {"w_enc": torch.randn(D, WIDTH, generator=g) / D ** 0.5, "b_enc": 0.1 * torch.randn(WIDTH, generator=g),
             "threshold": 0.3 * torch.rand(WIDTH, generator=g),
             "w_dec": 0.05 * torch.randn(WIDTH, *(() if n_out is None else (n_out,)), D, generator=g),
             "b_dec": 0.01 * torch.randn(D, generator=g)}
        return {**w, "affine_skip_connection": 0.02 * torch.randn(D, D, generator=g)} if affine else w
    out: dict = {"x": str(root / "x.pt"), "sets": {}, "npz": []}
    torch.save(torch.randn(LAYERS, 7, D, generator=g), out["x"])
    for affine in (False, True):
        name = "layer_{layer}_width_96_l0_small" + ("_affine" if affine else "")
        for layer in range(LAYERS):
            folder = root / "transcoder_all" / name.format(layer=layer)
            folder.mkdir(parents=True, exist_ok=True)
            save_file(tensors(None, affine), str(folder / "params.safetensors"))
            (folder / "config.json").write_text(json.dumps({
                "hf_hook_point_in": f"model.layers.{layer}.pre_feedforward_layernorm.output",
                "hf_hook_point_out": f"model.layers.{layer}.post_feedforward_layernorm.output", "width": WIDTH,
                "model_name": "google/gemma-3-tiny-pt", "architecture": "jump_relu", "l0": 10,
                "affine_connection": affine, "type": "transcoder"}))
        out["sets"][name] = [str(root / "transcoder_all" / name.format(layer=i) / "params.safetensors")
                             for i in range(LAYERS)]
    clt = root / "clt" / "width_96_l0_medium_affine"
    clt.mkdir(parents=True, exist_ok=True)
    for layer in range(LAYERS):
        save_file(tensors(LAYERS, True), str(clt / f"params_layer_{layer}.safetensors"))
    (clt / "config.json").write_text(json.dumps({
        "hf_hook_point_in": "model.layers.{layer}.pre_feedforward_layernorm.output", "width": WIDTH,
        "hf_hook_point_out": "model.layers.{layer}.post_feedforward_layernorm.output", "architecture": "jump_relu",
        "affine_connection": True, "type": "clt"}))
    out["clt"] = str(clt)
    for layer in range(LAYERS):
        folder = root / "gemma-scope-1" / f"layer_{layer}" / "width_96" / "average_l0_10"
        folder.mkdir(parents=True, exist_ok=True)
        w = {k.replace("w_", "W_"): v.numpy() for k, v in tensors(None, False).items()}
        np.savez(folder / "params.npz", **w)
        out["npz"].append(str(folder / "params.npz"))
    return out


def reference(spec: dict) -> dict:
    """circuit-tracer's loaders on the files: parameters, features and reconstructions, saved to ``spec["out"]``."""
    from circuit_tracer.transcoder.cross_layer_transcoder import load_gemma_scope_2_clt
    from circuit_tracer.transcoder.single_layer_transcoder import (
        load_gemma_scope_2_transcoder,
        load_gemma_scope_transcoder,
    )

    cpu, x, saved = torch.device("cpu"), torch.load(spec["x"]), {}
    for name, files in [*spec["sets"].items(), ("gemma-scope-1", spec["npz"])]:
        load = load_gemma_scope_transcoder if name == "gemma-scope-1" else load_gemma_scope_2_transcoder
        for layer, file in enumerate(files):
            t = load(file, layer, device=cpu, dtype=torch.float32)
            features = t.encode(x[layer])
            saved[f"{name}/{layer}"] = {**{k: v.detach().clone() for k, v in t.state_dict().items()},
                                        "features": features.detach(), "recon": t.decode(features, x[layer]).detach()}
    files = sorted(Path(spec["clt"]).glob("params_layer_*.safetensors"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    paths = {i: str(f) for i, f in enumerate(files)} | {len(files): str(files[-1])}  # its range(max(paths))
    clt = load_gemma_scope_2_clt(paths, feature_input_hook="mlp.hook_in", feature_output_hook="hook_mlp_out",
                                 device=cpu, dtype=torch.float32)
    saved["clt"] = {**{k: v.detach().clone() for k, v in clt.state_dict().items()},
                    **{f"features.{i}": clt.encode_layer(x[i], i).detach() for i in range(LAYERS)}}
    torch.save(saved, spec["out"])
    return {"saved": len(saved)}


def ours(spec: dict, theirs: dict) -> dict:
    """nncanon's loading of the same files against circuit-tracer's: per entry, what differs (empty: nothing)."""
    from nncanon import graphs

    x, report = torch.load(spec["x"]), {}
    sets = {name: graphs.load_transcoders(str(Path(files[0]).parents[1] / name / "params.safetensors"))
            for name, files in spec["sets"].items()}
    sets["gemma-scope-1"] = graphs.load_transcoders(spec["npz"][0].replace("layer_0", "layer_{layer}"))
    for name, transcoders in sets.items():
        for layer, t in enumerate(transcoders):
            ref, diff = theirs[f"{name}/{layer}"], []
            pairs = {"W_enc": (t.W_enc.T, ref["W_enc"]), "W_dec": (t.W_dec, ref["W_dec"]),
                     "b_enc": (t.b_enc, ref["b_enc"]), "b_dec": (t.b_dec, ref["b_dec"]),
                     "threshold": (t.threshold, ref["activation_function.threshold"])}
            if "W_skip" in ref:
                pairs["W_skip"] = (t.W_skip, ref["W_skip"])
            diff += [k for k, (a, b) in pairs.items() if not torch.equal(a, b)]
            features = t.encode(x[layer])
            if not torch.equal(features != 0, ref["features"] != 0):
                diff.append("active features")
            report[f"{name}/{layer}"] = {"differs": diff, "features_max_abs": float((features - ref["features"])
                                                                                     .abs().max()),
                                         "recon_max_abs": float((t.decode(features, x=x[layer]) - ref["recon"])
                                                                .abs().max())}
    clt, ref = graphs.load_transcoders(spec["clt"]), theirs["clt"]
    diff = [k for k, (a, b) in {"W_enc": (clt.W_enc.transpose(1, 2), ref["W_enc"]), "b_enc": (clt.b_enc, ref["b_enc"]),
                                "b_dec": (clt.b_dec, ref["b_dec"]), "W_skip": (clt.W_skip, ref["W_skip"]),
                                "threshold": (clt.threshold[:, None], ref["activation_function.threshold"]),
                                **{f"W_dec.{i}": (clt.W_dec[i], ref[f"W_dec.{i}"]) for i in range(LAYERS)}}.items()
            if not torch.equal(a, b)]
    features = [clt.encode(i, x[i]) for i in range(LAYERS)]
    diff += [f"active features {i}" for i in range(LAYERS) if not torch.equal(features[i] != 0,
                                                                             ref[f"features.{i}"] != 0)]
    report["clt"] = {"differs": diff, "features_max_abs": max(float((f - ref[f"features.{i}"]).abs().max())
                                                              for i, f in enumerate(features))}
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["reference"], help=argparse.SUPPRESS)
    parser.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--venv-python", default="/tmp/ct-venv/bin/python")
    parser.add_argument("--out", default=str(HERE.parent / "results-gemma-scope-compare.json"))
    args = parser.parse_args()
    if args.side:
        print(json.dumps(reference(json.loads(args.spec))))
        return 0
    with tempfile.TemporaryDirectory() as work:
        spec = {**write_files(Path(work)), "out": str(Path(work) / "reference.pt")}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([args.venv_python, str(HERE), "--side", "reference", json.dumps(spec)], check=True, env=env)
        report = ours(spec, torch.load(spec["out"]))
    for key, row in report.items():
        print(f"{key:42s} {'equal' if not row['differs'] else 'DIFFERS: ' + ', '.join(row['differs'])}  "
              f"features max |diff| {row['features_max_abs']:.1e}"
              + (f"  reconstruction max |diff| {row['recon_max_abs']:.1e}" if "recon_max_abs" in row else ""))
    Path(args.out).write_text(json.dumps({"d_model": D, "width": WIDTH, "layers": LAYERS, "rows": report}, indent=2)
                              + "\n")
    return 1 if any(row["differs"] for row in report.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
