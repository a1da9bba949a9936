"""Compare nncanon's dictionaries with SAELens's own ``encode`` / ``decode``, on the same folders, both ways.

SAELens lives in its own virtual environment (its TransformerLens pin does not sit beside nncanon's transformers):

    python3 -m venv /work/venvs/saelens
    /work/venvs/saelens/bin/pip install torch==2.13.0
    /work/venvs/saelens/bin/pip install torch==2.13.0 sae_lens

    python scripts/compare_saelens.py --saelens-python /work/venvs/saelens/bin/python

Three steps, each in the environment it needs:

1. (SAELens) one folder per case, written by SAELens's own ``save_model`` / ``save_inference_model`` from an SAE
   of that architecture with random weights (every bias, threshold and gate moved off zero), with a random input
   and SAELens's ``encode`` and ``decode`` of it (``forward`` for a skip transcoder);
2. (nncanon) each folder loaded with ``nncanon.sae.Dictionary.load`` and run on the same input: features and
   reconstruction compared with SAELens's (``torch.equal``, and the largest difference); each dictionary saved
   again with ``Dictionary.save``, with nncanon's outputs;
3. (SAELens) nncanon's folders loaded with ``SAE.load_from_disk`` and compared with nncanon's outputs.

The table it prints is in ``docs/dictionaries.md``; ``--json`` writes it as data.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

D_IN, D_SAE, HEADS = 48, 96, 4


def _randomized(sae, scale: float = 0.2) -> None:
    """Every parameter of a SAELens SAE moved to random values (thresholds positive)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in sae.named_parameters():
            values = torch.randn(parameter.shape, generator=generator) * scale
            if "threshold" in name:
                values = values.abs() * 0.5
            parameter.copy_(values.to(parameter.dtype))


def _cases():
    """``(name, builder)``: a SAELens SAE of each architecture and setting nncanon runs."""
    from sae_lens import (
        GatedSAE,
        GatedSAEConfig,
        JumpReLUSAE,
        JumpReLUSAEConfig,
        StandardSAE,
        StandardSAEConfig,
        TopKSAE,
        TopKSAEConfig,
    )
    from sae_lens.saes.transcoder import (
        JumpReLUTranscoder,
        JumpReLUTranscoderConfig,
        SkipTranscoder,
        SkipTranscoderConfig,
        Transcoder,
        TranscoderConfig,
    )

    meta = {"hook_name": "blocks.1.hook_resid_post"}
    transcoder_meta = {"hook_name": "blocks.1.ln2.hook_normalized", "hook_name_out": "blocks.1.hook_mlp_out"}

    def standard(**kw):
        return StandardSAE(StandardSAEConfig(d_in=D_IN, d_sae=D_SAE, **kw))

    def with_meta(sae, metadata=meta):
        for key, value in metadata.items():
            sae.cfg.metadata[key] = value
        return sae

    return [
        ("standard", lambda: with_meta(standard(apply_b_dec_to_input=True))),
        ("standard, no b_dec on input", lambda: with_meta(standard(apply_b_dec_to_input=False))),
        ("standard, constant_norm_rescale", lambda: with_meta(standard(normalize_activations="constant_norm_rescale"))),
        ("standard, layer_norm", lambda: with_meta(standard(normalize_activations="layer_norm"))),
        ("standard, expected_average_only_in", lambda: with_meta(
            standard(normalize_activations="expected_average_only_in"))),
        ("standard, bfloat16", lambda: with_meta(standard(dtype="bfloat16"))),
        ("standard, hook_z", lambda: with_meta(standard(reshape_activations="hook_z"),
                                               {"hook_name": "blocks.1.attn.hook_z"})),
        ("topk", lambda: with_meta(TopKSAE(TopKSAEConfig(d_in=D_IN, d_sae=D_SAE, k=8)))),
        ("topk, rescale_acts_by_decoder_norm", lambda: with_meta(
            TopKSAE(TopKSAEConfig(d_in=D_IN, d_sae=D_SAE, k=8, rescale_acts_by_decoder_norm=True)))),
        ("jumprelu", lambda: with_meta(JumpReLUSAE(JumpReLUSAEConfig(d_in=D_IN, d_sae=D_SAE)))),
        ("batchtopk (saved as jumprelu)", _batchtopk),
        ("gated", lambda: with_meta(GatedSAE(GatedSAEConfig(d_in=D_IN, d_sae=D_SAE)))),
        ("transcoder", lambda: with_meta(Transcoder(TranscoderConfig(d_in=D_IN, d_sae=D_SAE, d_out=D_IN + 8,
                                                                     apply_b_dec_to_input=False)),
                                         transcoder_meta)),
        ("skip_transcoder", lambda: with_meta(SkipTranscoder(SkipTranscoderConfig(
            d_in=D_IN, d_sae=D_SAE, d_out=D_IN + 8, apply_b_dec_to_input=False)), transcoder_meta)),
        ("jumprelu_transcoder", lambda: with_meta(JumpReLUTranscoder(JumpReLUTranscoderConfig(
            d_in=D_IN, d_sae=D_SAE, d_out=D_IN + 8, apply_b_dec_to_input=False)), transcoder_meta)),
    ]


def _batchtopk():
    """A BatchTopK SAE as SAELens saves one for inference: a JumpReLU folder with the learned threshold."""
    from sae_lens.saes.batchtopk_sae import BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig

    sae = BatchTopKTrainingSAE(BatchTopKTrainingSAEConfig(d_in=D_IN, d_sae=D_SAE, k=8))
    sae.cfg.metadata["hook_name"] = "blocks.1.hook_resid_post"
    sae.topk_threshold = torch.tensor(0.05, dtype=torch.double)
    return sae


def make(folder: Path) -> None:
    """Step 1, in SAELens's environment."""
    import sae_lens

    torch.manual_seed(0)
    cases = {}
    for index, (name, build) in enumerate(_cases()):
        sae = build()
        _randomized(sae)
        path = folder / f"case{index:02d}"
        if hasattr(sae, "save_inference_model"):
            sae.save_inference_model(path)
        else:
            sae.save_model(path)
        from sae_lens import SAE

        loaded = SAE.load_from_disk(path)
        dtype = loaded.dtype
        shape = (3, 5, HEADS, D_IN // HEADS) if "hook_z" in name else (3, 5, D_IN)
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(index)) * 2).to(dtype)
        with torch.no_grad():
            features = loaded.encode(x)
            recon = loaded.forward(x) if "skip" in name else loaded.decode(features)
        from safetensors.torch import save_file

        save_file({"x": x, "features": features.contiguous(), "reconstruction": recon.contiguous()},
                  path / "reference.safetensors")
        cases[name] = path.name
    (folder / "cases.json").write_text(json.dumps({"sae_lens": sae_lens.__version__, "torch": torch.__version__,
                                                   "cases": cases}))


def check_ours(folder: Path) -> None:
    """Step 3, in SAELens's environment: nncanon's folders through SAELens."""
    from sae_lens import SAE
    from safetensors.torch import load_file

    cases = json.loads((folder / "cases.json").read_text())["cases"]
    results = {}
    for name, sub in cases.items():
        path = folder / sub / "nncanon"
        ours = load_file(str(path / "ours.safetensors"))
        sae = SAE.load_from_disk(path)
        with torch.no_grad():
            features = sae.encode(ours["x"])
            recon = sae.forward(ours["x"]) if "skip" in name else sae.decode(features)
        results[name] = {"features_equal": bool(torch.equal(features, ours["features"])),
                         "reconstruction_equal": bool(torch.equal(recon, ours["reconstruction"])),
                         "max_abs": float(max((features - ours["features"]).abs().max(),
                                              (recon - ours["reconstruction"]).abs().max()))}
    (folder / "reverse.json").write_text(json.dumps(results))


def compare(folder: Path) -> dict:
    """Step 2, in nncanon's environment."""
    from safetensors.torch import load_file, save_file

    from nncanon.sae import Dictionary

    meta = json.loads((folder / "cases.json").read_text())
    results = {}
    for name, sub in meta["cases"].items():
        path = folder / sub
        reference = load_file(str(path / "reference.safetensors"))
        dictionary = Dictionary.load(path)
        x = reference["x"]
        features, state = dictionary.encode_with_state(x)
        recon = dictionary.decode(features, state, x)
        if dictionary.cfg.reshape_activations == "hook_z":
            recon = recon.unflatten(-1, x.shape[-2:])
        results[name] = {
            "architecture": dictionary.cfg.architecture,
            "features_equal": bool(torch.equal(features, reference["features"])),
            "reconstruction_equal": bool(torch.equal(recon, reference["reconstruction"])),
            "max_abs": float(max((features - reference["features"]).abs().max(),
                                 (recon - reference["reconstruction"]).abs().max())),
        }
        out = dictionary.save(path / "nncanon")
        save_file({"x": x, "features": features.contiguous(), "reconstruction": recon.contiguous()},
                  out / "ours.safetensors")
    return {"sae_lens": meta["sae_lens"], "torch": meta["torch"], "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saelens-python", default="/work/venvs/saelens/bin/python")
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--check-ours", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.make is not None:
        return make(args.make)
    if args.check_ours is not None:
        return check_ours(args.check_ours)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        subprocess.run([args.saelens_python, __file__, "--make", str(folder)], check=True)
        report = compare(folder)
        subprocess.run([args.saelens_python, __file__, "--check-ours", str(folder)], check=True)
        reverse = json.loads((folder / "reverse.json").read_text())
    print(f"SAELens {report['sae_lens']}, torch {report['torch']}")
    print(f"{'case':40s} {'features':>9s} {'recon':>6s} {'max |d|':>9s} | SAELens on nncanon's folder")
    for name, row in report["results"].items():
        back = reverse[name]
        print(f"{name:40s} {row['features_equal']!s:>9s} {row['reconstruction_equal']!s:>6s} "
              f"{row['max_abs']:9.2e} | {back['features_equal']} {back['reconstruction_equal']} {back['max_abs']:.2e}")
    report["reverse"] = reverse
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    failed = [name for name, row in report["results"].items()
              if not (row["features_equal"] and row["reconstruction_equal"])]
    failed += [name for name, row in reverse.items() if not (row["features_equal"] and row["reconstruction_equal"])]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
