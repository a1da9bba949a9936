"""Load the default config of every causal-LM config class of the installed transformers, as a new user would.

Each config (``AutoConfig.for_model(model_type)``: most are their flagship checkpoint's, ``GPTJConfig()`` is
GPT-J-6B) is saved as a folder with its ``config.json`` and a tokenizer, and loaded with
``StandardizedTransformer(folder, verify="always")`` (built on meta; the proof runs on its twin, in a fresh
proof cache). Prints one row per model type and a summary:

- ``proved``: every value the family serves was proved on a twin (the ladder's step says which);
- ``check failed``: a twin ran and a check failed on it (the values it covers are declined, with the numbers);
- ``no twin runs``: every twin's forward raises transformers' own error (the config is one transformers cannot
  run, e.g. a default with no experts per token): every value is declined for that one reason;
- ``not built``: transformers cannot build a model of the config (its default is incomplete): the load raises
  transformers' error;
- ``out of scope``: not a decoder-only residual-stream model (an encoder, an encoder-decoder's decoder...).

Usage::

    python benchmarks/default_configs.py [--types gptj rwkv ...] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def _proof_cpu_timed(into: list[float]) -> Iterator[None]:
    """Note in ``into`` the CPU time of each first proof made inside the block (`nncanon.proof.load.prove`
    runs on this thread with one torch thread: its CPU time is its wall time on an idle machine, and what a
    busy machine cannot inflate)."""
    from nncanon.proof import load as proof_load

    prove = proof_load.prove

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return prove(*args, **kwargs)
        finally:
            into.append(time.thread_time() - start)

    proof_load.prove = timed
    try:
        yield
    finally:
        proof_load.prove = prove


@contextlib.contextmanager
def _parts_cpu_timed(into: dict[str, float]) -> Iterator[None]:
    """Note in ``into`` the CPU time of each part of a first proof: ``twin`` (the ladder: building the twins
    and their plain runs), ``mount`` (the family mounted on the twin) and each check of `CHECKS` by name."""
    from dataclasses import replace

    from nncanon.proof import load as proof_load
    from nncanon.proof import verdict as proof_verdict

    def timing(name: str, function: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                into[name] = into.get(name, 0.0) + time.thread_time() - start
        return timed

    saved = proof_load.running_twin, proof_load.mounted_twin, proof_verdict.CHECKS
    proof_load.running_twin = timing("twin", saved[0])
    proof_load.mounted_twin = timing("mount", saved[1])
    proof_verdict.CHECKS = tuple(replace(c, run=timing(c.name, c.run)) for c in saved[2])
    try:
        yield
    finally:
        proof_load.running_twin, proof_load.mounted_twin, proof_verdict.CHECKS = saved


def load(model_type: str, folder: str) -> dict[str, Any]:
    """The row of one model type: what its load did."""
    from transformers import AutoConfig

    import nncanon
    from nncanon.errors import OutOfScopeModel
    from nncanon.testing import tiny_tokenizer

    row: dict[str, Any] = {"model_type": model_type}
    try:
        config = AutoConfig.for_model(model_type)
        config.save_pretrained(folder)
    except Exception as error:
        return {**row, "status": "not built", "detail": f"{type(error).__name__}: {error}"[:300]}
    tiny_tokenizer().save_pretrained(folder)
    start, cpu = time.perf_counter(), time.thread_time()
    proof_cpu: list[float] = []
    parts: dict[str, float] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _proof_cpu_timed(proof_cpu), _parts_cpu_timed(parts):
                model = nncanon.StandardizedTransformer(folder, verify="always")
    except OutOfScopeModel as error:
        return {**row, "status": "out of scope", "detail": str(error).split(":", 1)[-1].strip()[:120]}
    except Exception as error:
        return {**row, "status": "not built", "detail": f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]}
    row["load_seconds"] = round(time.perf_counter() - start, 3)
    # the proof runs on this thread with one torch thread: its CPU time is its wall time on an idle machine,
    # and what a busy one cannot inflate
    row["load_cpu_seconds"] = round(time.thread_time() - cpu, 3)
    row["proof_cpu_seconds"] = round(sum(proof_cpu), 3) if proof_cpu else None
    row["parts_cpu_seconds"] = {name: round(seconds, 4) for name, seconds in parts.items()}
    provenance = model._provenance
    proof = provenance.proof
    row["proof_seconds"] = proof.seconds if proof is not None else None
    row["step"] = proof.twin.get("step") if proof is not None else None
    row["twin"] = proof.twin.get("described", "") if proof is not None else ""
    if proof is not None and proof.no_twin is not None:
        return {**row, "status": "no twin runs", "detail": proof.no_twin[:400]}
    failed = sorted({f"{r.check}{'' if r.layer is None else f'@{r.layer}'}" for r in proof.verdict.failed()})
    if failed:
        return {**row, "status": "check failed", "detail": ", ".join(failed)[:300]}
    return {**row, "status": "proved", "detail": row["twin"]}


def _print_parts(loaded: list[dict[str, Any]], cpu_times: list[float]) -> None:
    """The CPU time of each part of the proof (the twin, the mounting, each check): its total over every
    config, its median, and its time in the config of median proof CPU time."""
    totals: dict[str, list[float]] = {}
    for row in loaded:
        for name, seconds in (row.get("parts_cpu_seconds") or {}).items():
            totals.setdefault(name, []).append(seconds)
    timed = [r for r in loaded if r.get("proof_cpu_seconds") is not None]
    middle = sorted(timed, key=lambda r: r["proof_cpu_seconds"])[len(timed) // 2] if timed else None
    print(f"CPU time by part (sum over {len(loaded)} configs, median per config"
          + (f", in the median config {middle['model_type']} ({middle['proof_cpu_seconds']:.2f} s)" if middle else "")
          + "):")
    for name, seconds in sorted(totals.items(), key=lambda item: -sum(item[1])):
        there = (middle.get("parts_cpu_seconds") or {}).get(name) if middle else None
        print(f"  {name:22} {sum(seconds):8.2f} s {statistics.median(seconds):7.3f} s"
              + (f" {there:7.3f} s" if there is not None else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="*", default=None, help="model types (default: every causal-LM one)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    os.environ["NNCANON_CACHE"] = tempfile.mkdtemp()  # every proof is a first proof
    types = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with tempfile.TemporaryDirectory() as warm:
        load("gpt2", warm)  # imports and first-call costs, out of the first row's figure
    rows = []
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {len(types)} model types",
          flush=True)
    for index, model_type in enumerate(types, start=1):
        with tempfile.TemporaryDirectory() as folder:
            row = load(model_type, folder)
        rows.append(row)
        seconds = f"{row['proof_seconds']:6.2f} s" if row.get("proof_seconds") is not None else " " * 8
        step = f"step {row['step']}" if row.get("step") else "      "
        print(f"[{index:3}/{len(types)}] {model_type:28} {row['status']:13} {seconds} {step}  {row['detail'][:110]}",
              file=sys.stdout, flush=True)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    loaded = [r for r in rows if r["status"] in ("proved", "check failed", "no twin runs")]
    times = [r["proof_seconds"] for r in loaded if r.get("proof_seconds") is not None]
    cpu_times = [r["proof_cpu_seconds"] for r in loaded if r.get("proof_cpu_seconds") is not None]
    print()
    print(", ".join(f"{status}: {count}" for status, count in sorted(counts.items())))
    later = [r for r in loaded if (r.get("step") or 1) > 1]
    print(f"loaded: {len(loaded)}; proved on a later step of the ladder: {len(later)} "
          f"({', '.join(r['model_type'] for r in later)})")
    if times:
        slowest = max(loaded, key=lambda r: r.get("proof_seconds") or 0)
        print(f"first proof: median {statistics.median(times):.2f} s, max {max(times):.2f} s "
              f"({slowest['model_type']}) wall clock")
        busiest = max(loaded, key=lambda r: r.get("proof_cpu_seconds") or 0)
        print(f"first proof, CPU time: median {statistics.median(cpu_times):.2f} s, "
              f"max {max(cpu_times):.2f} s ({busiest['model_type']})")
        _print_parts(loaded, cpu_times)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "rows": rows},
                      handle, indent=1)


if __name__ == "__main__":
    main()
