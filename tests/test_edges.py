"""The corners of the surface (issue 14): checked writes to the logits, named errors, skips, threads, aliasing."""

from __future__ import annotations

import re

import pytest
import torch
from nnsight.intervention.interleaver import OutOfOrderError

from nncanon import (
    InvalidInput,
    InvalidLayer,
    InvalidModel,
    InvalidSkip,
    InvalidWrite,
    ModelUnavailable,
    OutOfOrderRead,
    StandardizedTransformer,
)
from nncanon.testing import PROMPTS, tiny_model
from nncanon.tools import steer


@pytest.fixture(scope="module")
def gpt2():
    return tiny_model("gpt2")


def _pointing_at(shape: torch.Size, token: int) -> torch.Tensor:
    """Logits of ``shape`` whose every row puts its mass on ``token``."""
    logits = torch.zeros(shape)
    logits[..., token] = 5.0
    return logits


@pytest.mark.parametrize(
    "bad, match",
    [
        (None, r"model\.logits was assigned a NoneType.*shape \(1, \d+, 300\)"),
        ([1.0, 2.0], r"model\.logits was assigned a list.*shape \(1, \d+, 300\)"),
        (torch.zeros(3), r"model\.logits .*shape \(3,\) does not broadcast to \(1, \d+, 300\)"),
        (torch.zeros(1, 1, 300, dtype=torch.float64), r"model\.logits .*dtype torch\.float64 is not torch\.float32"),
    ],
)
def test_a_wrong_logits_write_is_an_invalid_write(gpt2, bad, match):
    with pytest.raises(InvalidWrite, match=match), gpt2.trace(PROMPTS[0]):
        gpt2.logits = bad


def test_a_logits_write_replaces_the_logits_inside_the_output(gpt2):
    with torch.no_grad(), gpt2.trace(PROMPTS):
        clean = gpt2.output.save()
    with torch.no_grad(), gpt2.trace(PROMPTS):
        gpt2.logits = _pointing_at(gpt2.logits.shape, 7)
        output = gpt2.output.save()
        logits = gpt2.logits.save()
        probs = gpt2.next_token_probs.save()
    assert type(output) is type(clean) and output.keys() == clean.keys()
    assert torch.equal(output.logits, _pointing_at(logits.shape, 7)) and torch.equal(logits, output.logits)
    assert probs.shape == (2, gpt2.vocab_size)
    assert torch.equal(probs, torch.softmax(_pointing_at(logits.shape, 7)[:, -1], dim=-1))


def test_a_logits_write_in_one_invoke_leaves_the_other_rows(gpt2):
    with torch.no_grad(), gpt2.trace(PROMPTS):
        clean = gpt2.logits.save()
    with torch.no_grad(), gpt2.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            gpt2.logits = _pointing_at(gpt2.logits.shape, 7)
            written = gpt2.logits.save()
        with tracer.invoke(PROMPTS[1]):
            other = gpt2.logits.save()
    assert torch.equal(written, _pointing_at(written.shape, 7))
    assert torch.equal(other, clean[1:])


def test_a_logits_write_steers_generation(gpt2):
    prompt_length = len(gpt2.tokenizer(PROMPTS[0]).input_ids)
    with torch.no_grad(), gpt2.generate(PROMPTS[0], max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for _ in tracer.iter[0:3]:
            gpt2.logits = _pointing_at(gpt2.logits.shape, 7)
        tokens = tracer.result.save()
    assert tokens[0, prompt_length:].tolist() == [7, 7, 7]


def test_next_token_probs_is_read_only(gpt2):
    with pytest.raises(InvalidWrite, match=r"next_token_probs is read-only.*model\.logits\[:, -1\]"):
        with gpt2.trace(PROMPTS[0]):
            gpt2.next_token_probs = torch.zeros(1, gpt2.vocab_size)


# -- named errors (point 5) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama4():
    """A tiny Llama of 4 blocks."""
    return tiny_model("llama", num_hidden_layers=4)


def test_overlapping_and_repeated_skips_name_both_calls(llama4):
    with pytest.raises(InvalidSkip, match=r"skip_layers\(1, 2\) overlaps skip_layers\(0, 1\).*blocks 1\.\.1"):
        with llama4.trace(PROMPTS[0]):
            llama4.skip_layers(0, 1)
            llama4.skip_layers(1, 2)
    with pytest.raises(InvalidSkip, match=r"skip_layers\(2, 2\) overlaps skip_layers\(2, 2\)"):
        with llama4.trace(PROMPTS[0]):
            llama4.skip_layers(2)
            llama4.skip_layers(2)
    with pytest.raises(InvalidSkip, match=r"skip_layers\(0, 0\) comes after skip_layers\(2, 2\)"):
        with llama4.trace(PROMPTS[0]):
            llama4.skip_layers(2)
            llama4.skip_layers(0)


def test_a_read_inside_a_skipped_block_names_the_skip(llama4):
    with pytest.raises(InvalidSkip, match=r"layers\[1\]\.mlp\.mlp_output was read after skip_layers\(0, 1\)"):
        with llama4.trace(PROMPTS[0]):
            llama4.skip_layers(0, 1)
            llama4.layers[1].mlp.mlp_output.save()
    # The stream leaving the last skipped block is still served: it is the stream entering the first.
    with torch.no_grad(), llama4.trace(PROMPTS[0]):
        entering = llama4.layers[0].layer_input.save()
        llama4.skip_layers(0, 1)
        leaving = llama4.layers[1].layer_output.save()
    assert torch.equal(entering, leaving)


@pytest.mark.parametrize("read, value", [
    ("layers[2].layer_output", lambda model: model.layers[2].layer_output),
    ("layers[1].mlp.mlp_output", lambda model: model.layers[1].mlp.mlp_output),
], ids=["a-later-block", "inside-the-block"])
def test_a_skip_after_a_read_the_model_ran_past_names_the_skip_and_the_read(llama4, read, value):
    """Not "layers[1].layer_input was read" (a read the user never wrote: the skip's own); the next trace is clean."""
    with torch.no_grad(), llama4.trace(PROMPTS):
        clean = llama4.logits.save()
    with pytest.raises(InvalidSkip, match=re.escape(f"skip_layers(1, 1) comes after {read} was read in this trace")):
        with llama4.trace(PROMPTS):
            value(llama4).save()
            llama4.skip_layers(1)
    with torch.no_grad(), llama4.trace(PROMPTS):
        after = llama4.logits.save()
    assert torch.equal(after, clean)


@pytest.mark.parametrize("index", [1.0, True, torch.tensor(1)], ids=["float", "bool", "tensor"])
def test_skip_layers_refuses_an_index_that_is_not_an_int(llama4, index):
    name = type(index).__name__
    with pytest.raises(InvalidSkip, match=rf"skip_layers\(.*was given .* \({name}\); a layer index is an int"):
        with llama4.trace(PROMPTS[0]):
            llama4.skip_layers(index)


def test_negative_indices_count_from_the_end_everywhere(llama4):
    """One rule: ``layers[-1]``, ``skip_layers(-2, -1)``, ``steer(-1)`` and ``support()`` all index like Python."""
    direction = torch.ones(llama4.hidden_size)
    with torch.no_grad(), llama4.trace(PROMPTS[0]):
        last = llama4.layers[-1].layer_output.save()
        same = llama4.layers[3].layer_output.save()
    assert torch.equal(last, same)
    with torch.no_grad(), llama4.trace(PROMPTS[0]):
        llama4.skip_layers(-2, -1)
        skipped_negative = llama4.logits.save()
    with torch.no_grad(), llama4.trace(PROMPTS[0]):
        llama4.skip_layers(2, 3)
        skipped = llama4.logits.save()
    assert torch.equal(skipped_negative, skipped)
    with torch.no_grad(), llama4.trace(PROMPTS[0]):
        steer(llama4, -1, direction)
        steered_negative = llama4.logits.save()
    with torch.no_grad(), llama4.trace(PROMPTS[0]):
        steer(llama4, 3, direction)
        steered = llama4.logits.save()
    assert torch.equal(steered_negative, steered)
    assert llama4.support().reason("mlp_output", layer=-1) == llama4.support().reason("mlp_output", layer=3)


def test_a_layer_index_out_of_range_is_an_index_error_naming_the_range(llama4):
    with pytest.raises(IndexError, match=r"layer 4 is out of range for model\.layers: this model has 4 layers.*0\.\.3"):
        llama4.layers[4]
    with pytest.raises(InvalidLayer, match=r"layer -5 is out of range"), llama4.trace(PROMPTS[0]):
        llama4.layers[-5].layer_output.save()
    with pytest.raises(TypeError, match=r"was given 1\.5 \(float\)"):
        llama4.layers[1.5]
    assert llama4.layers["3"] is llama4.layers[3]  # nnsight's name of a block
    for name in ("4", "-1", "last"):  # (was nnsight's AttributeError: "nor its module has attribute '4'")
        with pytest.raises(InvalidLayer, match=rf"given '{name}': no block is named that; .* named '0'\.\.'3'"):
            llama4.layers[name]
    with pytest.raises(InvalidSkip, match=r"skip_layers\(0, 4\) asks for blocks outside 0\.\.3"):
        with llama4.trace(PROMPTS[0]):
            llama4.skip_layers(0, 4)


def test_a_value_read_out_of_order_names_it_and_the_order(llama4):
    with pytest.raises(OutOfOrderRead, match=r"layers\[0\]\.layer_output was read, after layers\[1\]\.layer_output,"
                       r".*block by block, layers\[0\] to layers\[3\]"):
        with llama4.trace(PROMPTS[0]):
            llama4.layers[1].layer_output.save()
            llama4.layers[0].layer_output.save()
    order = r"inside layers\[0\]: layer_input, then self_attn, then mlp, then layer_output"
    with pytest.raises(OutOfOrderError, match=rf"layers\[0\]\.self_attn\.attention_output was read.*{order}"):
        with llama4.trace(PROMPTS[0]):
            llama4.layers[0].mlp.mlp_output.save()
            llama4.layers[0].self_attn.attention_output.save()


def test_an_out_of_order_read_after_eager_probabilities_names_them(llama4):
    """Under eager the probabilities are the model's own, inside the kernel call: a kernel input read after them
    is out of order, and the message names the probabilities as the read before (not the value read before them)."""
    attention = llama4.layers[0].self_attn
    with pytest.raises(OutOfOrderRead, match=r"layers\[0\]\.self_attn\.value_states was read, after "
                       r"layers\[0\]\.self_attn\.attention_probabilities,"):
        with llama4.trace(PROMPTS[0]):
            attention.key_states.save()
            attention.attention_probabilities.save()
            attention.value_states.save()


@pytest.mark.parametrize("name", ["mamba2", "rwkv"])
def test_head_dim_of_a_model_without_softmax_attention_is_not_available(name):
    """As docs/surface.md says, and as num_heads: Mamba-2's config head_dim (its state-space heads' width) was
    served as model.head_dim, and RWKV's error named num_heads."""
    from nncanon import SizeNotAvailable

    model = tiny_model(name)
    with pytest.raises(SizeNotAvailable, match=rf"{name} has no softmax attention, so no head_dim"):
        model.head_dim
    with pytest.raises(SizeNotAvailable, match=rf"{name} has no softmax attention, so no num_heads"):
        model.num_heads


def test_the_order_message_follows_the_family():
    """Falcon-H1 runs its Mamba mixer before its attention: the message says so."""
    model = tiny_model("falcon_h1")
    with pytest.raises(OutOfOrderRead, match=r"then linear_attn, then self_attn, then mlp"):
        with model.trace(PROMPTS[0]):
            model.layers[0].mlp.mlp_output.save()
            model.layers[0].self_attn.attention_output.save()


@pytest.mark.parametrize("prompt", [[], None], ids=["empty-list", "none"])
def test_a_trace_without_a_prompt_is_refused(gpt2, prompt):
    with pytest.raises(InvalidInput, match=re.escape(f"was given {prompt!r}: there is no prompt")):
        with gpt2.trace(prompt):
            gpt2.logits.save()


def test_a_missing_local_folder_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelUnavailable, match=re.escape(f"cannot load '{missing}': no such folder")):
        StandardizedTransformer(str(missing))
    with pytest.raises(OSError, match=re.escape("cannot load './not/here': no such folder")):
        StandardizedTransformer("./not/here")


def test_a_folder_with_a_config_but_no_weights_loads_on_meta_and_a_trace_names_the_missing_weights(tmp_path):
    """support() needs no weights; the first trace (or ``dispatch=True``) raises `ModelUnavailable` naming them,
    not nnsight's "Could not load model ... with any of the following classes" with transformers' tracebacks."""
    from nncanon.testing import tiny_hf_model, tiny_tokenizer

    tiny_hf_model("gpt2").config.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model = StandardizedTransformer(str(tmp_path), verify="never")
    assert model.support().layers_with("self_attn") == list(range(model.num_layers))
    missing = re.escape(f"the folder '{tmp_path}' has a config but no weights") + r".*model\.save_pretrained\(folder\)"
    for _ in range(2):  # and again: the model is left as it was
        with pytest.raises(ModelUnavailable, match=missing), model.trace(PROMPTS[0]):
            model.logits.save()
    with pytest.raises(ModelUnavailable, match=missing):
        StandardizedTransformer(str(tmp_path), verify="never", dispatch=True)


def test_a_module_without_a_config_is_refused():
    with pytest.raises(InvalidModel, match=r"given a Linear with no transformers config"):
        StandardizedTransformer(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("prompts", ["", ["", PROMPTS[0]]], ids=["alone", "in-a-batch"])
def test_an_empty_prompt_without_bos_is_refused(gpt2, prompts):
    assert gpt2.tokenizer("").input_ids == [], "the tiny tokenizer adds no BOS token"
    with pytest.raises(InvalidInput, match=r"batch row\(s\) \[0\] have no tokens.*padding only"):
        with gpt2.trace(prompts):
            gpt2.next_token_probs.save()


def test_a_prompt_longer_than_the_positions_names_the_limit(gpt2):
    limit = gpt2._text_config.n_positions
    ids = torch.ones(1, limit + 1, dtype=torch.long)
    with pytest.raises(InvalidInput, match=rf"{limit + 1} tokens long.*gpt2 model has {limit} positions"):
        with gpt2.trace(ids):
            gpt2.logits.save()
    with torch.no_grad(), gpt2.trace(ids[:, :limit]):  # at the limit: runs
        logits = gpt2.logits.save()
    assert logits.shape == (1, limit, gpt2.vocab_size)


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([[5, 300, 7]]), r"token id\(s\) \[300\] are outside this model's vocabulary: .* has 300 rows"),
    (torch.tensor([[5, -1, 7]]), r"token id\(s\) \[-1\] are outside .* an id is in 0\.\.299"),
    (torch.tensor([[5.0, 6.0]]), r"token ids are a torch\.float32 tensor: token ids are integers \(torch\.long\)"),
], ids=["past-the-vocabulary", "negative", "float"])
def test_token_ids_the_embedding_has_no_row_for_are_refused(gpt2, ids, match):
    """Refused by name before the forward (bare, the embedding raises ``IndexError: index out of range in self``)."""
    with pytest.raises(InvalidInput, match=match), gpt2.trace(ids):
        gpt2.logits.save()
    with torch.no_grad(), gpt2.trace(torch.tensor([[5, 299, 7]])):  # the last row is in range: runs
        logits = gpt2.logits.save()
    assert logits.shape == (1, 3, gpt2.vocab_size)


def test_project_on_vocab_names_a_tensor_it_cannot_take(gpt2):
    """A wrong width or dtype, or no tensor, is named (bare: torch's size or dtype mismatch from inside the norm
    or the head); a tensor that fits is projected as before, equal to the logits at the last layer."""
    with torch.no_grad(), gpt2.trace(PROMPTS):
        last = gpt2.layers[-1].layer_output.save()
        logits = gpt2.logits.save()
    assert torch.equal(gpt2.project_on_vocab(last), logits)
    with pytest.raises(InvalidInput, match=r"shape \(2, 7\): its last axis is the residual stream's, 32 wide"):
        gpt2.project_on_vocab(torch.zeros(2, 7))
    with pytest.raises(InvalidInput, match=r"dtype torch\.float64; the model runs in torch\.float32"):
        gpt2.project_on_vocab(last.double())
    with pytest.raises(InvalidInput, match=r"given a list; it takes a residual-stream tensor \[\.\.\., 32\]"):
        gpt2.project_on_vocab([0.0] * 32)
    with pytest.raises(InvalidInput, match=r"shape \(2, \d+, 7\)"), torch.no_grad(), gpt2.trace(PROMPTS):
        gpt2.project_on_vocab(gpt2.layers[0].layer_output[..., :7]).save()


# -- saved values alias the model's tensors (point 7) ----------------------------------------------


def test_a_saved_value_is_the_models_tensor_and_clone_keeps_it(llama4):
    """A save is the model's own tensor: an in-place write later in the trace (to the same stream, read at
    the next block) changes it too. ``.clone().save()`` keeps the value as it was when read."""
    with torch.no_grad(), llama4.trace(PROMPTS[0]):
        clean = llama4.layers[1].layer_output.save()
    with torch.no_grad(), llama4.trace(PROMPTS[0]):
        aliased = llama4.layers[1].layer_output.save()
        kept = llama4.layers[1].layer_output.clone().save()
        llama4.layers[2].layer_input[:] = 0
    assert torch.equal(aliased, torch.zeros_like(clean)), "the save aliases the stream the write zeroed"
    assert torch.equal(kept, clean)


# -- threads (point 3) ------------------------------------------------------------------------------


def test_threads_tracing_one_model_take_turns(gpt2):
    """Four threads, ten traces each, on one model: every trace returns its own prompt's logits (the
    model's lock serialises them; unserialised, nnsight fails most of them and can leave a save unbound)."""
    import threading

    expected = {}
    for prompt in PROMPTS:
        with torch.no_grad(), gpt2.trace(prompt):
            expected[prompt] = gpt2.logits.save()
    outcomes: list[bool] = []
    failures: list[str] = []

    def work(prompt: str) -> None:
        for _ in range(10):
            try:
                with torch.no_grad(), gpt2.trace(prompt):
                    gpt2.layers[0].mlp.mlp_output[:] = gpt2.layers[0].mlp.mlp_output  # a write, too
                    logits = gpt2.logits.save()
                outcomes.append(torch.equal(logits, expected[prompt]))
            except Exception as error:  # collected, not lost in the thread
                failures.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=work, args=(PROMPTS[i % 2],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert failures == [] and outcomes == [True] * 40


def test_threads_generating_on_one_model_take_turns(gpt2):
    import threading

    with torch.no_grad(), gpt2.generate(PROMPTS[0], max_new_tokens=3, do_sample=False) as tracer:
        expected = tracer.result.save()
    got: list[torch.Tensor] = []

    def work() -> None:
        for _ in range(3):
            with torch.no_grad(), gpt2.generate(PROMPTS[0], max_new_tokens=3, do_sample=False) as tracer:
                tokens = tracer.result.save()
            got.append(tokens)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(got) == 9 and all(torch.equal(tokens, expected) for tokens in got)


# -- skip_layers inside generate (point 4) ----------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen3_next"], ids=["attention", "hybrid"])
def test_a_skip_inside_generate_with_a_cache_is_refused_before_the_forward(name):
    model = tiny_model(name)
    forwards = []
    handle = model._module.register_forward_hook(lambda *args: forwards.append(1))
    try:
        refused = r"skip_layers\(0, 0\) inside model\.generate with a cache.*use_cache=False"
        with pytest.raises(InvalidSkip, match=refused):
            with torch.no_grad(), model.generate(PROMPTS[0], max_new_tokens=3, min_new_tokens=3) as tracer:
                for step in tracer.iter[0:3]:
                    if step == 1:
                        model.skip_layers(0)
    finally:
        handle.remove()
    assert forwards == [], "refused before the model ran"


@pytest.mark.parametrize("name", ["llama", "qwen3_next"], ids=["attention", "hybrid"])
def test_a_skip_inside_generate_without_a_cache_skips_that_step(name):
    """With ``use_cache=False`` each step runs the whole sequence: the token a skipped step picks is the
    argmax of a plain trace of the same sequence with the same skip, and the step before it is unchanged."""
    model = tiny_model(name)
    with torch.no_grad(), model.generate(PROMPTS[0], max_new_tokens=2, min_new_tokens=2, do_sample=False,
                                         use_cache=False) as tracer:
        for step in tracer.iter[0:2]:
            if step == 1:
                model.skip_layers(0)
        tokens = tracer.result.save()
    prompt = model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad(), model.trace(prompt):
        clean_first = model.logits[:, -1].argmax(-1).save()
    assert int(tokens[0, prompt.shape[1]]) == int(clean_first)
    with torch.no_grad(), model.trace(tokens[:, : prompt.shape[1] + 1]):
        model.skip_layers(0)
        skipped_second = model.logits[:, -1].argmax(-1).save()
    assert int(tokens[0, prompt.shape[1] + 1]) == int(skipped_second)
