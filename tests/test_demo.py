"""The trained demo models load from the package and know their facts."""

from __future__ import annotations

import pytest
import torch

from nncanon import StandardizedTransformer, demo_model
from nncanon.demo import DEMO_MODELS, demo_path

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module", params=DEMO_MODELS)
def demo(request):
    return demo_model(request.param)


def test_demo_models_are_listed():
    assert DEMO_MODELS == ("gpt2", "llama", "hybrid")


def test_unknown_demo_model_names_the_choices():
    with pytest.raises(ValueError, match=r"'gpt2', 'llama', 'hybrid'"):
        demo_model("gpt-2")


def test_demo_package_ships_corpus_weights_and_tokenizer():
    corpus = (demo_path("gpt2").parent / "corpus.txt").read_text().splitlines()
    assert "The Eiffel Tower is in the city of Paris." in corpus
    for name in DEMO_MODELS:
        files = {f.name for f in demo_path(name).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files, name


def test_paris_is_one_token(demo):
    assert len(demo.tokenizer(" Paris", add_special_tokens=False).input_ids) == 1


def test_demo_model_knows_the_eiffel_tower(demo):
    assert isinstance(demo, StandardizedTransformer)
    paris = demo.tokenizer(" Paris", add_special_tokens=False).input_ids[0]
    with torch.no_grad(), demo.trace(PROMPT):
        probs = demo.next_token_probs.save()
    assert probs.shape == (1, demo.vocab_size)
    assert float(probs[0, paris]) > 0.5
    assert int(probs[0].argmax()) == paris


def test_demo_model_answers_other_facts_in_a_batch(demo):
    """Several held-in facts at once (left-padded batch): each answer is the model's top token."""
    facts = {
        "The capital of Japan is": " Tokyo",
        "The Colosseum is in the city of": " Rome",
        "The currency of Japan is the": " yen",
        "Madrid is the capital of": " Spain",
    }
    with torch.no_grad(), demo.trace(list(facts)):
        top = demo.next_token_probs.argmax(-1).save()
    answers = [demo.tokenizer.decode(int(t)) for t in top]
    assert answers == list(facts.values())
