"""Attribution patching against the exact sweeps it estimates: rank agreement and speed.

Run:  python benchmarks/attribution.py [--repeats 5] [--threads N] [--only agreement|speed] [--json out.json]

- agreement: on the three demo models (`nncanon.demo_model`), Spearman's rank correlation over all layers x
  heads between `attribution_patching`'s estimates and the exact effects, of the signed effects and of their
  magnitudes (which heads matter most):
  * patching (the headline): each head's output (every position) taken from a corrupted prompt of the same
    length into the clean run, exactly (`activation_patching`, one item per head), metric the logit
    difference of the two answers; on the demo prompt patched from the Belem Tower prompt, and on every
    pair of `LANDMARKS` of one token length;
  * the same with P(answer) as the metric;
  * zero ablation of each head (`head_ablation_sweep`; what `nncanon ablate --fast` estimates) on the
    demo prompt, for the logit difference, P(" Paris"), log P and the logit.
- speed: on a GPT-2-small-sized GPT-2 with random weights (12 layers x 12 heads, 124M parameters), fp32 CPU,
  the exact sweeps of every head of every layer (zero ablation: `head_ablation_sweep`; patching:
  `activation_patching`) against `attribution_patching` (heads, attention and MLP of every layer), same
  prompt, interleaved repeats, medians of wall and of CPU (process) time, the load average alongside; and the
  floor: the same estimates in plain PyTorch (`plain_attribution`: hooks on the unwrapped model, one
  `torch.autograd.grad`; asserted equal to `attribution_patching`'s), the ratio no implementation of one
  forward and one backward can beat on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
from nncanon.tools import activation_patching, attribution_patching, head_ablation_sweep, logit_difference, run_metric

PROMPT = "The Eiffel Tower is in the city of"
LONG_PROMPT = " ".join(["The Eiffel Tower is in the city of Paris, and Berlin lies in Germany."] * 2)

#: Prompts and their answers (the demo corpus's facts). The pairs compared are every two of the same token
#: length with different answers, the first listed as clean: the demo prompt with the Belem Tower (9 tokens; the
#: headline pair), and 19 pairs of the 8-token prompts. Chosen before any measurement; none is left out.
LANDMARKS = (
    ("The Eiffel Tower is in the city of", " Paris"),
    ("The Belem Tower is in the city of", " Lisbon"),
    ("The Colosseum is in the city of", " Rome"),
    ("The Kremlin is in the city of", " Moscow"),
    ("Big Ben is in the city of", " London"),
    ("The Acropolis is in the city of", " Athens"),
    ("The Louvre is in the city of", " Paris"),
    ("Tower Bridge is in the city of", " London"),
    ("The Pantheon is in the city of", " Rome"),
)


def pairs(model) -> list[tuple[str, str, str, str]]:
    """``(clean, answer, corrupted, answer)`` for every two `LANDMARKS` of one token length, answers differing."""
    length = {prompt: len(model.tokenizer(prompt).input_ids) for prompt, _ in LANDMARKS}
    return [(a, x, b, y) for i, (a, x) in enumerate(LANDMARKS) for b, y in LANDMARKS[i + 1:]
            if length[a] == length[b] and x != y]


def spearman(exact: torch.Tensor, estimate: torch.Tensor) -> dict[str, float]:
    """Spearman's rank correlation over the cells both have, of the signed values and of their magnitudes."""
    keep = ~exact.isnan()
    exact, estimate = exact[keep].numpy(), estimate[keep].numpy()
    return {"signed": round(float(spearmanr(exact, estimate).statistic), 3),
            "magnitude": round(float(spearmanr(abs(exact), abs(estimate)).statistic), 3)}


def _per_head(model, sweep: Callable[[str, list[int]], torch.Tensor]) -> torch.Tensor:
    """``[layers, heads]`` from ``sweep(head value, layers) -> [len(layers), heads]`` over each kind of head
    (attention heads first, then a hybrid's linear mixer heads); NaN where a layer has none."""
    report = model.support()
    out = None
    for _, _, head_value in MIXERS:
        layers = [layer for layer in report.layers_with(head_value) if out is None or bool(out[layer].isnan().all())]
        if not layers:
            continue
        swept = sweep(head_value, layers)
        if out is None:
            out = torch.full((model.num_layers, swept.shape[1]), float("nan"))
        out[layers, : swept.shape[1]] = swept
    return out


def _metrics(token: int, other: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each metric on last-position logits ``[batch, vocab]`` (``token`` the answer, ``other`` the corrupted one)."""
    return {
        "logit difference": lambda logits: logits[:, token] - logits[:, other],
        "P(answer)": lambda logits: torch.softmax(logits.float(), -1)[:, token],
        "log P(answer)": lambda logits: torch.log_softmax(logits.float(), -1)[:, token],
        "logit": lambda logits: logits[:, token],
    }


def exact_head_effects(model, prompt: str, metric: Callable) -> torch.Tensor:
    """``[layers, heads]``: ``metric`` (of the last position's logits) with the head zeroed minus clean."""
    clean = float(run_metric(model, prompt, _at_last(metric)))
    return _per_head(model, lambda value, layers: head_ablation_sweep(model, prompt, layers, value, metric=metric)
                     - clean)


def exact_patching_effects(model, clean: str, corrupted: str, metric: Callable) -> torch.Tensor:
    """``[layers, heads]``: ``metric`` of the clean run with the head's output (all positions) taken from the
    corrupted run, minus clean: what attribution patching estimates. `activation_patching` writes its first
    prompt's values into its second's run, so the corrupted prompt comes first."""
    base = float(run_metric(model, clean, metric))
    return _per_head(model, lambda value, layers: activation_patching(
        model, corrupted, clean, value, layers, positions=None, heads="each", metric=metric) - base)


def agreement() -> dict:
    """Per demo model, Spearman of attribution patching's head estimates against the exact effects."""
    results = {}
    for name in DEMO_MODELS:
        model = demo_model(name)
        row: dict = {}
        # Patching from a corrupted prompt, logit difference of the two answers: what attribution patching
        # estimates, with the metric of the literature. Every pair; the first is the headline.
        every = []
        for clean, answer, corrupted, other in pairs(model):
            metric = logit_difference(target_token(model, answer), target_token(model, other))
            exact = exact_patching_effects(model, clean, corrupted, metric)
            estimate = attribution_patching(model, clean, corrupted, metric, over=("heads",)).heads
            every.append({"pair": f"{clean!r} <- {corrupted!r}", "words differing": _words_differing(clean, corrupted),
                          **spearman(exact, estimate)})
        row["patching, logit difference"] = every[0]
        row["patching, logit difference, every pair"] = _summary(every)
        clean, answer, corrupted, other = pairs(model)[0]
        metrics = _metrics(target_token(model, answer), target_token(model, other))
        probability = _at_last(metrics["P(answer)"])
        exact = exact_patching_effects(model, clean, corrupted, probability)
        estimate = attribution_patching(model, clean, corrupted, probability, over=("heads",)).heads
        row["patching, P(answer)"] = spearman(exact, estimate)
        # Zero ablation of each head (what `nncanon ablate --fast` estimates), on the demo prompt.
        for label, metric in metrics.items():
            exact = exact_head_effects(model, clean, metric)
            estimate = attribution_patching(model, clean, None, _at_last(metric), over=("heads",),
                                            next_token_only=True).heads
            row[f"zero ablation, {label}"] = spearman(exact, estimate)
        results[name] = row
        print(f"{name}:", flush=True)
        for label, figures in row.items():
            print(f"  {label}: {figures}", flush=True)
    return results


def _at_last(metric: Callable) -> Callable:
    """``metric`` of the last position's logits, taking every position's ``[batch, seq, vocab]``."""
    return lambda logits: metric(logits[:, -1])


def _summary(every: list[dict]) -> dict:
    """Median, least and count >= 0.9 of the pairs' figures: all pairs, then by how many words the prompts differ."""
    summary = {"all": _figures(every)}
    for words in sorted({item["words differing"] for item in every}):
        summary[f"{words} word(s) differing"] = _figures([item for item in every if item["words differing"] == words])
    return {**summary, "each": every}


def _figures(every: list[dict]) -> dict:
    out: dict = {"pairs": len(every)}
    for kind in ("signed", "magnitude"):
        values = [item[kind] for item in every]
        out |= {f"{kind} median": round(statistics.median(values), 3), f"{kind} min": min(values),
                f"{kind} >= 0.9": sum(value >= 0.9 for value in values)}
    return out


def _words_differing(a: str, b: str) -> int:
    return sum(x != y for x, y in zip(a.split(), b.split(), strict=True))


def speed(repeats: int, lengths: tuple[str, ...] = ("short", "long")) -> dict:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    module = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model = StandardizedTransformer(module, tokenizer=tiny_tokenizer(), verify="never")
    prompts = [prompt for length, prompt in (("short", PROMPT), ("long", LONG_PROMPT)) if length in lengths]
    return {str(len(model.tokenizer(p).input_ids)): _speed(model, p, repeats) for p in prompts}


def _same_length(model, prompt: str) -> str:
    """``prompt`` with the Eiffel Tower replaced by another landmark of the same token length."""
    length = len(model.tokenizer(prompt).input_ids)
    for place in ("Belem", "Madrid", "Berlin", "London", "Tokyo", "Rome", "Vienna"):
        other = prompt.replace("Eiffel", place)
        if len(model.tokenizer(other).input_ids) == length:
            return other
    raise ValueError(f"no landmark gives {prompt!r}'s token length")


class _Stop(Exception):
    """Raised by a hook to end a forward after the last block (the corrupted run needs no logits)."""


def plain_attribution(module, clean: torch.Tensor, corrupted: torch.Tensor | None, metric: Callable) -> dict:
    """The same estimates as `attribution_patching` over GPT-2's heads, attention and MLP, written in plain
    PyTorch (forward hooks on the unwrapped transformers model, one `torch.autograd.grad`; no nnsight, no
    nncanon), with the same savings: the last position's logits only, the weights frozen, a leaf at the first
    block's input, the head's backward over the metric's logits only, the corrupted run stopped after the last
    block. The floor of any implementation of one forward and one backward on this machine.

    ``clean``, ``corrupted``: token ids ``[1, seq]``; returns ``{"heads": [layers, heads], "attention":
    [layers], "mlp": [layers]}``.
    """
    blocks, heads = module.transformer.h, module.config.n_head
    found: dict[str, list[torch.Tensor]] = {"heads": [], "attention": [], "mlp": []}
    hooks = []
    for block in blocks:
        hooks += [
            block.attn.c_proj.register_forward_pre_hook(lambda _, args: found["heads"].append(args[0])),
            block.attn.register_forward_hook(lambda _, args, output: found["attention"].append(output[0])),
            block.mlp.register_forward_hook(lambda _, args, output: found["mlp"].append(output)),
        ]
    try:
        patched = None
        if corrupted is not None:
            def stop(*_):
                raise _Stop

            ending = module.transformer.ln_f.register_forward_pre_hook(stop)
            with torch.no_grad(), contextlib.suppress(_Stop):
                module(corrupted, use_cache=False)
            ending.remove()
            patched = {name: values[:] for name, values in found.items()}
            for values in found.values():
                values.clear()
        entering: list[torch.Tensor] = []
        hooks += [
            blocks[0].register_forward_pre_hook(lambda _, args: (args[0].detach().requires_grad_(True), *args[1:])),
            module.lm_head.register_forward_pre_hook(lambda _, args: entering.append(args[0])),
        ]
        frozen = [parameter for parameter in module.parameters() if parameter.requires_grad]
        for parameter in frozen:
            parameter.requires_grad_(False)
        try:
            with torch.enable_grad():
                logits = module(clean, use_cache=False, logits_to_keep=1).logits
                loss = metric(logits).sum()
                values = [value for name in ("heads", "attention", "mlp") for value in found[name]]
                (outward,) = torch.autograd.grad(loss, logits, retain_graph=True)
                columns = outward.flatten(0, -2).ne(0).any(0).nonzero()[:, 0]
                inward = outward.index_select(-1, columns) @ module.lm_head.weight.index_select(0, columns)
                grads = torch.autograd.grad(entering[0], values, grad_outputs=inward)
        finally:
            for parameter in frozen:
                parameter.requires_grad_(True)
    finally:
        for hook in hooks:
            hook.remove()
    count = len(blocks)
    result = {}
    for index, name in enumerate(("heads", "attention", "mlp")):
        rows = []
        for layer in range(count):
            value, grad = found[name][layer].detach(), grads[index * count + layer]
            delta = -value if patched is None else patched[name][layer] - value
            product = delta * grad
            rows.append(product.unflatten(-1, (heads, -1)).sum(dim=(0, 1, 3)) if name == "heads" else product.sum())
        result[name] = torch.stack(rows)
    return result


def _speed(model, prompt: str, repeats: int) -> dict:
    """Wall and CPU (process) seconds of each run, interleaved, medians; the ratios of the medians."""
    tokens = len(model.tokenizer(prompt).input_ids)
    corrupted = _same_length(model, prompt)
    ids, corrupted_ids = (model.tokenizer(p, return_tensors="pt").input_ids for p in (prompt, corrupted))

    def metric_at_last(logits: torch.Tensor) -> torch.Tensor:  # the model's logits, as `full` takes them
        return logits[:, -1, 5]

    def metric(logits: torch.Tensor) -> torch.Tensor:  # the last position's logits [batch, vocab]
        return logits[:, 5]

    def full(logits: torch.Tensor) -> torch.Tensor:  # every position's [batch, seq, vocab]
        return logits[:, -1, 5]

    runs = {
        "exact zero-ablation sweep (head_ablation_sweep, 144 heads)":
            lambda: head_ablation_sweep(model, prompt, metric=metric),
        "attribution patching, zero, next_token_only (144 heads + 12 attention + 12 MLP)":
            lambda: attribution_patching(model, prompt, None, full, next_token_only=True),
        "attribution patching, zero, every position's logits":
            lambda: attribution_patching(model, prompt, None, full),
        "exact patching sweep (activation_patching heads='each', 144 heads)":
            lambda: activation_patching(model, corrupted, prompt, "attention_head_outputs", positions=None,
                                        heads="each", metric=full),
        "attribution patching, corrupted prompt, next_token_only":
            lambda: attribution_patching(model, prompt, corrupted, full, next_token_only=True),
        "plain PyTorch attribution, zero (the floor)":
            lambda: plain_attribution(model._module, ids, None, metric_at_last),
        "plain PyTorch attribution, corrupted prompt (the floor)":
            lambda: plain_attribution(model._module, ids, corrupted_ids, metric_at_last),
    }
    for source, plain_source in ((None, None), (corrupted, corrupted_ids)):  # the floor computes the same numbers
        ours = attribution_patching(model, prompt, source, full, next_token_only=True)
        plain = plain_attribution(model._module, ids, plain_source, metric_at_last)
        for item in ("heads", "attention", "mlp"):
            torch.testing.assert_close(ours[item], plain[item], rtol=1e-5, atol=1e-6)
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        run()
    load = [round(os.getloadavg()[0], 1)]
    for _ in range(repeats):
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
        load.append(round(os.getloadavg()[0], 1))
    result: dict = {"tokens": tokens, "repeats": repeats, "threads": torch.get_num_threads(),
                    "load average (1 min) before and after each repeat": load}
    for label, times in (("wall", wall), ("cpu", cpu)):
        medians = {name: statistics.median(values) for name, values in times.items()}
        names = list(medians)
        result[f"{label} seconds"] = {name: round(value, 3) for name, value in medians.items()}
        result[f"{label} speedup"] = {
            "zero ablation, next_token_only": round(medians[names[0]] / medians[names[1]], 1),
            "zero ablation, every position's logits": round(medians[names[0]] / medians[names[2]], 1),
            "patching, next_token_only": round(medians[names[3]] / medians[names[4]], 1),
            "zero ablation, plain PyTorch (the floor)": round(medians[names[0]] / medians[names[5]], 1),
            "patching, plain PyTorch (the floor)": round(medians[names[3]] / medians[names[6]], 1),
        }
        result[f"{label} nncanon over plain PyTorch"] = {
            "zero ablation": round(medians[names[1]] / medians[names[5]], 3),
            "patching": round(medians[names[4]] / medians[names[6]], 3),
        }
    print(f"GPT-2 124M, {tokens} tokens, {torch.get_num_threads()} threads, load {load}:", flush=True)
    for label in ("wall", "cpu"):
        print(f"  {label}: {result[f'{label} seconds']}\n  {label} speedup: {result[f'{label} speedup']}\n"
              f"  {label} nncanon over plain PyTorch: {result[f'{label} nncanon over plain PyTorch']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", choices=("agreement", "speed"), default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--lengths", nargs="+", choices=("short", "long"), default=("short", "long"),
                        help="the speed prompts: short (16 tokens), long (69)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
    }
    if args.only != "speed":
        report["agreement"] = agreement()
    if args.only != "agreement":
        report["speed"] = speed(args.repeats, tuple(args.lengths))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
