"""Dictionaries on the standard surface: exactness on every variant, the splice's overhead, collection throughput.

Run:  python benchmarks/sae.py [--measures exactness overhead collection memory] [--repeats 7] [--json out.json]

- exactness: on every registered variant (tiny models, eager, fp32), a tiny dictionary at every point one attaches
  to (each standard value of every block that serves it, one head of the kernel's inputs, all heads of a per-head
  output flattened, ``resid_mid`` and the MLP's input where the block has them): the logits of a trace that reads
  every dictionary's features unedited, against the clean logits (``torch.equal``); and an edit of one feature by
  ``δ`` at every point, against ``δ · W_dec[j]`` (the largest difference, target ≤ 1e-6).
- overhead: a GPT-2-small-sized model (124M parameters, random weights, fp32, CPU) with a 16k-feature dictionary
  on ``blocks.6.hook_resid_post``, batch 8 × 128 tokens: a trace that reads the features (unedited; one feature
  ablated; ``error_term=False``) against a plain trace that reads the same value plus the dictionary's own
  computation on that value, timed alone (encode; encode and the edit's decoder rows; encode and decode), measured
  side by side with interleaved repeats (CPU time, user + system; the median over repeats of each repeat's
  ratio). Target ≤ 1.05×.
- collection: ``collect_activations`` of ``blocks.6.hook_resid_post`` over 256 texts (batch 32) against a plain
  loop of traces that save the same value and move it to the CPU. Target ≤ 1.2×.
- memory: peak RSS of ``collect_activations`` over 256 and over 1024 texts (a fresh process each): bounded by the
  batch and the shard, not the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import transformers

from nncanon import StandardizedTransformer
from nncanon.sae import Dictionary, attach
from nncanon.testing import tiny_tokenizer

MEASURES = ("exactness", "overhead", "collection", "memory")
HOOK = "blocks.6.hook_resid_post"


def gpt2_small() -> StandardizedTransformer:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    module = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    return StandardizedTransformer(module, tokenizer=tiny_tokenizer())


def dictionary(d: int, d_sae: int = 16384) -> Dictionary:
    generator = torch.Generator().manual_seed(0)
    return Dictionary.from_tensors(torch.randn(d, d_sae, generator=generator) / d ** 0.5, torch.full((d_sae,), -0.1),
                                   torch.randn(d_sae, d, generator=generator) / d_sae ** 0.5, torch.zeros(d),
                                   hook_name=HOOK)


# -- exactness ---------------------------------------------------------------------------------------------------


def exactness() -> dict:
    from nncanon.proof.checks import encode
    from nncanon.reading import in_execution_order
    from nncanon.registry import variants
    from nncanon.sae import Point, resolve, value_at
    from nncanon.sae.splice import point_shape
    from nncanon.testing import PROMPTS, tiny_model

    values = ("layer_input", "query_states", "key_states", "value_states", "attention_head_outputs",
              "attention_output", "linear_attention_head_outputs", "linear_attention_output", "mlp_output",
              "layer_output")
    flat = ("attention_head_outputs", "linear_attention_head_outputs")
    counts = {"variants": 0, "skipped": [], "sites": 0, "sites_by_value": {}, "logits_equal": 0, "traces": 0,
              "max_edit_error": 0.0, "failures": []}
    for variant in variants():
        if variant.unavailable:
            counts["skipped"].append(f"{variant.name}: {variant.unavailable}")
            continue
        model = tiny_model(variant)
        report = model.support()
        plain, derived = [], []
        for layer in range(model.num_layers):
            names = [v for v in values if report.available(v, layer=layer)]
            for name in in_execution_order(model, layer, names):
                head = 0 if name in ("query_states", "key_states", "value_states") else None
                plain.append(Point(layer, name, head, f"layers.{layer}.{name}"))
            for name in ("resid_mid", "mlp_input"):
                try:
                    derived.append(resolve(model, f"layers.{layer}.{name}"))
                except AttributeError:
                    pass
        items = []
        for seed, point in enumerate(plain + derived):
            shape, _, _ = point_shape(model, point)
            width = int(torch.tensor(shape).prod()) if point.value in flat else shape[-1]
            g = torch.Generator().manual_seed(seed)
            sae = Dictionary.from_tensors(torch.randn(width, 8, generator=g) / width ** 0.5, torch.full((8,), 0.01),
                                          torch.randn(8, width, generator=g) / width ** 0.5, None,
                                          reshape_activations="hook_z" if point.value in flat else "none")
            items.append(attach(model, sae, point))
        with torch.no_grad():
            clean = model._module(**encode(model)).logits
        by_point = {item.point: item for item in items}
        for group in (plain, derived):
            if not group:
                continue
            with torch.no_grad(), model.trace(PROMPTS[0]):
                for point in group:
                    by_point[point].features.save()
                logits = model.logits.save()
            counts["traces"] += 1
            if torch.equal(logits, clean):
                counts["logits_equal"] += 1
            else:
                counts["failures"].append(f"{variant.name}: logits moved")
            moved: list = []
            with torch.no_grad(), model.trace(PROMPTS[0]):
                for point in group:
                    item = by_point[point]
                    before = item.input.clone().save()
                    item.features[..., 3] += 0.75
                    moved.append((item, before, value_at(model, item.point).save()))
            for item, before, after in moved:
                error = float((after - before - 0.75 * item.dictionary.W_dec[3].reshape(before.shape[2:])).abs().max())
                counts["max_edit_error"] = max(counts["max_edit_error"], error)
        for item in items:
            counts["sites_by_value"][item.point.value] = counts["sites_by_value"].get(item.point.value, 0) + 1
            item.detach()
        counts["sites"] += len(items)
        counts["variants"] += 1
    return counts


# -- overhead ----------------------------------------------------------------------------------------------------


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(run: Any) -> float:
    """The CPU seconds (user + system, every thread) ``run`` takes: on a machine shared with other work the wall
    clock moves with the neighbours' load, the CPU time much less."""
    start = _cpu()
    run()
    return _cpu() - start


def overhead(repeats: int) -> dict:
    model = gpt2_small()
    sae = dictionary(model.hidden_size)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (8, 128), generator=generator)
    with torch.no_grad(), model.trace(ids):
        x = model.layers[6].layer_output.save()
    features, state = sae.encode_with_state(x)
    change = torch.zeros_like(features)
    change[..., 5] = -features[..., 5]

    def plain() -> None:
        with torch.no_grad(), model.trace(ids):
            model.layers[6].layer_output.save()
            model.logits.save()

    def read(item: Any) -> Any:
        def run() -> None:
            with torch.no_grad(), model.trace(ids):
                item.features.save()
                model.logits.save()
        return run

    def ablate(item: Any) -> Any:
        def run() -> None:
            with torch.no_grad(), model.trace(ids):
                item.features[..., 5] = 0
                model.logits.save()
        return run

    def encode_only() -> None:
        with torch.no_grad():
            sae.encode_with_state(x)

    def encode_and_edit() -> None:
        with torch.no_grad():
            sae.encode_with_state(x)
            sae.delta(change, state)

    def encode_and_decode() -> None:
        with torch.no_grad():
            f, s = sae.encode_with_state(x)
            sae.decode(f, s, x)

    held = attach(model, sae, name="read")
    cases = {"plain": plain, "read": read(held), "ablate": ablate(held), "encode": encode_only,
             "encode+edit": encode_and_edit, "encode+decode": encode_and_decode}
    times: dict[str, list[float]] = {name: [] for name in [*cases, "replace"]}
    for name in cases:  # warm up
        cases[name]()
    for _ in range(repeats):
        for name, run in cases.items():
            times[name].append(_timed(run))
        held.detach()
        with attach(model, sae, error_term=False, name="replace"):
            times["replace"].append(_timed(plain))
        held = attach(model, sae, name="read")
    held.detach()
    median = {name: statistics.median(values) for name, values in times.items()}

    def paired(case: str, own: str) -> float:
        """The median over repeats of ``case / (plain + own)``, each ratio of one repeat's interleaved runs."""
        return statistics.median(c / (p + o) for c, p, o in zip(times[case], times["plain"], times[own], strict=True))

    return {
        "seconds": median, "raw": times,
        "read/(plain+encode)": paired("read", "encode"),
        "ablate/(plain+encode+edit)": paired("ablate", "encode+edit"),
        "replace/(plain+encode+decode)": paired("replace", "encode+decode"),
        "batch": [8, 128], "d_sae": sae.d_sae, "repeats": repeats,
    }


# -- collection --------------------------------------------------------------------------------------------------


def _texts(count: int) -> list[str]:
    from nncanon.demo import DEMO_DIR

    lines = [line for line in (DEMO_DIR / "corpus.txt").read_text().splitlines() if line.strip()]
    return [" ".join(lines[i % len(lines)] for i in range(j, j + 4)) for j in range(count)]


def collection(repeats: int) -> dict:
    from nncanon.sae.collection import collect_activations
    from nncanon.sae.sites import value_at

    model = gpt2_small()
    texts = _texts(256)

    def plain() -> None:
        for start in range(0, len(texts), 32):
            encoded = model.tokenizer(texts[start:start + 32], return_tensors="pt", padding=True, truncation=True,
                                      max_length=128)
            saved: list = []
            with torch.no_grad(), model.trace(encoded["input_ids"], attention_mask=encoded["attention_mask"]):
                saved.append(value_at(model, HOOK).save())
            saved[0].cpu()

    def ours() -> None:
        with tempfile.TemporaryDirectory() as folder:
            collect_activations(model, HOOK, texts, folder, batch_size=32, progress=False)

    plain()
    ours()
    times: dict[str, list[float]] = {"plain": [], "collect": []}
    for _ in range(repeats):
        times["plain"].append(_timed(plain))
        times["collect"].append(_timed(ours))
    median = {name: statistics.median(values) for name, values in times.items()}
    tokens = sum(len(model.tokenizer(t)["input_ids"][:128]) for t in texts)
    return {"seconds": median, "collect/plain": median["collect"] / median["plain"], "texts": len(texts),
            "tokens": tokens, "tokens_per_second": tokens / median["collect"]}


def _memory_child(count: int) -> None:
    from nncanon.sae.collection import collect_activations

    model = gpt2_small()
    texts = _texts(count)
    with torch.no_grad(), model.trace(model.tokenizer(texts[:32], return_tensors="pt", padding=True)["input_ids"]):
        model.logits.save()  # everything the model needs is allocated before the baseline
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with tempfile.TemporaryDirectory() as folder:
        result = collect_activations(model, HOOK, texts, folder, batch_size=32, shard_rows=8192, progress=False)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"texts": count, "rows": result.rows, "peak_growth_mb": (after - before) / 1024,
                      "peak_mb": after / 1024}))


def memory() -> dict:
    results = []
    for count in (256, 1024):
        ran = subprocess.run([sys.executable, __file__, "--memory-child", str(count)], capture_output=True, text=True,
                             check=True)
        results.append(json.loads(ran.stdout.strip().splitlines()[-1]))
    return {"runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measures", nargs="+", default=list(MEASURES), choices=MEASURES)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child is not None:
        return _memory_child(args.memory_child)
    results: dict[str, Any] = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                                           "transformers": transformers.__version__, "threads": torch.get_num_threads(),
                                           "cpu": platform.processor() or platform.machine(),
                                           "cores": os.cpu_count()}}
    for measure in args.measures:
        started = time.time()
        if measure == "exactness":
            results[measure] = exactness()
        elif measure == "overhead":
            results[measure] = overhead(args.repeats)
        elif measure == "collection":
            results[measure] = collection(args.repeats)
        else:
            results[measure] = memory()
        results[measure]["wall_seconds"] = round(time.time() - started, 1)
        print(measure, json.dumps(results[measure], indent=2, default=str)[:3000], flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)


if __name__ == "__main__":
    main()
