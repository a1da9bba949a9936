"""What a twin proved holds on the model it stands for: the verifier on full-size models of real configs.

Every checkpoint of the corpus (``model_registry/checkpoints``) of at most ``--max-parameters`` (default 600M:
GPT-2, GPT-Neo-125M, OPT-125M/350M, Mamba-130M, SmolLM2-135M, Pythia-160M, RWKV-169M, LFM2-350M, CodeGen-350M,
Qwen2.5-0.5B, BLOOM-560M, Qwen3-0.6B) is built at its full size with random weights
(`nncanon.proof.full_size.verify_full_size`) and every check of the one verifier runs on it against plain
PyTorch hooks on the same model: the values, the contribution identity, ablations, invokes, locality, heads,
probabilities, the kernel's inputs, routing, the lens, skips, resuming and gradients. Prints one row per
checkpoint (parameters, seconds to build and to check, the checks that failed) and a summary; ``--json`` also
writes the rows. Each checkpoint runs in a process of its own, so one model's memory is gone before the next.

Usage::

    python benchmarks/full_size.py [--only gpt2 opt-125m ...] [--max-parameters 600e6] [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import warnings
from typing import Any


def _run(folder: str, queue: Any) -> None:
    """Verify one checkpoint's full-size model (in a child process) and put its row on ``queue``."""
    import transformers

    from nncanon.proof.full_size import verify_full_size

    warnings.simplefilter("ignore")
    try:
        run = verify_full_size(transformers.AutoConfig.from_pretrained(folder))
    except Exception as error:
        queue.put({"status": "error", "detail": f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]})
        return
    failed = sorted({f"{r.check}{'' if r.layer is None else f'@{r.layer}'}" for r in run.verdict.failed()})
    queue.put({"status": "failed" if failed else "held", "parameters": run.parameters,
               "build_seconds": run.build_seconds, "check_seconds": run.check_seconds,
               "checks": len(run.verdict.results),
               "detail": ", ".join(failed)[:300]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="checkpoints whose hub id contains one of these")
    parser.add_argument("--max-parameters", type=float, default=600e6)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    import torch
    import transformers
    from tqdm import tqdm

    from nncanon.registry import registry_dir

    corpus = registry_dir() / "checkpoints"
    entries = [e for e in json.loads((corpus / "index.json").read_text()) if e["parameters"] <= args.max_parameters]
    if args.only:
        entries = [e for e in entries if any(part in e["checkpoint"] for part in args.only)]
    entries.sort(key=lambda e: e["parameters"])
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{len(entries)} checkpoints of at most {args.max_parameters / 1e6:.0f}M parameters", file=sys.stderr)
    context = multiprocessing.get_context("spawn")
    rows = []
    bar = tqdm(entries, unit="model", file=sys.stderr)
    for entry in bar:
        bar.set_description(entry["checkpoint"])
        queue = context.Queue()
        start = time.perf_counter()
        child = context.Process(target=_run, args=(str(corpus / entry["folder"]), queue))
        child.start()
        child.join()
        row = queue.get() if not queue.empty() else {"status": "error", "detail": f"exit code {child.exitcode}"}
        rows.append({"checkpoint": entry["checkpoint"], "model_type": entry["model_type"],
                     "wall_seconds": round(time.perf_counter() - start, 1), **row})
    bar.close()

    print(f"\n{'checkpoint':38} {'params':>7} {'build s':>8} {'check s':>8} {'checks':>6}  status")
    for row in rows:
        params = f"{row['parameters'] / 1e6:.0f}M" if "parameters" in row else "-"
        print(f"{row['checkpoint']:38} {params:>7} {row.get('build_seconds', '-'):>8} "
              f"{row.get('check_seconds', '-'):>8} {row.get('checks', '-'):>6}  {row['status']}"
              + (f": {row['detail']}" if row.get("detail") else ""))
    held = sum(row["status"] == "held" for row in rows)
    print(f"\n{held} of {len(rows)} full-size models hold every check")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "rows": rows},
                      handle, indent=1)


if __name__ == "__main__":
    main()
