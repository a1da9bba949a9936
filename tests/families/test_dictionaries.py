"""Dictionaries on every registered variant, at every point one can attach to.

- Unedited, with the error term, the logits of a trace that reads every dictionary's features are the clean
  run's, bit for bit (``torch.equal``), and each dictionary's features are its encoding of the value read by plain
  forward hooks on the unwrapped model.
- An edit of feature ``j`` by ``δ`` moves the spliced value by exactly ``δ · W_dec[j]`` (within 1e-6, fp32).

Tiny dictionaries (8 features) on the tiny variants: a few traces per variant.
"""

from __future__ import annotations

import torch

from nncanon.proof.checks.references import encode, site_references
from nncanon.reading import in_execution_order
from nncanon.sae import Dictionary, Point, attach, resolve, value_at
from nncanon.sae.sites import point_shape
from nncanon.testing import PROMPTS

#: Standard values a dictionary reads here, besides resid_mid and the MLP's input; per-head values with one head
#: (the kernel's inputs) or all heads flattened (hook_z).
VALUES = ("layer_input", "query_states", "key_states", "value_states", "attention_head_outputs", "attention_output",
          "linear_attention_head_outputs", "linear_attention_output", "mlp_output", "layer_output")
ONE_HEAD = ("query_states", "key_states", "value_states")
FLAT = ("attention_head_outputs", "linear_attention_head_outputs")
FEATURES, DELTA, FEATURE = 8, 0.75, 3


def _dictionary(model, point: Point, seed: int) -> Dictionary:
    shape, dtype, _ = point_shape(model, point)
    width = int(torch.tensor(shape).prod()) if point.value in FLAT else shape[-1]
    generator = torch.Generator().manual_seed(seed)
    scale = 1.0 / width ** 0.5
    return Dictionary.from_tensors(
        torch.randn(width, FEATURES, generator=generator) * scale, torch.full((FEATURES,), 0.01),
        torch.randn(FEATURES, width, generator=generator) * scale, torch.randn(width, generator=generator) * 0.01,
        reshape_activations="hook_z" if point.value in FLAT else "none", name=point.label).to(dtype=dtype)


def _points(model) -> tuple[list[Point], list[Point]]:
    """The points of every block, in the order one trace reads them: the standard values (first list), then
    resid_mid and the MLP's input (second list)."""
    report = model.support()
    plain, derived = [], []
    for layer in range(model.num_layers):
        names = [v for v in VALUES if report.available(v, layer=layer)]
        for name in in_execution_order(model, layer, names):
            plain.append(Point(layer, name, 0 if name in ONE_HEAD else None, name=f"layers.{layer}.{name}"))
        for name in ("resid_mid", "mlp_input"):
            try:
                derived.append(resolve(model, f"layers.{layer}.{name}"))
            except AttributeError:  # ValueNotAvailable: a parallel block, an MLP run inline, ...
                continue
    return plain, derived


def test_dictionaries_leave_the_clean_run_and_an_edit_moves_the_value_by_its_decoder_row(variant, model):
    plain, derived = _points(model)
    attached = {point: attach(model, _dictionary(model, point, seed), point)
                for seed, point in enumerate(plain + derived)}
    inputs = encode(model)
    with torch.no_grad():
        clean = model._module(**inputs).logits
    features: dict = {}
    for group in (plain, derived):
        if not group:
            continue
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for point in group:
                features[point] = attached[point].features.save()
            logits = model.logits.save()
        assert torch.equal(logits, clean), f"{variant.name}: logits moved with {len(group)} dictionaries unedited"
    # each dictionary's features are its encoding of the value plain forward hooks read on the unwrapped model (a
    # value read inside a forward, the attention kernel's inputs, by nnsight's source hooks on a plain copy)
    hooked = [p for p in plain if attached[p].point.value not in ("query_states", "key_states", "value_states")]
    references = site_references(model, [(p.layer, p.value) for p in hooked], inputs)
    kernel: dict = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):  # the kernel's inputs: as served without a dictionary reading them
        for point in plain:
            if point not in hooked:
                kernel[point] = value_at(model, Point(point.layer, point.value, name=point.name)).save()
    for point in plain:
        value = references[point.layer, point.value] if point in hooked else kernel[point]
        value = value if point.head is None else value[..., point.head, :]
        assert torch.equal(features[point], attached[point].dictionary.encode(value)), point.label
    # an edit of feature j by δ moves the value by δ·W_dec[j]
    for group in (plain, derived):
        moved: list = []
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for point in group:
                item = attached[point]
                before = item.input.clone().save()
                item.features[..., FEATURE] += DELTA
                after = value_at(model, item.point).save()
                moved.append((item, before, after))
        for item, before, after in moved:
            row = item.dictionary.W_dec[FEATURE].reshape(before.shape[2:])
            error = (after - before - DELTA * row).abs().max().item()
            assert error <= 1e-6, f"{variant.name} {item.point.label}: |Δ - δ·W_dec[j]| = {error}"
    for item in attached.values():
        item.detach()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        after = model.logits.save()
    assert torch.equal(after, clean)
