"""Attribution patching against the exact head ablation sweep: rank agreement and speed.

Run:  python benchmarks/attribution.py [--repeats 5] [--json out.json]

- agreement: on the three demo models (`nncanon.demo_model`), the estimate of zero-ablating each head
  of every layer (`attribution_patching` with no corrupted prompt) against the exact effect of zeroing
  it (`head_ablation_sweep`), as Spearman's rank correlation over all layers x heads, of the signed
  effects and of their magnitudes (which heads matter most). Three metrics of the last position:
  P(" Paris") (what ``nncanon ablate`` plots), its log-probability, its logit.
- speed: on a GPT-2-small-sized GPT-2 with random weights (12 layers x 12 heads, 124M parameters), the
  wall time of the exact sweep of every head of every layer against `attribution_patching` (heads,
  attention and MLP of every layer), same prompt, interleaved repeats, medians. CPU, fp32.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from scipy.stats import spearmanr

from nncanon import StandardizedTransformer, demo_model
from nncanon.demo import DEMO_MODELS
from nncanon.study import MIXERS, target_token
from nncanon.testing import tiny_tokenizer
from nncanon.tools import attribution_patching, head_ablation_sweep

PROMPT = "The Eiffel Tower is in the city of"
LONG_PROMPT = " ".join(["The Eiffel Tower is in the city of Paris, and Berlin lies in Germany."] * 2)


def _metrics(token: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each metric on last-position logits ``[batch, vocab]``."""
    return {
        "probability": lambda logits: torch.softmax(logits.float(), -1)[:, token],
        "log-probability": lambda logits: torch.log_softmax(logits.float(), -1)[:, token],
        "logit": lambda logits: logits[:, token],
    }


def exact_head_effects(model, prompt: str, metric: Callable) -> torch.Tensor:
    """``[layers, heads]``: metric with the head zeroed minus clean (NaN where a layer has no heads)."""
    with torch.no_grad(), model.trace(prompt):
        clean = metric(model.logits[:, -1]).save()
    report = model.support()
    out = None
    for _, _, head_value in MIXERS:  # attention heads first, then a hybrid's linear mixer heads
        layers = [layer for layer in report.layers_with(head_value)
                  if out is None or bool(out[layer].isnan().all())]
        if not layers:
            continue
        swept = head_ablation_sweep(model, prompt, layers, head_value, metric=metric)
        if out is None:
            out = torch.full((model.num_layers, swept.shape[1]), float("nan"))
        out[layers, : swept.shape[1]] = swept - float(clean[0])
    return out


def agreement() -> dict:
    results = {}
    for name in DEMO_MODELS:
        model = demo_model(name)
        token = target_token(model, " Paris")
        row = {}
        for label, metric in _metrics(token).items():
            exact = exact_head_effects(model, PROMPT, metric)
            estimate = attribution_patching(model, PROMPT, None, lambda logits, metric=metric: metric(logits[:, -1]),
                                            over=("heads",)).heads
            keep = ~exact.isnan()
            signed = spearmanr(exact[keep].numpy(), estimate[keep].numpy()).statistic
            size = spearmanr(exact[keep].abs().numpy(), estimate[keep].abs().numpy()).statistic
            row[label] = {"signed": round(float(signed), 3), "magnitude": round(float(size), 3)}
        results[name] = row
        print(f"{name}: Spearman {row}", flush=True)
    return results


def speed(repeats: int) -> dict:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    module = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model = StandardizedTransformer(module, tokenizer=tiny_tokenizer(), verify="never")
    return {str(len(model.tokenizer(p).input_ids)): _speed(model, p, repeats) for p in (PROMPT, LONG_PROMPT)}


def _speed(model, prompt: str, repeats: int) -> dict:
    tokens = len(model.tokenizer(prompt).input_ids)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, 5]

    runs = {
        "exact sweep (144 heads)": lambda: head_ablation_sweep(model, prompt, metric=metric),
        "attribution patching (144 heads + 12 attention + 12 MLP)": lambda: attribution_patching(
            model, prompt, None, lambda logits: metric(logits[:, -1])),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        run()
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    exact, fast = medians.values()
    print(f"GPT-2 124M, {tokens} tokens: " + ", ".join(f"{k} {v:.2f} s" for k, v in medians.items())
          + f"; {exact / fast:.1f}x", flush=True)
    return {"tokens": tokens, "seconds": medians, "speedup": round(exact / fast, 1), "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", choices=("agreement", "speed"), default=None)
    args = parser.parse_args()
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
    }
    if args.only != "speed":
        report["agreement"] = agreement()
    if args.only != "agreement":
        report["speed"] = speed(args.repeats)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
