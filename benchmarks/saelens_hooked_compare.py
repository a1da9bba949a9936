"""A dictionary's features under its recorded processing: nncanon against HookedTransformer + SAELens themselves.

SAELens 6 runs on TransformerLens 3 (``HookedTransformer``, the class its dictionaries were trained on), so this
runs in a virtual environment of its own (docs/benchmarks.md):

    python -m venv /tmp/sl-venv
    /tmp/sl-venv/bin/pip install torch==2.13.0
    /tmp/sl-venv/bin/pip install "sae_lens>=6,<7" torch==2.13.0 "nnsight==0.8.1"
    /tmp/sl-venv/bin/pip install --no-deps -e .
    /tmp/sl-venv/bin/python benchmarks/saelens_hooked_compare.py

A tiny random GPT-2 (``n_inner`` left at 4 × width, as HookedTransformer's GPT-2 config assumes) is handed to
``HookedTransformer.from_pretrained("gpt2", hf_model=..., <processing>)`` (its config read from the model, not the
hub), and for each processing SAELens records: a 32-feature dictionary saved by nncanon with that record, loaded by
SAELens (``SAE.load_from_disk``) and by nncanon (`Dictionary.load`); SAELens's ``encode`` of HookedTransformer's hook
value against nncanon's features of the attached dictionary, at every hook a dictionary reads. Also each hook's value:
HookedTransformer's against nncanon's mapped by `nncanon.sae.processing`. Exits 1 on a difference above 1e-5.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path

import torch

TOLERANCE = 1e-5
TOKENS = torch.tensor([[5, 17, 3, 42, 9, 11, 27, 8]])
HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out", "attn.hook_z",
         "attn.hook_v", "attn.hook_q", "mlp.hook_post")
RECORDS = {
    "none": {},
    "center_writing_weights": {"center_writing_weights": True},
    "fold_value_biases": {"fold_value_biases": True},
    "fold_ln": {"fold_ln": True},
    "default": {"fold_ln": True, "center_writing_weights": True, "center_unembed": True, "fold_value_biases": True},
}


def hooked(hf, tokenizer, record: dict):
    import transformer_lens.loading_from_pretrained as loading
    from transformer_lens import HookedTransformer

    config = copy.deepcopy(hf.config)
    config.n_ctx = config.n_positions
    loading.AutoConfig.from_pretrained = staticmethod(lambda *args, **kwargs: config)  # no hub: the tiny config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HookedTransformer.from_pretrained_no_processing("gpt2", hf_model=copy.deepcopy(hf),
                                                               tokenizer=tokenizer, **record)


def main() -> int:
    from sae_lens import SAE
    from transformers import AutoTokenizer

    from nncanon.sae import Dictionary, attach, resolve, value_at
    from nncanon.sae.processing import mapping, recorded
    from nncanon.testing import tiny_model

    print(f"sae_lens {version('sae_lens')}, transformer_lens {version('transformer_lens')}, "
          f"transformers {version('transformers')}, torch {version('torch')}")
    model = tiny_model("gpt2", n_inner=None)
    hf = model._module
    folder = Path(tempfile.mkdtemp(prefix="sl-gpt2-"))
    hf.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows, failures = [], 0
    for label, record in RECORDS.items():
        ht = hooked(hf, tokenizer, record)
        _, cache = ht.run_with_cache(TOKENS)
        processing = recorded({"metadata": {"model_from_pretrained_kwargs": record}})
        for layer in range(model.num_layers):
            for hook in HOOKS:
                name = f"blocks.{layer}.{hook}"
                point = resolve(model, name)
                with torch.no_grad(), model.trace(TOKENS):
                    served = value_at(model, point).save()
                try:
                    ours = mapping(model, processing, point).read(served)
                except Exception as error:  # a refusal, reported
                    rows.append((label, name, "value", "refused", type(error).__name__))
                    continue
                diff = (ours - cache[name]).abs().max().item()
                failures += diff > TOLERANCE
                rows.append((label, name, "value", "equal" if diff <= TOLERANCE else "DIFFERS", f"{diff:.2e}"))
                if hook in ("attn.hook_v", "attn.hook_q"):  # per head: a dictionary reads one head (not here)
                    continue
                width = int(torch.tensor(served.shape[2:]).prod())
                g = torch.Generator().manual_seed(layer)
                made = Dictionary.from_tensors(torch.randn(width, 32, generator=g) / width ** 0.5,
                                               torch.randn(32, generator=g) * 0.1,
                                               torch.randn(32, width, generator=g) / width ** 0.5,
                                               torch.randn(width, generator=g) * 0.1, hook_name=name,
                                               model_from_pretrained_kwargs=record or None)
                where = made.save(folder / f"sae-{label}-{layer}-{hook}")
                theirs = SAE.load_from_disk(str(where), device="cpu")
                ours_sae = Dictionary.load(where)
                try:
                    with attach(model, ours_sae) as item, torch.no_grad(), model.trace(TOKENS):
                        features = item.features.save()
                except Exception as error:  # a refusal, reported
                    rows.append((label, name, "features", "refused", type(error).__name__))
                    continue
                with torch.no_grad():
                    expected = theirs.encode(cache[name])  # SAELens flattens hook_z itself
                diff = (features - expected).abs().max().item()
                failures += diff > TOLERANCE
                rows.append((label, name, "features", "equal" if diff <= TOLERANCE else "DIFFERS", f"{diff:.2e}"))
    for row in rows:
        print(" | ".join(row))
    print("\n| processing | values equal | features equal | refused | differ | largest diff |")
    print("|---|---|---|---|---|---|")
    for label in RECORDS:
        mine = [row for row in rows if row[0] == label]
        values = sum(row[2] == "value" and row[3] == "equal" for row in mine)
        features = sum(row[2] == "features" and row[3] == "equal" for row in mine)
        refused = sorted({row[1].split(".", 2)[-1] for row in mine if row[3] == "refused"})
        differ = sorted({row[1].split(".", 2)[-1] for row in mine if row[3] == "DIFFERS"})
        worst = max((float(row[4]) for row in mine if row[3] == "equal"), default=0.0)
        print(f"| {label} | {values} | {features} | {', '.join(refused) or '-'} | {', '.join(differ) or '-'} | "
              f"{worst:.1e} |")
    print(f"\nsummary: {sum(row[3] == 'equal' for row in rows)} equal, {failures} differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
