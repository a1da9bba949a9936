"""nncanon's values at TransformerLens hook names against TransformerLens 4.3 itself, on identical tiny weights.

TransformerLens pins its own dependencies, so this runs in a venv of its own (docs/benchmarks.md):

    python -m venv /tmp/tl-venv
    /tmp/tl-venv/bin/pip install torch==2.13.0
    /tmp/tl-venv/bin/pip install "transformer_lens>=4.3,<5" torch==2.13.0 "nnsight==0.8.1"
    /tmp/tl-venv/bin/pip install --no-deps -e .
    /tmp/tl-venv/bin/python benchmarks/transformer_lens_compare.py

For each family (GPT-2, Llama, Gemma-2, OLMo-2: a post-norm block) it builds one tiny random model, hands a copy
of it to TransformerLens's ``TransformerBridge.boot_transformers(folder, hf_model=...)`` and reads, on the same
tokens:

1. ``enable_compatibility_mode(no_processing=True)`` (what SAELens's ``from_pretrained_no_processing`` loads): for
   every hook name of the table, nncanon's `value_at` against TransformerLens's cached hook value (max |diff|).
2. ``enable_compatibility_mode()`` (the default processing: fold_ln, center_writing_weights, center_unembed,
   fold_value_biases), and each processing alone: nncanon's value mapped by `nncanon.sae.processing.mapping`
   against TransformerLens's processed hook value.
3. A dictionary recording each processing (``metadata.model_from_pretrained_kwargs``), attached in nncanon: its
   features against the dictionary's encoding of TransformerLens's processed hook value (the encoding SAELens
   computes; SAELens 6 needs TransformerLens < 4, so it is not imported here: ``scripts/compare_saelens.py``
   checks the encoding itself against SAELens).

Prints one line per (family, processing, hook) and a summary; exits 1 if a value differs by more than 1e-5.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
import warnings

import torch

TOLERANCE = 1e-5

#: Hook names compared, by their suffix after ``blocks.L.``.
HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out", "hook_mlp_in",
         "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_z",
         "attn.hook_pattern", "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post", "ln1.hook_normalized",
         "ln2.hook_normalized", "mlp.hook_in", "mlp.hook_out", "attn.hook_result")

FAMILIES = ("gpt2", "llama", "gemma2", "olmo2")

#: Processings compared: the name, TransformerLens's kwargs, what SAELens records.
PROCESSINGS = {
    "none": ({"no_processing": True}, {}),
    "default": ({}, {"fold_ln": True, "center_writing_weights": True, "center_unembed": True,
                     "fold_value_biases": True}),
    "fold_ln": ({"fold_ln": True, "center_writing_weights": False, "center_unembed": False,
                 "fold_value_biases": False}, {"fold_ln": True}),
    "center_writing_weights": ({"fold_ln": False, "center_writing_weights": True, "center_unembed": False,
                                "fold_value_biases": False}, {"center_writing_weights": True}),
    "fold_value_biases": ({"fold_ln": False, "center_writing_weights": False, "center_unembed": False,
                           "fold_value_biases": True}, {"fold_value_biases": True}),
}


def bridge(folder: str, hf: torch.nn.Module, tokenizer, kwargs: dict):
    from transformer_lens.model_bridge import TransformerBridge

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TransformerBridge.boot_transformers(folder, hf_model=hf, tokenizer=tokenizer, dtype=torch.float32)
        model.enable_compatibility_mode(disable_warnings=True, **kwargs)
    return model


def nncanon_values(model, names: list[str]) -> dict:
    from nncanon.errors import NncanonError
    from nncanon.sae import resolve, value_at

    points, refused = {}, {}
    for name in names:
        try:
            points[name] = resolve(model, name)
        except NncanonError as error:
            refused[name] = f"{type(error).__name__}: {str(error)[:110]}"
    saved = {}
    for name, point in points.items():  # one trace per name: a trace reads in the model's order
        with torch.no_grad(), model.trace(TOKENS):
            saved[name] = value_at(model, point).save()
    return saved, points, refused


def compare_family(family: str, rows: list) -> None:
    from nncanon.sae import Dictionary, attach
    from nncanon.sae.processing import mapping, recorded
    from nncanon.testing import tiny_model

    model = tiny_model(family)
    hf = model._module
    folder = tempfile.mkdtemp(prefix=f"tl-{family}-")
    hf.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)  # TransformerLens reads its name_or_path
    layers = model.num_layers
    names = [f"blocks.{layer}.{hook}" for layer in range(layers) for hook in HOOKS]
    ours, points, refused = nncanon_values(model, names)
    for name, why in refused.items():
        rows.append((family, "-", name, "refused by nncanon", why))
    for label, (tl_kwargs, record) in PROCESSINGS.items():
        start = time.perf_counter()
        try:
            tl = bridge(folder, copy.deepcopy(hf), tokenizer, tl_kwargs)
            tl.set_use_hook_mlp_in(True)
            tl.set_use_attn_result(True)  # (attn.hook_result: off by default, as in HookedTransformer)
            _, cache = tl.run_with_cache(TOKENS)
        except Exception as error:  # reported, not hidden
            rows.append((family, label, "*", "TransformerLens failed", f"{type(error).__name__}: {error}"[:200]))
            continue
        processing = recorded({"metadata": {"model_from_pretrained_kwargs": record}})
        for name, value in ours.items():
            if name not in cache:
                rows.append((family, label, name, "TransformerLens has no such hook", ""))
                continue
            try:
                mapped = mapping(model, processing, points[name]).read(value)
            except Exception as error:  # a refusal: reported
                rows.append((family, label, name, "refused under processing", f"{type(error).__name__}"))
                continue
            theirs = cache[name]
            if theirs.shape != mapped.shape:
                rows.append((family, label, name, "shape differs", f"{tuple(mapped.shape)} vs {tuple(theirs.shape)}"))
                continue
            diff = (mapped - theirs).abs().max().item()
            rows.append((family, label, name, "equal" if diff <= TOLERANCE else "DIFFERS", f"{diff:.2e}"))
        # a dictionary recording this processing: its features are its encoding of TransformerLens's value
        if record is not None:
            for hook in ("hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out", "attn.hook_z",
                         "ln2.hook_normalized"):
                name = f"blocks.{layers - 1}.{hook}"
                if name not in points or name not in cache:
                    continue
                width = int(torch.tensor(ours[name].shape[2:]).prod())
                g = torch.Generator().manual_seed(0)
                sae = Dictionary.from_tensors(torch.randn(width, 16, generator=g), torch.zeros(16),
                                              torch.randn(16, width, generator=g), torch.randn(width, generator=g),
                                              hook_name=name, model_from_pretrained_kwargs=record)
                try:
                    with attach(model, sae) as item, torch.no_grad(), model.trace(TOKENS):
                        features = item.features.save()
                except Exception as error:  # a refusal: reported
                    rows.append((family, label, f"dictionary at {name}", "refused", f"{type(error).__name__}"))
                    continue
                expected = sae.encode(cache[name])
                diff = (features - expected).abs().max().item()
                rows.append((family, label, f"dictionary at {name}", "equal" if diff <= TOLERANCE else "DIFFERS",
                             f"{diff:.2e}"))
        rows.append((family, label, "*", "time", f"{time.perf_counter() - start:.1f} s"))


TOKENS = torch.tensor([[5, 17, 3, 42, 9, 11, 27, 8]])


def main() -> int:
    from importlib.metadata import version

    print(f"TransformerLens {version('transformer_lens')}, transformers {version('transformers')}, "
          f"torch {version('torch')}")
    rows: list = []
    for family in sys.argv[1:] or FAMILIES:
        try:
            compare_family(family, rows)
        except Exception as error:  # reported
            rows.append((family, "*", "*", "failed", f"{type(error).__name__}: {error}"[:300]))
    for row in rows:
        print(" | ".join(str(cell) for cell in row))
    differs = [row for row in rows if row[3] in ("DIFFERS", "shape differs", "failed")]
    equal = [row for row in rows if row[3] == "equal"]
    print("\n| family | processing | equal | differ | refused under the processing | largest equal diff |")
    print("|---|---|---|---|---|---|")
    for family in dict.fromkeys(row[0] for row in rows):
        for label in PROCESSINGS:
            mine = [row for row in rows if row[0] == family and row[1] == label]
            same = [row for row in mine if row[3] == "equal"]
            worst = max((float(row[4]) for row in same), default=0.0)
            off = sorted({row[2].split(".", 2)[-1] for row in mine if row[3] in ("DIFFERS", "shape differs")})
            refused = sorted({row[2].split(".", 2)[-1] for row in mine if row[3].startswith("refused")})
            print(f"| {family} | {label} | {len(same)} | {len(off)} kinds: {', '.join(off) or '-'} | "
                  f"{', '.join(refused) or '-'} | {worst:.1e} |")
    print(f"\nsummary: {len(equal)} equal, {len(differs)} differ or failed")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
