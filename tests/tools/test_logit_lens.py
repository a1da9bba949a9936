"""The logit lens: one forward, the model's own head, the last layer is the logits."""

from __future__ import annotations

import torch

from nncanon.testing import PROMPTS, tiny_tokenizer
from nncanon.tools import lens_top_tokens, logit_lens, plot_logit_lens

from .conftest import build


def test_lens_at_last_layer_equals_logits(model):
    lens = logit_lens(model, PROMPTS)
    with torch.no_grad(), model.trace(PROMPTS):
        logits = model.logits.save()
    assert lens.shape == (len(PROMPTS), model.num_layers, logits.shape[1], model.vocab_size)
    assert torch.equal(lens[:, -1], logits)


def test_lens_equals_head_on_plain_hidden_states(model):
    """Each layer against project_on_vocab of the hidden state transformers itself returns."""
    lens = logit_lens(model, PROMPTS[0])
    inputs = dict(model.tokenizer(PROMPTS[0], return_tensors="pt"))
    with torch.no_grad():
        hidden = model._module(**inputs, output_hidden_states=True).hidden_states
        for layer in range(model.num_layers - 1):  # the last entry is after the final norm
            expected = model.project_on_vocab(hidden[layer + 1])
            torch.testing.assert_close(lens[:, layer], expected, rtol=1e-6, atol=1e-6)


def test_lens_layers_and_positions(model):
    full = logit_lens(model, PROMPTS)
    picked = logit_lens(model, PROMPTS, layers=[1, 0], positions=-1)
    assert picked.shape == (len(PROMPTS), 2, model.vocab_size)
    torch.testing.assert_close(picked[:, 0], full[:, 1, -1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(picked[:, 1], full[:, 0, -1], rtol=1e-6, atol=1e-6)
    some = logit_lens(model, PROMPTS, layers=-1, positions=[0, 2])
    torch.testing.assert_close(some[:, 0], full[:, -1][:, [0, 2]], rtol=1e-6, atol=1e-6)


def test_top_tokens_are_the_argmax():
    model = build("llama")
    lens = logit_lens(model, PROMPTS[0], positions=-1)[0]  # [layers, vocab]
    ids, probs, strings = lens_top_tokens(model, lens)
    assert torch.equal(ids, lens.argmax(-1))
    torch.testing.assert_close(probs, lens.softmax(-1).amax(-1))
    assert strings == [tiny_tokenizer().decode([i]) for i in ids.tolist()]


def test_plot_writes_a_png_of_the_lens(tmp_path):
    model = build("llama")
    path = tmp_path / "lens.png"
    figure = plot_logit_lens(model, PROMPTS[0], path=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = figure.axes[0].images[0].get_array()
    lens = logit_lens(model, PROMPTS[0])[0]
    torch.testing.assert_close(torch.as_tensor(image.data), lens.softmax(-1).amax(-1))
    labels = [text.get_text() for text in figure.axes[0].texts]
    first = tiny_tokenizer().decode([int(lens[0, 0].argmax())])
    assert labels[0] == first.replace("\n", "\\n")[:8]
    assert len(labels) == lens.shape[0] * lens.shape[1]
