"""Quantized models: the invariant suite on the registered variants quantized by bitsandbytes (8-bit and NF4), the
trace overhead on a quantized GPT-2-small-size model against raw nnsight on the same quantized model, and the first
proof of a quantized config against the unquantized one.

Run:  python benchmarks/quantized.py [--measures variants trace proof] [--repeats 7] [--json out.json]
      [--variants llama gpt2 ...]

- variants: every registry variant transformers can build, quantized with bitsandbytes 8-bit and NF4
  (``quantized_twin``: transformers' own ``from_pretrained`` with the ``quantization_config``, as a user loads it);
  `verify` (the invariant suite's checks: every served value against plain hooks on the same quantized model,
  the identity, ablations, writes, lens, skips, gradients) runs on the quantized variant. A variant counts as
  passing where every value check holds; gradient checks are counted apart (bitsandbytes' 4-bit CPU kernel on
  an AVX512-BF16 CPU passes no gradient once it has repacked its weights: declined by ``quantized_gradients``).
  Where the quantized variant does not run (bitsandbytes' 4-bit CPU kernel takes widths that are multiples of 64;
  the registry's variants are 32 wide), the same checks run on the variant with every width of the twin's table
  doubled (counts kept), quantized the same way.
- trace: a trace reading every standard value of every layer of a GPT-2-small-size model (124M, random weights,
  batch 8 x 32), quantized 8-bit and NF4, against raw nnsight reading the same tensors on the same quantized
  module (target <= 1.05x), in one run, interleaved repeats, medians.
- proof: the load-time proof (twin built, quantized, every check run; no cache) of Llama's and GPT-2's default
  configs, 8-bit and NF4 against unquantized (target <= 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import transformers
from nnsight.modeling.transformers import TransformersModel
from transformers import BitsAndBytesConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build, inputs, interleaved, trace_raw, trace_standard

from nncanon import StandardizedTransformer
from nncanon.proof.checks.base import CheckResult
from nncanon.proof.load import prove
from nncanon.proof.shrink import RULES, text_part
from nncanon.proof.twin import perturb, quantized_twin
from nncanon.proof.verdict import verify
from nncanon.quantization import declared, is_quantized
from nncanon.quiet import kernel_notices_filtered, progress_bars_hidden
from nncanon.registry import variants
from nncanon.testing import tiny_hf_model, tiny_tokenizer

METHODS = {
    "int8": lambda: BitsAndBytesConfig(load_in_8bit=True),
    "nf4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32),
}


def _outcome(results: list[CheckResult]) -> dict:
    values = [r for r in results if not r.gradient]
    gradients = [r for r in results if r.gradient]
    failed = [r.describe()[:300] for r in values if not r.passed]
    return {"values_pass": not failed, "gradients_pass": all(r.passed for r in gradients),
            "failed": failed[:3], "gradient_failed": [r.describe()[:200] for r in gradients if not r.passed][:1]}


def widened(variant) -> torch.nn.Module:
    """The variant with every width of the twin's table doubled (``hidden_size`` 32 -> 64...), counts kept: what
    bitsandbytes' 4-bit CPU kernel takes (widths that are multiples of its block of 64)."""
    config = variant.build_config()
    values = config.to_dict()
    text, _ = text_part(values)
    for rule in RULES:
        if rule.kind == "width":
            for name in rule.names:
                if isinstance(text.get(name), int) and not isinstance(text.get(name), bool) and text[name] > 0:
                    text[name] *= 2
    wide = type(config).from_dict({k: v for k, v in values.items() if k != "transformers_version"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(wide, attn_implementation="eager")
    perturb(model)
    return model.eval()


def _runs(model: torch.nn.Module, tokenizer) -> str | None:
    try:
        with torch.no_grad():
            model(**tokenizer("The Eiffel Tower is in", return_tensors="pt"))
    except Exception as error:
        return f"{type(error).__name__}: {' '.join(str(error).split())}"[:200]
    return None


def one_variant(variant, method: str) -> dict:
    hf = tiny_hf_model(variant)
    tokenizer = tiny_tokenizer(hf.config.get_text_config().vocab_size)
    quantization = declared(hf.config, {"quantization_config": METHODS[method]()})
    try:
        quantized = quantized_twin(hf, quantization)
    except Exception as error:
        return {"status": "not quantized", "reason": f"{type(error).__name__}: {error}"[:300]}
    layers = sum(is_quantized(m) for m in quantized.modules())
    if not layers:
        return {"status": "not quantized", "reason": "bitsandbytes replaces none of its layers"}
    on, error = "the variant", _runs(quantized, tokenizer)
    if error is not None:  # bitsandbytes' 4-bit CPU kernel: widths that are multiples of 64; the variant's are 32
        on = "the variant, every width doubled"
        try:
            quantized = quantized_twin(widened(variant), quantization)
        except Exception as wide_error:
            return {"status": "does not run quantized", "variant_error": error,
                    "reason": f"widened: {type(wide_error).__name__}: {wide_error}"[:300]}
        wide_error = _runs(quantized, tokenizer)
        if wide_error is not None:
            return {"status": "does not run quantized", "variant_error": error, "reason": f"widened: {wide_error}"}
    model = StandardizedTransformer(quantized, tokenizer=tokenizer, verify="never")
    return {"status": "checked", "on": on, "layers": layers, **_outcome(verify(model).results)}


def measure_variants(names: list[str] | None, partial: str | None = None) -> dict:
    chosen = [v for v in variants() if names is None or v.name in names]
    results: dict = {}
    for index, variant in enumerate(chosen, start=1):
        if variant.unavailable:
            results[variant.name] = {"skipped": variant.unavailable}
            continue
        results[variant.name] = {}
        for method in METHODS:
            start = time.perf_counter()
            try:
                outcome = one_variant(variant, method)
            except Exception as error:
                outcome = {"status": "error", "reason": f"{type(error).__name__}: {error}"[:300],
                           "where": traceback.format_exc().splitlines()[-3][:200]}
            outcome["seconds"] = round(time.perf_counter() - start, 2)
            results[variant.name][method] = outcome
        print(f"[{index}/{len(chosen)}] {variant.name}: " + ", ".join(
            f"{m} {_short(o)}" for m, o in results[variant.name].items()), flush=True)
        if partial:  # (a long run: what is done so far)
            Path(partial).write_text(json.dumps(results, indent=1, default=str))
    return results


def _short(outcome: dict) -> str:
    if outcome.get("status") != "checked":
        return outcome.get("status", "?")
    where = "" if outcome["on"] == "the variant" else " (widened)"
    return ("values pass" if outcome["values_pass"] else "values FAIL") + where + (
        "" if outcome["gradients_pass"] else ", .grad declined")


def summarize(results: dict) -> dict:
    summary: dict = {}
    for method in METHODS:
        outcomes = [r[method] for r in results.values() if method in r]
        checked = [o for o in outcomes if o.get("status") == "checked"]
        summary[method] = {
            "variants": len(outcomes),
            "quantized_and_checked": len(checked),
            "values_pass": sum(o["values_pass"] for o in checked),
            "values_pass_on_variant": sum(o["values_pass"] and o["on"] == "the variant" for o in checked),
            "values_pass_widened": sum(o["values_pass"] and o["on"] != "the variant" for o in checked),
            "gradients_pass": sum(o["gradients_pass"] for o in checked),
            "not_quantized": sorted(n for n, r in results.items()
                                    if r.get(method, {}).get("status") == "not quantized"),
            "does_not_run": sorted(n for n, r in results.items()
                                   if r.get(method, {}).get("status") == "does not run quantized"),
            "errors": sorted(n for n, r in results.items() if r.get(method, {}).get("status") == "error"),
            "values_fail": sorted(n for n, r in results.items() if r.get(method, {}).get("status") == "checked"
                                  and not r[method]["values_pass"]),
        }
    summary["skipped"] = sorted(n for n, r in results.items() if "skipped" in r)
    return summary


def measure_trace(repeats: int) -> dict:
    module = build("gpt2")
    ids = inputs(module)
    tokenizer = tiny_tokenizer()
    result: dict = {}
    for method, make in METHODS.items():
        quantization = declared(module.config, {"quantization_config": make()})
        quantized = quantized_twin(module, quantization)
        standard = StandardizedTransformer(quantized, tokenizer=tokenizer)
        raw = TransformersModel(quantized, tokenizer=tokenizer)
        times = interleaved({"standard": lambda standard=standard: trace_standard(standard, ids, False),
                             "raw_nnsight": lambda raw=raw: trace_raw(raw, ids, False)}, repeats)
        result[method] = {"seconds": times, "ratio": times["standard"] / times["raw_nnsight"],
                          "quantized_layers": sum(is_quantized(m) for m in quantized.modules()),
                          "provenance": standard.support().provenance}
        print(f"trace {method}: standard {times['standard']:.3f} s, raw nnsight {times['raw_nnsight']:.3f} s, "
              f"ratio {result[method]['ratio']:.3f}", flush=True)
    return result


def measure_proof(repeats: int) -> dict:
    result: dict = {}
    for name, config, cls in (("llama", transformers.LlamaConfig(), transformers.LlamaForCausalLM),
                              ("gpt2", transformers.GPT2Config(), transformers.GPT2LMHeadModel)):
        family = StandardizedTransformer(tiny_hf_model(name), tokenizer=tiny_tokenizer(), verify="never").family
        cases = {"float32": None,
                 **{m: declared(config, {"quantization_config": make()}) for m, make in METHODS.items()}}
        samples: dict = {case: [] for case in cases}
        for _ in range(repeats):
            for case, quantization in cases.items():
                os.environ["NNCANON_CACHE"] = tempfile.mkdtemp(prefix="nncanon-proof-")  # a first proof each time
                start = time.perf_counter()
                with kernel_notices_filtered():
                    prove(config, family, cls, "always", quantization)
                samples[case].append(time.perf_counter() - start)
        medians = {case: statistics.median(values) for case, values in samples.items()}
        result[name] = {"seconds": medians, **{f"{m}_ratio": medians[m] / medians["float32"] for m in METHODS}}
        print(f"proof {name}: " + ", ".join(f"{c} {s:.3f} s" for c, s in medians.items()), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measures", nargs="+", default=["variants", "trace", "proof"],
                        choices=["variants", "trace", "proof"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variants", nargs="+", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    os.environ.setdefault("NNCANON_CACHE", tempfile.mkdtemp(prefix="nncanon-quantized-"))
    import bitsandbytes

    report: dict = {"machine": {
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "bitsandbytes": bitsandbytes.__version__,
        "load_average_before": os.getloadavg()}}
    with kernel_notices_filtered(), progress_bars_hidden():
        if "variants" in args.measures:
            report["variants"] = measure_variants(args.variants, args.json and args.json + ".partial")
            report["variants_summary"] = summarize(report["variants"])
            print(json.dumps(report["variants_summary"], indent=1))
        if "trace" in args.measures:
            report["trace"] = measure_trace(args.repeats)
        if "proof" in args.measures:
            report["proof"] = measure_proof(max(3, args.repeats // 2))
    report["machine"]["load_average_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
