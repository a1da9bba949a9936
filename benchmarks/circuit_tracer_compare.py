"""Attribution graphs: nncanon against circuit-tracer 0.5.0 itself, on the same weights, transcoders and tokens.

circuit-tracer pins transformers <= 4.57.3 and nnsight 0.6.1, so it runs in a virtual environment of its own and this
script drives it as a subprocess (the same file, run by the venv's Python with ``--reference``):

    python -m venv /tmp/ct-venv
    /tmp/ct-venv/bin/pip install torch==2.13.0
    /tmp/ct-venv/bin/pip install torch==2.13.0 circuit-tracer==0.5.0 nnsight==0.6.1
    python benchmarks/circuit_tracer_compare.py                 # the comparison and the timings
    python benchmarks/circuit_tracer_compare.py --memory        # peak memory against prompt length

Per family (Llama, Gemma-2, Qwen3): the venv builds a tiny random model from a config in code and saves it (offline,
no hub), with the tokenizer nncanon's proof builds in code; random JumpReLU transcoders are written in circuit-tracer's
per-layer layout (``layer_<i>.safetensors``, ``config.yaml`` with its TransformerLens hook names: ``mlp.hook_in`` /
``mlp.hook_out``, and ``ln2.hook_normalized`` / ``hook_mlp_out`` on Gemma-2, the only input its nnsight mapping has
there). circuit-tracer builds its graph with its nnsight backend (``ReplacementModel.from_pretrained_and_transcoders
(folder, backend="nnsight")``) and its TransformerLens backend where a local model loads into it; nncanon loads the
same folder (`StandardizedTransformer`, eager attention; and under sdpa, ``ours sdpa``, where transformers loads the
family so: the pattern frozen through the kernel's query and key) and set (`nncanon.graphs.load_transcoders`) and builds
`nncanon.graphs.attribute` on the same token ids. Compared: active features and their activations, logit targets
and probabilities, selected features (with ``max_feature_nodes`` below the active count too: the influence-ranked
selection), the adjacency matrix (target: within 1e-4 absolute). Timings: the median wall and process CPU seconds
of ``--repeats`` graphs after one warm-up, each side in its own process, on the same machine and threads (CPU time
is the steadier measure on a shared machine). ``--memory``: peak resident memory of one
graph against prompt length on a 4-layer 256-wide Llama with 4,096-feature transcoders, each run in a fresh process
(nncanon under sdpa and under eager: ``--attn``; circuit-tracer with ``--reference-memory``).
Writes ``benchmarks/results-circuit-tracer-compare.json`` (and ``...-memory.json``); exits 1 where a graph differs.
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
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
TOLERANCE = 1e-4
#: Tiny configs (transformers 4.57.3 field names); the venv builds and saves each model from its seed.
CONFIGS = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rope_theta": 10000.0, "initializer_range": 0.1},
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "initializer_range": 0.1},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "rope_theta": 10000.0, "initializer_range": 0.1, "tie_word_embeddings": False},
}
COMMON = {"vocab_size": 300, "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
          "pad_token_id": 0}
#: The transcoders' hooks per family, as circuit-tracer's nnsight mapping names them.
HOOKS = {"gemma2": ("ln2.hook_normalized", "hook_mlp_out")}
#: Families transformers does not load under sdpa (no ``ours sdpa`` side).
EAGER_ONLY = ("gemma2",)
#: A TransformerLens official name whose config branch reads the model's own config (the tiny one is handed in).
TL_NAMES = {"llama": "01-ai/Yi-34B", "qwen3": "Qwen/Qwen3-0.6B"}
PROMPT = "The Eiffel Tower is in the city of Paris. Berlin lies in"


# -- the reference side (run by the venv's Python: no nncanon here) ------------------------------------------------

def make_model(family: str, folder: Path, seed: int = 0, overrides: dict | None = None) -> None:
    """Build the tiny model of ``family`` from its config (transformers 4.57.3) and save it to ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**COMMON, **CONFIGS[family], **(overrides or {})}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.save_pretrained(folder)


def _reference_transcoders(spec: dict):
    import yaml
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    config_path = Path(spec["transcoders"])
    cfg = yaml.safe_load(config_path.read_text())
    paths = {int(e["layer"]): str(config_path.parent / e["filepath"]) for e in cfg["transcoders"]}
    return load_transcoder_set(paths, scan=cfg.get("scan", "compare"), feature_input_hook=cfg["feature_input_hook"],
                               feature_output_hook=cfg["feature_output_hook"], device=torch.device("cpu"),
                               dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)


def _tl_model(spec: dict, transcoders):
    """circuit-tracer's TransformerLens backend on the local model: HookedTransformer reads the tiny config (its
    hub lookup answered with it) and converts the local weights (``hf_model=``)."""
    import transformer_lens.loading_from_pretrained as loading
    from circuit_tracer import ReplacementModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(spec["model"])
    hf = AutoModelForCausalLM.from_pretrained(spec["model"], attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    loading.AutoConfig.from_pretrained = staticmethod(lambda *args, **kwargs: config)
    return ReplacementModel.from_pretrained_and_transcoders(
        spec["tl_name"], transcoders, backend="transformerlens", device=torch.device("cpu"), dtype=torch.float32,
        hf_model=hf, tokenizer=tokenizer)


def reference(spec: dict) -> dict:
    """circuit-tracer's graph of ``spec`` (its backend, options, token ids); tensors saved to ``spec["out"]``."""
    from circuit_tracer import ReplacementModel, attribute

    torch.set_num_threads(spec["threads"])
    transcoders = _reference_transcoders(spec)
    if spec["backend"] == "nnsight":
        model = ReplacementModel.from_pretrained_and_transcoders(spec["model"], transcoders, backend="nnsight",
                                                                 device=torch.device("cpu"), dtype=torch.float32)
    else:
        model = _tl_model(spec, transcoders)
    ids = torch.tensor(spec["ids"])
    options = {key: spec[key] for key in ("max_n_logits", "desired_logit_prob", "batch_size", "max_feature_nodes")}
    times, cpu, graph = [], [], None
    for _ in range(spec["repeats"] + 1):
        started, started_cpu = time.perf_counter(), time.process_time()
        graph = attribute(ids, model, **options)
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    torch.save({"active_features": graph.active_features, "activation_values": graph.activation_values,
                "selected_features": graph.selected_features, "adjacency_matrix": graph.adjacency_matrix,
                "logit_targets": torch.tensor([t.vocab_idx for t in graph.logit_targets]),
                "logit_probabilities": graph.logit_probabilities, "input_tokens": graph.input_tokens}, spec["out"])
    warm = slice(1, None) if spec["repeats"] else slice(None)
    return {"seconds": times[warm], "cpu_seconds": cpu[warm], "peak_rss_mb": _peak_mb()}


def _peak_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


# -- the nncanon side ------------------------------------------------------------------------------------------------

def write_transcoders(folder: Path, n_layers: int, d_model: int, d_sae: int, seed: int = 0,
                      density: float = 0.06) -> Path:
    """Random JumpReLU transcoders in circuit-tracer's per-layer layout and its ``config.yaml``; thresholds set so
    about ``density`` of the features fire on a unit-variance input."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for layer in range(n_layers):
        w_enc = torch.randn(d_sae, d_model, generator=generator) / d_model ** 0.5
        threshold = torch.full((d_sae,), float(torch.distributions.Normal(0, 1).icdf(torch.tensor(1 - density))))
        weights = {"W_enc": w_enc, "b_enc": 0.1 * torch.randn(d_sae, generator=generator),
                   "W_dec": torch.randn(d_sae, d_model, generator=generator) / d_sae ** 0.5,
                   "b_dec": 0.01 * torch.randn(d_model, generator=generator),
                   "activation_function.threshold": threshold}
        save_file(weights, str(folder / f"layer_{layer}.safetensors"))
    return folder


def write_config(folder: Path, n_layers: int, reads: str, writes: str) -> Path:
    import yaml

    entries = [{"id": f"layer-{layer}", "layer": layer, "filepath": f"layer_{layer}.safetensors"}
               for layer in range(n_layers)]
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump({"model_name": "tiny", "scan": "compare", "feature_input_hook": reads,
                                    "feature_output_hook": writes, "transcoders": entries}, sort_keys=False))
    return path


def ours(spec: dict) -> dict:
    """nncanon's graph of ``spec`` (run in a process of its own, as the reference is)."""
    from nncanon import StandardizedTransformer, graphs

    torch.set_num_threads(spec["threads"])
    model = StandardizedTransformer(spec["model"], attn_implementation=spec.get("attn", "eager"))
    transcoders = graphs.load_transcoders(spec["transcoders"])
    options = {key: spec[key] for key in ("max_n_logits", "desired_logit_prob", "batch_size", "max_feature_nodes")}
    ids = torch.tensor([spec["ids"]])
    reason = graphs.support(model)
    if reason is not None:
        return {"declined": reason}
    times, cpu, graph = [], [], None
    for _ in range(spec["repeats"] + 1):
        started, started_cpu = time.perf_counter(), time.process_time()
        graph = graphs.attribute(model, ids, transcoders, **options)
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    torch.save({"active_features": graph.active_features, "activation_values": graph.activation_values,
                "selected_features": graph.selected_features, "adjacency_matrix": graph.adjacency_matrix,
                "logit_targets": graph.logit_targets, "logit_probabilities": graph.logit_probabilities,
                "input_tokens": graph.input_tokens}, spec["out"])
    warm = slice(1, None) if spec["repeats"] else slice(None)
    return {"seconds": times[warm], "cpu_seconds": cpu[warm], "peak_rss_mb": _peak_mb()}


def run_side(python: str, side: str, spec: dict, timeout: int = 3600) -> dict:
    """Run ``side`` (``reference`` or ``ours``) of ``spec`` in a fresh process of ``python``; its record."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if side == "reference":
        env.pop("PYTHONPATH", None)
    done = subprocess.run([python, str(HERE), "--side", side, json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}",
                "stderr_tail": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(a_path: str, b_path: str) -> dict:
    """What differs between two saved graphs (``a``: circuit-tracer's, ``b``: nncanon's)."""
    a, b = torch.load(a_path), torch.load(b_path)
    out = {"active_features": len(a["active_features"]),
           "active_equal": bool(torch.equal(a["active_features"].long(), b["active_features"].long())),
           "logit_targets_equal": bool(torch.equal(a["logit_targets"].long(), b["logit_targets"].long())),
           "selected_equal": bool(torch.equal(a["selected_features"].long(), b["selected_features"].long())),
           "n_nodes": int(a["adjacency_matrix"].shape[0])}
    if out["active_equal"]:
        out["activation_max_abs"] = float((a["activation_values"].float() - b["activation_values"].float())
                                          .abs().max()) if len(a["activation_values"]) else 0.0
    if out["logit_targets_equal"]:
        out["logit_prob_max_abs"] = float((a["logit_probabilities"].float() - b["logit_probabilities"].float())
                                          .abs().max())
    if a["adjacency_matrix"].shape == b["adjacency_matrix"].shape:
        diff = (a["adjacency_matrix"] - b["adjacency_matrix"]).abs()
        out["adjacency_max_abs"] = float(diff.max())
        out["adjacency_scale"] = float(a["adjacency_matrix"].abs().max())
    out["equal"] = bool(out["active_equal"] and out["logit_targets_equal"] and out["selected_equal"]
                        and out.get("adjacency_max_abs", 1.0) <= TOLERANCE)
    return out


def prepare(family: str, root: Path, venv_python: str, overrides: dict | None = None, d_sae: int = 64,
            density: float = 0.06) -> dict:
    """The model folder ``root/model`` (built by the venv), its tokenizer and transcoder set; returns the paths."""
    from nncanon.proof.prompts import tiny_tokenizer

    model_dir, tc_dir = root / "model", root / "transcoders"
    if not (model_dir / "config.json").exists():
        code = (f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); import circuit_tracer_compare as c; "
                f"c.make_model({family!r}, __import__('pathlib').Path({str(model_dir)!r}), 0, {overrides!r})")
        subprocess.run([venv_python, "-c", code], check=True, env={k: v for k, v in os.environ.items()
                                                                   if k != "PYTHONPATH"})
        tiny_tokenizer().save_pretrained(model_dir)
        tokenizer_config = model_dir / "tokenizer_config.json"  # the class transformers 4.57 knows it by
        record = json.loads(tokenizer_config.read_text())
        record.update(tokenizer_class="PreTrainedTokenizerFast")
        record.pop("backend", None)
        tokenizer_config.write_text(json.dumps(record, indent=2))
    config = json.loads((model_dir / "config.json").read_text())
    reads, writes = HOOKS.get(family, ("mlp.hook_in", "mlp.hook_out"))
    write_transcoders(tc_dir, config["num_hidden_layers"], config["hidden_size"], d_sae, density=density)
    return {"model": str(model_dir), "transcoders": str(write_config(tc_dir, config["num_hidden_layers"], reads,
                                                                      writes))}


#: The 4-layer 256-wide Llama of the timing and memory runs (4,096-feature transcoders).
WIDE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4}


def prompt_ids(n_pos: int | None = None) -> list[int]:
    """BOS and `PROMPT`'s tokens; with ``n_pos``, the prompt's tokens repeated to ``n_pos`` positions."""
    from nncanon.proof.prompts import tiny_tokenizer

    tokens = tiny_tokenizer()(PROMPT, add_special_tokens=False).input_ids
    if n_pos is None:
        return [1, *tokens]
    return [1, *(tokens * (n_pos // len(tokens) + 1))][:n_pos]


def cases(families: list[str]) -> list[tuple[str, str, dict | None, int, list[int], list[tuple[str, int | None]]]]:
    """(name, family, config overrides, features per transcoder, token ids, [(label, max_feature_nodes)])."""
    out = [(family, family, None, 64, prompt_ids(), [("all features", None), ("max_feature_nodes=24", 24)])
           for family in families if family in CONFIGS]
    if "wide" in families:
        out.append(("llama-256x4", "llama", WIDE, 4096, prompt_ids(64), [("max_feature_nodes=256", 256)]))
    return out


def main_compare(args: argparse.Namespace) -> int:
    root = Path(args.work)
    results, failed = [], False
    for name, family, overrides, d_sae, ids, graphs_ in cases(args.families):
        paths = prepare(family, root / name, args.venv_python, overrides=overrides, d_sae=d_sae)
        for label, cap in graphs_:
            spec = {**paths, "ids": ids, "max_n_logits": 5, "desired_logit_prob": 0.95, "batch_size": 16,
                    "max_feature_nodes": cap, "threads": args.threads, "repeats": args.repeats}
            row = {"family": name, "graph": label, "n_pos": len(ids)}
            sides = {"ours": ("ours", sys.executable, {}), "circuit-tracer nnsight": ("reference", args.venv_python,
                                                                                      {"backend": "nnsight"})}
            if "sdpa" in args.attn and family not in EAGER_ONLY:
                sides["ours sdpa"] = ("ours", sys.executable, {"attn": "sdpa"})
            if family in TL_NAMES and overrides is None:
                sides["circuit-tracer transformerlens"] = ("reference", args.venv_python,
                                                           {"backend": "transformerlens", "tl_name": TL_NAMES[family]})
            saved = {}
            for side_name, (side, python, extra) in sides.items():
                out = str(root / name / f"{side}-{extra.get('backend', 'nncanon')}-{extra.get('attn', '')}{cap}.pt")
                record = run_side(python, side, {**spec, **extra, "out": out})
                if "seconds" in record:
                    record["median_s"] = round(statistics.median(record["seconds"]), 4)
                    record["median_cpu_s"] = round(statistics.median(record["cpu_seconds"]), 4)
                    saved[side_name] = out
                row[side_name] = record
                print(name, label, side_name, {k: v for k, v in record.items() if k != "stderr_tail"}, flush=True)
            for side_name in saved:
                if side_name != "circuit-tracer nnsight" and "circuit-tracer nnsight" in saved:
                    key = f"{side_name} vs circuit-tracer nnsight"
                    row[key] = compare(saved["circuit-tracer nnsight"], saved[side_name])
                    print("  ", key, row[key], flush=True)
                    failed |= side_name.startswith("ours") and not row[key]["equal"]
            for ours_side in ("ours", "ours sdpa"):
                if ours_side in saved and "circuit-tracer nnsight" in saved:
                    label_ = ours_side.replace(" ", "_")
                    for key in ("median_s", "median_cpu_s"):
                        row[f"ratio_{label_}_over_nnsight_{key}"] = round(row[ours_side][key]
                                                                          / row["circuit-tracer nnsight"][key], 3)
            results.append(row)
            write(args.out, {"machine": machine(args.threads), "tolerance": TOLERANCE, "prompt": PROMPT,
                             "rows": results})  # after each graph: a long run keeps what it measured
    return 1 if failed else 0


def main_memory(args: argparse.Namespace) -> int:
    root = Path(args.work) / "memory"
    paths = prepare("llama", root, args.venv_python, overrides=WIDE, d_sae=4096, density=0.01)
    rows = []
    for n_pos in args.lengths:
        spec = {**paths, "ids": prompt_ids(n_pos), "max_n_logits": 4, "desired_logit_prob": 0.95,
                "batch_size": args.batch_size, "max_feature_nodes": args.max_feature_nodes, "threads": args.threads,
                "repeats": 0}
        row = {"n_pos": n_pos}
        sides = [(f"ours {attn}", "ours", sys.executable, attn) for attn in args.attn]
        if args.reference_memory:
            sides.append(("circuit-tracer nnsight", "reference", args.venv_python, "eager"))
        for name, side, python, attn in sides:
            out = str(root / f"{side}-{attn}-{n_pos}.pt")
            row[name] = run_side(python, side, {**spec, "backend": "nnsight", "attn": attn, "out": out})
            print(n_pos, name, {k: v for k, v in row[name].items() if k != "stderr_tail"}, flush=True)
        rows.append(row)
        write(args.out.replace(".json", "-memory.json"),
              {"machine": machine(args.threads), "model": "llama, 4 layers, 256 wide, 4 heads",
               "transcoders": "4,096 JumpReLU features per layer, about 1% active", "batch_size": args.batch_size,
               "max_feature_nodes": args.max_feature_nodes, "rows": rows})
    return 0


def machine(threads: int) -> dict:
    from importlib.metadata import version

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": threads,
            "python": platform.python_version(), "torch": torch.__version__, "transformers (nncanon)":
            version("transformers"), "nnsight (nncanon)": version("nnsight")}


def write(path: str, record: dict) -> None:
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
    print("wrote", path, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["reference", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--venv-python", default="/tmp/ct-venv/bin/python")
    parser.add_argument("--families", nargs="+", default=[*CONFIGS, "wide"],
                        help="families of CONFIGS, and 'wide' (the 4-layer 256-wide Llama, 4,096 features, 64 tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ct-compare"))
    parser.add_argument("--out", default=str(HERE.parent / "results-circuit-tracer-compare.json"))
    parser.add_argument("--memory", action="store_true", help="peak memory against prompt length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-feature-nodes", type=int, default=64)
    parser.add_argument("--reference-memory", action="store_true", help="measure circuit-tracer's memory too")
    parser.add_argument("--attn", nargs="+", default=["eager", "sdpa"], choices=["eager", "sdpa"],
                        help="nncanon's attention implementations (the comparison: 'ours' is eager, 'ours sdpa' "
                             "beside it; --memory: one row each)")
    args = parser.parse_args()
    if args.side:
        spec = json.loads(args.spec)
        record = reference(spec) if args.side == "reference" else ours(spec)
        print(json.dumps(record))
        return 0
    return main_memory(args) if args.memory else main_compare(args)


if __name__ == "__main__":
    sys.exit(main())
