"""Train nncanon's demo dictionary: a small top-k SAE on the demo GPT-2's residual stream after block 2.

``nncanon.demo_dictionary()`` loads what this script writes to ``src/nncanon/demo/gpt2-sae/``: a SAELens folder
(``cfg.json``, ``sae_weights.safetensors``, ~260 KB) and ``training.json`` (the settings and the evaluation).

1. The activations: ``nncanon.sae.collect_activations`` of ``blocks.2.hook_resid_post`` over the demo corpus's
   sentences (every tenth held out), into a temporary folder of safetensors shards;
2. a top-k SAE (``k`` features per token of ``d_sae``; ``b_dec`` subtracted from the input, initialised to the
   activations' mean; decoder rows kept at unit norm), trained with Adam on the reconstruction's squared error,
   from a fixed seed, on the CPU;
3. its evaluation on the held-out sentences (``nncanon.sae.evaluation.evaluate``), written to ``training.json``.

Usage::

    python scripts/train_demo_sae.py            # about a minute on a laptop CPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "nncanon" / "demo" / "gpt2-sae"
HOOK = "blocks.2.hook_resid_post"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-sae", type=int, default=256)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    import nncanon
    from nncanon.demo import DEMO_DIR
    from nncanon.sae import Dictionary
    from nncanon.sae.collection import collect_activations, load_activations
    from nncanon.sae.evaluation import evaluate

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    started = time.time()
    model = nncanon.demo_model("gpt2")
    sentences = [line.strip() for line in (DEMO_DIR / "corpus.txt").read_text().splitlines() if line.strip()]
    held_out = sentences[::10]
    train = [s for i, s in enumerate(sentences) if i % 10]
    with tempfile.TemporaryDirectory() as folder:
        collect_activations(model, HOOK, train, folder, batch_size=32, progress=False)
        data = load_activations(folder)
    d = data.shape[1]
    generator = torch.Generator().manual_seed(args.seed)
    w_dec = torch.randn(args.d_sae, d, generator=generator)
    w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True)
    params = {"W_enc": w_dec.T.clone().requires_grad_(), "b_enc": torch.zeros(args.d_sae, requires_grad=True),
              "W_dec": w_dec.requires_grad_(), "b_dec": data.mean(0).clone().requires_grad_()}
    optimizer = torch.optim.Adam(params.values(), lr=args.lr)
    for step in range(args.steps):
        batch = data[torch.randint(0, data.shape[0], (args.batch,), generator=generator)]
        pre = (batch - params["b_dec"]) @ params["W_enc"] + params["b_enc"]
        values, index = pre.topk(args.k, dim=-1)
        features = torch.zeros_like(pre).scatter(-1, index, values.relu())
        recon = features @ params["W_dec"] + params["b_dec"]
        loss = (recon - batch).pow(2).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            params["W_dec"] /= params["W_dec"].norm(dim=-1, keepdim=True)
        if step % 500 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    weights = {name: tensor.detach() for name, tensor in params.items()}
    dictionary = Dictionary.from_tensors(weights["W_enc"], weights["b_enc"], weights["W_dec"], weights["b_dec"],
                                         architecture="topk", k=args.k, hook_name=HOOK, apply_b_dec_to_input=True,
                                         name="gpt2-sae")
    dictionary.cfg = dictionary.cfg.replaced(model_name="nncanon demo gpt2")
    dictionary.save(args.out)
    result = evaluate(model, dictionary, held_out, batch_size=32)
    print(result)
    record = {"model": "nncanon.demo_model('gpt2')", "hook_name": HOOK, "architecture": "topk", "k": args.k,
              "d_sae": args.d_sae, "steps": args.steps, "batch": args.batch, "lr": args.lr, "seed": args.seed,
              "train_tokens": int(data.shape[0]), "held_out_sentences": len(held_out),
              "evaluation": result.to_dict(), "seconds": round(time.time() - started, 1)}
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
