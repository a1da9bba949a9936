"""nncanon against raw nnsight and plain transformers: speed, load time, batched heads, memory.

Run:  python benchmarks/bench.py [--repeats 15] [--threads N] [--json out.json] [--models gpt2 llama]
      [--measures trace neurons load folder heads memory proof]

Every ratio is measured in one run, on the same model object, with interleaved repeats so that
machine noise hits both sides alike; figures are medians. Models are built from configs with
random weights (no download): a GPT-2-small-sized GPT-2 (124M parameters) and a Llama of similar
size; batch 8 x 32 tokens, CPU, fp32.

What is compared, per model:
- trace: a standardized trace that reads (saves) every standard value of every layer, and one
  that writes each contribution, against raw nnsight doing the same on native module paths
  (target <= 1.05x), and against a plain transformers forward with PyTorch hooks (reported);
- load: StandardizedTransformer(module) against TransformersModel(module) (target <= 1.10x): the wrap of
  a model already in memory, whose proof is cached; no file is read, so this is nncanon's own cost at its
  most visible;
- load from a folder (reported): what a user types, StandardizedTransformer(folder) against
  TransformersModel(folder, tokenizer=AutoTokenizer.from_pretrained(folder)), with the model built on
  meta (nnsight's default: the weights are read at the first trace) and with its weights read
  (dispatch=True);
- heads: every head of one block ablated, one invoke per head, against one trace per head (target
  >= 4x faster at 12 heads): `head_ablation_sweep` (the invokes resume at the block after one
  forward of the blocks before it, and compute the last position's logits only), and the plain
  batched invokes of one trace (reported: on a CPU the forward of 12 rows costs nearly 12 forwards
  of one, so batching alone cannot reach 4x there);
- memory: peak RSS growth of the read-everything trace, standardized against raw nnsight
  (target <= 1.05x), each measured in a fresh subprocess;
- sdpa probabilities: a trace under sdpa reading one layer's attention probabilities (recomputed from
  the kernel's inputs) at 1 x 512 tokens, against a plain sdpa trace (target <= 1.10x) and against the
  same read under eager (faster and lighter: peak RSS growth of the trace, fresh process each);
- proof: the load-time proof of a config nobody proved yet (twin built, every check run), for the
  full-size default configs of dense families (target <= 2 s) and hybrid / MoE ones (<= 5 s); the
  `load` figure above is a load whose proof is cached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from nnsight.modeling.transformers import TransformersModel

from nncanon import StandardizedTransformer
from nncanon.testing import tiny_tokenizer
from nncanon.tools import head_ablation_sweep

BATCH, SEQ = 8, 32
#: What `main` can measure (``--measures``).
MEASURES = ("trace", "neurons", "load", "folder", "heads", "memory", "proof", "sdpa-probabilities")


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    else:
        config = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
        )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def inputs(model: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, model.config.vocab_size, (BATCH, SEQ), generator=generator)


def native(model: Any) -> dict:
    """Native paths of the standard values (what a raw nnsight user writes)."""
    if hasattr(model, "transformer"):
        blocks = model.transformer.h
        return {"blocks": blocks, "attn": lambda b: b.attn, "o_proj": lambda b: b.attn.c_proj, "mlp": lambda b: b.mlp}
    blocks = model.model.layers
    return {"blocks": blocks, "attn": lambda b: b.self_attn, "o_proj": lambda b: b.self_attn.o_proj,
            "mlp": lambda b: b.mlp}


def trace_standard(model: StandardizedTransformer, ids: torch.Tensor, write: bool) -> None:
    with torch.no_grad(), model.trace(ids):
        for layer in model.layers:
            layer.layer_input.save()
            heads = layer.self_attn.attention_head_outputs
            attention = layer.self_attn.attention_output
            mlp = layer.mlp.mlp_output
            if write:
                heads[:, :, 0] = 0
                attention[:, -1] = 0
                mlp[:, -1] = 0
            else:
                heads.save()
                attention.save()
                mlp.save()
            layer.layer_output.save()
        model.logits.save()


def trace_raw(model: TransformersModel, ids: torch.Tensor, write: bool) -> None:
    paths = native(model)
    with torch.no_grad(), model.trace(ids):
        for block in paths["blocks"]:
            block.input.save()
            heads = paths["o_proj"](block).input
            attention = paths["attn"](block).output[0]
            mlp = paths["mlp"](block).output
            if write:
                heads.view(*heads.shape[:2], 12, -1)[:, :, 0] = 0
                attention[:, -1] = 0
                mlp[:, -1] = 0
            else:
                heads.view(*heads.shape[:2], 12, -1).save()
                attention.save()
                mlp.save()
            block.output.save()
        model.output.logits.save()


def neurons_standard(model: StandardizedTransformer, ids: torch.Tensor) -> None:
    """Every block's neurons (``mlp.neurons``) saved, one trace."""
    with torch.no_grad(), model.trace(ids):
        for layer in model.layers:
            layer.mlp.neurons.save()


def neurons_raw(model: TransformersModel, ids: torch.Tensor) -> None:
    """Every block's down projection's input saved, as a raw nnsight user reads the neurons."""
    with torch.no_grad(), model.trace(ids):
        for block in native(model)["blocks"]:
            down = block.mlp.c_proj if hasattr(block.mlp, "c_proj") else block.mlp.down_proj
            down.input.save()


def forward_hooks(module: torch.nn.Module, ids: torch.Tensor, write: bool) -> None:
    """The same reads/writes with plain PyTorch hooks on the bare model."""
    paths = native(module)
    kept: list = []
    handles = []

    def keep_input(m, args, kwargs):
        kept.append(args[0] if args else next(iter(kwargs.values())))

    def heads_hook(m, args):
        x = args[0]
        if write:
            x.view(*x.shape[:2], 12, -1)[:, :, 0] = 0
        else:
            kept.append(x.view(*x.shape[:2], 12, -1))

    def attn_hook(m, args, out):
        if write:
            out[0][:, -1] = 0
        else:
            kept.append(out[0])

    def mlp_hook(m, args, out):
        if write:
            out[:, -1] = 0
        else:
            kept.append(out)

    for block in paths["blocks"]:
        handles.append(block.register_forward_pre_hook(keep_input, with_kwargs=True))
        handles.append(paths["o_proj"](block).register_forward_pre_hook(heads_hook))
        handles.append(paths["attn"](block).register_forward_hook(attn_hook))
        handles.append(paths["mlp"](block).register_forward_hook(mlp_hook))
        handles.append(block.register_forward_hook(lambda m, a, out: kept.append(out)))
    try:
        with torch.no_grad():
            module(ids)
    finally:
        for handle in handles:
            handle.remove()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(cases: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per case, the cases run round-robin after one warm-up each."""
    for fn in cases.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            samples[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in samples.items()}


def head_sweep(model: StandardizedTransformer, ids: torch.Tensor, layer: int, how: str) -> None:
    """Every head of block ``layer`` zeroed in turn, P(next token) recorded: three ways.

    ``one_trace_per_head``: a trace per head. ``batched_invokes``: one trace, one invoke per head.
    ``sweep``: `head_ablation_sweep`, the batched invokes resuming at ``layer`` after one forward of
    the blocks before it, computing the last position's logits only.
    """
    prompt = ids[:1]
    if how == "sweep":
        head_ablation_sweep(model, prompt, layers=[layer])
    elif how == "batched_invokes":
        with torch.no_grad(), model.trace() as tracer:
            for head in range(model.num_heads):
                with tracer.invoke(prompt):
                    model.layers[layer].self_attn.attention_head_outputs[..., head, :] = 0
                    model.next_token_probs.save()
    else:
        for head in range(model.num_heads):
            with torch.no_grad(), model.trace(prompt):
                model.layers[layer].self_attn.attention_head_outputs[..., head, :] = 0
                model.next_token_probs.save()


def peak_memory(name: str, which: str) -> float:
    """Peak RSS growth (MB) of one read-everything trace, in a fresh process."""
    code = (
        "import resource, sys, torch; sys.argv=['x']; import bench as b;"
        f"m=b.build({name!r}); ids=b.inputs(m);"
        "from nncanon import StandardizedTransformer; from nnsight.modeling.transformers import TransformersModel;"
        "t=b.tiny_tokenizer();"
        f"w=StandardizedTransformer(m, tokenizer=t) if {which!r}=='standard' else TransformersModel(m, tokenizer=t);"
        f"f=b.trace_standard if {which!r}=='standard' else b.trace_raw; f(w, ids, False);"
        "base=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; f(w, ids, False); f(w, ids, False);"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    return float(out.stdout.strip().splitlines()[-1])


#: The prompt length and the layer of the sdpa-probabilities section.
PROBABILITY_SEQ, PROBABILITY_LAYER = 512, 6


def probability_trace(model: StandardizedTransformer, ids: torch.Tensor, read: bool) -> None:
    """One trace saving the last position's logits, and block `PROBABILITY_LAYER`'s attention probabilities
    where ``read``. (Last-position logits only: a 512 x 50k logit matrix would be the peak of every case.)"""
    with torch.no_grad(), model.trace(ids, logits_to_keep=1):
        if read:
            model.layers[PROBABILITY_LAYER].self_attn.attention_probabilities.save()
        model.logits.save()


def probability_model(name: str, implementation: str) -> StandardizedTransformer:
    module = build(name)
    module.set_attn_implementation(implementation)
    return StandardizedTransformer(module, tokenizer=tiny_tokenizer())


def probability_ids(model: Any) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    return torch.randint(3, model._module.config.vocab_size, (1, PROBABILITY_SEQ), generator=generator)


def probability_memory(name: str, implementation: str, read: bool) -> float:
    """Peak RSS growth (MB) of one `probability_trace` over the RSS before it, in a fresh process (the
    kernel's high-water mark reset through ``/proc/self/clear_refs`` after a warm-up trace)."""
    code = (
        "import sys; sys.argv=['x']; import bench as b;"
        f"m=b.probability_model({name!r}, {implementation!r}); ids=b.probability_ids(m);"
        f"b.probability_trace(m, ids, {read!r});"
        "status=lambda key: int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]);"
        "open('/proc/self/clear_refs','w').write('5'); before=status('VmRSS:');"
        f"b.probability_trace(m, ids, {read!r});"
        "print((status('VmHWM:')-before)/1024)"
    )
    # Every allocation over 64 KiB mapped and unmapped on its own: the RSS follows the live tensors (glibc's
    # defaults keep freed memory for reuse, so a second trace's growth would measure fragmentation instead).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), env=env)
    return float(out.stdout.strip().splitlines()[-1])


def sdpa_probabilities(name: str, repeats: int) -> dict:
    """Probabilities of one layer under sdpa (recomputed) against a plain sdpa trace and eager."""
    sdpa, eager = probability_model(name, "sdpa"), probability_model(name, "eager")
    ids = probability_ids(sdpa)
    times = interleaved(
        {
            "sdpa_plain": lambda: probability_trace(sdpa, ids, False),
            "sdpa_probabilities": lambda: probability_trace(sdpa, ids, True),
            "eager_probabilities": lambda: probability_trace(eager, ids, True),
        },
        repeats,
    )
    memory = {
        "sdpa_plain": probability_memory(name, "sdpa", False),
        "sdpa_probabilities": probability_memory(name, "sdpa", True),
        "eager_probabilities": probability_memory(name, "eager", True),
    }
    return {
        "model": name, "tokens": PROBABILITY_SEQ, "layer": PROBABILITY_LAYER, "seconds": times,
        "peak_rss_growth_mb": memory,
        "vs_sdpa_plain": times["sdpa_probabilities"] / times["sdpa_plain"],
        "vs_eager": times["sdpa_probabilities"] / times["eager_probabilities"],
        "memory_vs_eager": memory["sdpa_probabilities"] / memory["eager_probabilities"],
    }


def print_sdpa_probabilities(results: list[dict]) -> None:
    print(f"{'sdpa probabilities':18} {'vs sdpa':>8} {'vs eager':>9} {'mem MB':>8} {'eager MB':>9} {'plain MB':>9}")
    for r in results:
        memory = r["peak_rss_growth_mb"]
        print(f"{r['model']:18} {r['vs_sdpa_plain']:8.3f} {r['vs_eager']:9.3f} {memory['sdpa_probabilities']:8.1f} "
              f"{memory['eager_probabilities']:9.1f} {memory['sdpa_plain']:9.1f}")


#: Full-size default configs whose first proof is timed: dense, then hybrid and MoE.
PROOF_CONFIGS = {
    "dense": ("GPT2Config", "LlamaConfig", "Gemma2Config", "Qwen3Config", "OlmoConfig"),
    "hybrid_moe": ("MixtralConfig", "Qwen3NextConfig", "JambaConfig", "GraniteMoeHybridConfig",
                   "DeepseekV3Config"),
}

#: Where a default config is no real checkpoint's: Granite-4's layout (transformers' default has no attention).
PROOF_SETTINGS = {"GraniteMoeHybridConfig": {
    "num_hidden_layers": 40,
    "layer_types": ["full_attention" if i % 6 == 5 else "linear_attention" for i in range(40)]}}


def proofs(repeats: int) -> dict:
    """Seconds of a first (uncached) load-time proof of each config in `PROOF_CONFIGS`, medians; and of its
    gradient checks alone (``gradient_seconds``, on the twin, one thread as the proof runs them)."""
    from nncanon.families import REGISTRY
    from nncanon.proof.checks import CHECKS
    from nncanon.proof.load import mounted_twin, prove
    from nncanon.proof.twin import build_twin, model_class_for
    from nncanon.proof.verdict import verify

    gradient_checks = [check for check in CHECKS if check.gradient]
    result: dict = {}
    for kind, names in PROOF_CONFIGS.items():
        for name in names:
            config = getattr(transformers, name)(**PROOF_SETTINGS.get(name, {}))
            family, cls = REGISTRY[config.model_type], model_class_for(config)
            times = [timed(lambda c=config, f=family, k=cls: prove(c, f, k, mode="always"))
                     for _ in range(max(3, repeats // 3))]
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                twin = mounted_twin(build_twin(config, model_class=cls, blocks=family.layers).model, family)
                gradients = [timed(lambda t=twin: verify(t, gradient_checks)) for _ in range(max(3, repeats // 3))]
            finally:
                torch.set_num_threads(threads)
            result[name] = {"kind": kind, "seconds": statistics.median(times),
                            "gradient_seconds": statistics.median(gradients)}
    return result


def folder_loads(module: torch.nn.Module, tokenizer: Any, repeats: int) -> dict:
    """Seconds of a load from a saved folder, nncanon against nnsight, medians: ``meta`` (the model built on
    meta, nnsight's default) and ``weights`` (``dispatch=True``: the weights read too). The proof is cached
    (a first load before the timing proves the config)."""
    from transformers import AutoTokenizer

    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="nncanon-bench-folder-") as folder:
        module.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        StandardizedTransformer(folder)
        for how, options in (("meta", {}), ("weights", {"dispatch": True})):
            result[how] = interleaved(
                {
                    "standard": lambda o=options: StandardizedTransformer(folder, **o),
                    "raw_nnsight": lambda o=options: TransformersModel(
                        folder, tokenizer=AutoTokenizer.from_pretrained(folder), task="text-generation", **o),
                },
                repeats,
            )
    return result


def run(name: str, repeats: int, measures: tuple[str, ...] = MEASURES) -> dict:
    module = build(name)
    ids = inputs(module)
    tokenizer = tiny_tokenizer()
    standard = StandardizedTransformer(module, tokenizer=tokenizer)
    raw = TransformersModel(module, tokenizer=tokenizer)
    result: dict = {"model": name, "parameters_m": round(sum(p.numel() for p in module.parameters()) / 1e6, 1)}

    for write in (False, True) if "trace" in measures else ():
        kind = "write" if write else "read"
        times = interleaved(
            {
                "standard": lambda w=write: trace_standard(standard, ids, w),
                "raw_nnsight": lambda w=write: trace_raw(raw, ids, w),
                "plain_hooks": lambda w=write: forward_hooks(module, ids, w),
            },
            repeats,
        )
        result[f"trace_{kind}_s"] = times
        result[f"trace_{kind}_vs_raw"] = times["standard"] / times["raw_nnsight"]
        result[f"trace_{kind}_vs_hooks"] = times["standard"] / times["plain_hooks"]

    if "neurons" in measures:
        times = interleaved({"standard": lambda: neurons_standard(standard, ids),
                             "raw_nnsight": lambda: neurons_raw(raw, ids)}, repeats)
        result["neurons_s"] = times
        result["neurons_vs_raw"] = times["standard"] / times["raw_nnsight"]

    if "load" in measures:
        loads = interleaved(
            {
                "standard": lambda: StandardizedTransformer(module, tokenizer=tokenizer),
                "raw_nnsight": lambda: TransformersModel(module, tokenizer=tokenizer),
            },
            repeats,
        )
        result["load_s"] = loads
        result["load_vs_raw"] = loads["standard"] / loads["raw_nnsight"]

    if "folder" in measures:
        folder = folder_loads(module, tokenizer, repeats)
        for how, times in folder.items():
            result[f"load_folder_{how}_s"] = times
            result[f"load_folder_{how}_vs_raw"] = times["standard"] / times["raw_nnsight"]

    if "heads" not in measures:
        return _memory(result, name, measures)
    heads = interleaved(
        {how: lambda how=how: head_sweep(standard, ids, 6, how)
         for how in ("sweep", "batched_invokes", "one_trace_per_head")},
        max(3, repeats // 3),
    )
    result["heads_s"] = heads
    result["heads_speedup"] = heads["one_trace_per_head"] / heads["sweep"]
    result["heads_speedup_invokes_only"] = heads["one_trace_per_head"] / heads["batched_invokes"]
    return _memory(result, name, measures)


def _memory(result: dict, name: str, measures: tuple[str, ...]) -> dict:
    if "memory" in measures:
        memory = {which: peak_memory(name, which) for which in ("standard", "raw")}
        result["peak_rss_mb"] = memory
        result["memory_vs_raw"] = memory["standard"] / memory["raw"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--measures", nargs="+", default=list(MEASURES), choices=MEASURES,
                        help="what to measure (default: everything)")
    args = parser.parse_args()
    measures = tuple(args.measures)
    os.environ.setdefault("NNCANON_CACHE", tempfile.mkdtemp(prefix="nncanon-bench-"))  # start with no proofs
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "nnsight": __import__("nnsight").__version__,
    }
    machine["load_average_before"] = os.getloadavg()
    results = [run(name, args.repeats, measures) for name in args.models]
    proof_times = proofs(args.repeats) if "proof" in measures else {}
    probabilities = ([sdpa_probabilities(name, args.repeats) for name in args.models]
                     if "sdpa-probabilities" in measures else [])
    machine["load_average_after"] = os.getloadavg()
    print(json.dumps({"machine": machine}, indent=None))
    columns = [("read/raw", "trace_read_vs_raw"), ("write/raw", "trace_write_vs_raw"),
               ("neurons/raw", "neurons_vs_raw"), ("read/hooks", "trace_read_vs_hooks"), ("load/raw", "load_vs_raw"),
               ("folder/raw", "load_folder_meta_vs_raw"), ("+weights/raw", "load_folder_weights_vs_raw"),
               ("heads x", "heads_speedup"), ("invokes x", "heads_speedup_invokes_only"),
               ("mem/raw", "memory_vs_raw")]
    columns = [(title, key) for title, key in columns if any(key in r for r in results)]
    print(f"{'model':6} " + " ".join(f"{title:>12}" for title, _ in columns))
    for r in results:
        print(f"{r['model']:6} " + " ".join(f"{r[key]:12.3f}" if key in r else f"{'':12}" for _, key in columns))
    if proof_times:
        print(f"{'first proof of':24} {'kind':10} {'seconds':>8} {'of which gradients':>19}")
    for config_name, figure in proof_times.items():
        print(f"{config_name:24} {figure['kind']:10} {figure['seconds']:8.2f} {figure['gradient_seconds']:19.2f}")
    if probabilities:
        print_sdpa_probabilities(probabilities)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"machine": machine, "results": results, "proofs": proof_times,
                       "sdpa_probabilities": probabilities}, handle, indent=2)


if __name__ == "__main__":
    main()
