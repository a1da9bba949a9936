"""Train nncanon's demo transcoders: one small JumpReLU transcoder per block of each demo model.

``nncanon.graphs.demo_transcoders(name)`` loads what this script writes to ``src/nncanon/demo/<name>-transcoders/``:
a circuit-tracer transcoder set (``config.yaml`` with ``feature_input_hook: mlp.hook_in``, ``feature_output_hook:
mlp.hook_out`` and one ``layer_<i>.safetensors`` per block in its per-layer layout: ``W_enc [d_sae, d_model]``,
``W_dec [d_sae, d_model]``, ``b_enc``, ``b_dec``, ``threshold``; float16, ~65 KB a layer) and ``training.json`` (the
settings and, per layer, the held-out fraction of the MLP output's variance left unexplained and the mean L0).

1. The activations: each block's MLP input (``mlp.hook_in``) and ``mlp_output`` over the demo corpus's sentences
   (every tenth held out; a leading BOS left out, as a graph zeroes position 0 there), one trace per batch;
2. per block, a top-k transcoder (``k`` features per token of ``d_sae``; decoder rows at unit norm) trained with Adam
   on the MLP output's squared error, from a fixed seed, on the CPU;
3. made JumpReLU (circuit-tracer's per-layer format): each feature's threshold the value above which it fires on as
   many training tokens as it was among the top ``k`` there; evaluated as JumpReLU on the held-out sentences.

Usage::

    python scripts/train_demo_transcoders.py            # the three demo models, about a minute on a CPU
    python scripts/train_demo_transcoders.py --models gpt2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "src" / "nncanon" / "demo"


def activations(model, sentences: list[str], batch: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per block, ``(mlp input [tokens, d], mlp output [tokens, d])`` over ``sentences`` (padding left out, and
    position 0 where the tokenizer puts a special token there: a graph zeroes its features and error)."""
    from nncanon.reading import read
    from nncanon.sae import value_at

    n_layers = len(model.layers)
    ins, outs = [[] for _ in range(n_layers)], [[] for _ in range(n_layers)]
    model.tokenizer.padding_side = "right"
    for start in range(0, len(sentences), batch):
        chunk = sentences[start:start + batch]
        tokens = model.tokenizer(chunk, return_tensors="pt", padding=True)
        mask = tokens.attention_mask.bool()
        if tokens.input_ids[0, 0] in model.tokenizer.all_special_ids:  # a graph zeroes position 0 there
            mask[:, 0] = False
        saved = []
        with torch.no_grad(), model.trace(chunk):
            for layer in range(n_layers):
                saved.append((value_at(model, f"layers.{layer}.mlp_input").save(),
                              read(model, layer, "mlp_output").save()))
        for layer, (x, y) in enumerate(saved):
            ins[layer].append(x[mask].float())
            outs[layer].append(y[mask].float())
    return [(torch.cat(x), torch.cat(y)) for x, y in zip(ins, outs, strict=True)]


def train(x: torch.Tensor, y: torch.Tensor, d_sae: int, k: int, steps: int, batch: int, lr: float,
          generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A top-k transcoder ``x -> y``: ``W_enc [d, d_sae]``, ``b_enc``, ``W_dec [d_sae, d]``, ``b_dec``."""
    d = x.shape[1]
    w_dec = torch.randn(d_sae, d, generator=generator)
    w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True)
    params = {"W_enc": (w_dec.T * (y.std() / x.std())).clone().requires_grad_(),
              "b_enc": torch.zeros(d_sae, requires_grad=True), "W_dec": w_dec.requires_grad_(),
              "b_dec": y.mean(0).clone().requires_grad_()}
    optimizer = torch.optim.Adam(params.values(), lr=lr)
    for _ in range(steps):
        rows = torch.randint(0, x.shape[0], (batch,), generator=generator)
        pre = x[rows] @ params["W_enc"] + params["b_enc"]
        values, index = pre.topk(k, dim=-1)
        features = torch.zeros_like(pre).scatter(-1, index, values.relu())
        loss = (features @ params["W_dec"] + params["b_dec"] - y[rows]).pow(2).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            params["W_dec"] /= params["W_dec"].norm(dim=-1, keepdim=True)
    return {name: tensor.detach() for name, tensor in params.items()}


def jumprelu(weights: dict[str, torch.Tensor], x: torch.Tensor, k: int) -> torch.Tensor:
    """Per feature, the threshold above which it fires on as many tokens of ``x`` as it is among the top ``k``
    (positive) there: the JumpReLU transcoder keeps each feature's firing rate; ``[d_sae]``."""
    pre = x @ weights["W_enc"] + weights["b_enc"]
    values, index = pre.topk(k, dim=-1)
    counts = torch.zeros(pre.shape[1], dtype=torch.long).index_add_(0, index[values > 0], torch.ones_like(
        index[values > 0]))
    ranked = pre.sort(dim=0, descending=True).values
    threshold = ranked[counts.clamp(min=1, max=pre.shape[0] - 1), torch.arange(pre.shape[1])]
    return threshold.clamp(min=0)


def evaluate(weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The JumpReLU transcoder's held-out fraction of variance unexplained and mean L0."""
    pre = x @ weights["W_enc"] + weights["b_enc"]
    features = pre * (pre > weights["threshold"])
    error = features @ weights["W_dec"] + weights["b_dec"] - y
    fvu = error.pow(2).sum() / (y - y.mean(0)).pow(2).sum()
    return {"fvu": round(float(fvu), 4), "l0": round(float((features > 0).sum(-1).float().mean()), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama", "hybrid"])
    parser.add_argument("--d-sae", type=int, default=256)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import nncanon
    from nncanon.demo import DEMO_DIR

    torch.set_num_threads(1)
    sentences = [line.strip() for line in (DEMO_DIR / "corpus.txt").read_text().splitlines() if line.strip()]
    held_out = sentences[::10]
    train_set = [s for i, s in enumerate(sentences) if i % 10]
    for name in args.models:
        started = time.time()
        generator = torch.Generator().manual_seed(args.seed)
        model = nncanon.demo_model(name)
        data, held = activations(model, train_set), activations(model, held_out)
        out = DEMO / f"{name}-transcoders"
        out.mkdir(parents=True, exist_ok=True)
        entries, layers = [], []
        for layer, ((x, y), (hx, hy)) in enumerate(zip(data, held, strict=True)):
            weights = train(x, y, args.d_sae, args.k, args.steps, args.batch, args.lr, generator)
            weights["threshold"] = jumprelu(weights, x, args.k)
            weights = {key: value.half().float() for key, value in weights.items()}  # evaluated as shipped
            layers.append({"layer": layer, **evaluate(weights, hx, hy)})
            print(name, layers[-1])
            file = f"layer_{layer}.safetensors"
            save_file({"W_enc": weights["W_enc"].T.contiguous().half(), "b_enc": weights["b_enc"].half(),
                       "W_dec": weights["W_dec"].contiguous().half(), "b_dec": weights["b_dec"].half(),
                       "threshold": weights["threshold"].half()}, str(out / file))
            entries.append({"id": f"{name}-transcoder-{layer}", "layer": layer, "filepath": file})
        config = {"model_name": f"nncanon demo {name}", "feature_input_hook": "mlp.hook_in",
                  "feature_output_hook": "mlp.hook_out", "scan": f"nncanon-demo-{name}-transcoders",
                  "transcoders": entries}
        (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        record = {"model": f"nncanon.demo_model({name!r})", "architecture": "jumprelu transcoder (trained top-k)",
                  "d_sae": args.d_sae, "k": args.k, "steps": args.steps, "batch": args.batch, "lr": args.lr,
                  "seed": args.seed, "train_tokens": int(data[0][0].shape[0]),
                  "held_out_sentences": len(held_out), "layers": layers,
                  "seconds": round(time.time() - started, 1)}
        (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
