"""Check a multi-GPU placement: every value on its block's device, skips and the lens across devices.

Run on a machine with two or more GPUs (or one GPU and the CPU):
    python benchmarks/multi_device_check.py [--layers 8]

Builds a Llama-shaped model from a config (no download), places its blocks over every visible
device with an explicit device_map (round robin), and checks against the same model on one device:
each layer's values are on that layer's device and equal (to fp32 rounding across devices); the
contribution identity holds per layer; skip_layers across a device boundary passes the stream;
project_on_vocab works from every layer. Exits 1 on the first failure, 0 with a summary.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
import transformers

from nncanon import StandardizedTransformer
from nncanon.testing import tiny_tokenizer
from nncanon.tools import head_ablation_sweep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    if len(devices) == 1:
        devices.append("cpu")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    device_map = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[-1],
                  "lm_head": devices[-1]}
    for i in range(args.layers):
        device_map[f"model.layers.{i}"] = devices[i * len(devices) // args.layers]
    placed = StandardizedTransformer(folder, attn_implementation="eager", device_map=device_map)
    whole = StandardizedTransformer(folder, attn_implementation="eager", device_map={"": devices[0]})
    prompt = "The Eiffel Tower is in the city of"

    def read(model):
        rows, lens = [], []
        with torch.no_grad(), model.trace(prompt):
            for layer in model.layers:
                rows.append([layer.layer_input.save(), layer.self_attn.attention_output.save(),
                             layer.mlp.mlp_output.save(), layer.layer_output.save()])
                lens.append(model.project_on_vocab(rows[-1][-1]).save())
            logits = model.logits.save()
        return rows, lens, logits

    rows, lens, logits = read(placed)
    reference, _, reference_logits = read(whole)
    for i, (values, expected) in enumerate(zip(rows, reference, strict=True)):
        device = torch.device(device_map[f"model.layers.{i}"])
        for value, other in zip(values, expected, strict=True):
            if value.device != device:
                print(f"FAIL layer {i}: value on {value.device}, block on {device}")
                return 1
            if not torch.allclose(value.cpu(), other.cpu(), atol=1e-4):
                print(f"FAIL layer {i}: differs from the single-device model")
                return 1
        x, a, m, y = values
        if not torch.allclose(x + a + m, y, atol=1e-5):
            print(f"FAIL layer {i}: contribution identity")
            return 1
    if not torch.allclose(lens[-1].cpu(), logits.cpu(), atol=1e-5):
        print("FAIL lens at the last layer")
        return 1
    crossings = [i for i in range(1, args.layers) if device_map[f"model.layers.{i}"] != device_map["model.layers.0"]]
    boundary = crossings[0] if crossings else args.layers // 2
    with torch.no_grad(), placed.trace(prompt):
        entering = placed.layers[boundary - 1].layer_input.save()
        placed.skip_layers(boundary - 1, boundary)
        leaving = placed.layers[boundary].layer_output.save()
    if not torch.equal(entering.cpu(), leaving.cpu()):
        print("FAIL skip across the device boundary")
        return 1
    # A head sweep resuming past the boundary: the recorded stream goes back to the first block's device.
    swept = head_ablation_sweep(placed, prompt, layers=[boundary])[0]
    for head in (0, swept.shape[0] - 1):
        with torch.no_grad(), placed.trace(prompt):
            placed.layers[boundary].self_attn.attention_head_outputs[..., head, :] = 0
            alone = placed.next_token_probs[0].save()
        if not torch.allclose(swept[head].cpu(), alone.cpu(), atol=1e-5):
            print(f"FAIL head sweep resumed at layer {boundary}: head {head} differs from its own trace")
            return 1
    print(f"ok: {args.layers} layers over {devices}; values on their block's device, equal to one device; "
          f"identity, lens, a skip and a resumed head sweep across the boundary at layer {boundary} hold "
          f"(max |logit diff| {float((logits.cpu() - reference_logits.cpu()).abs().max()):.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
