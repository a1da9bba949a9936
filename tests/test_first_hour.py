"""A newcomer's first hour: the README's way in, the CLI's help and notes, fast offline failures, quiet loads."""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
import warnings
from pathlib import Path

import pytest
import torch

import nncanon
from nncanon.cli import EXIT_OK, EXIT_USAGE, build_parser, main
from nncanon.errors import ModelUnavailable
from nncanon.quiet import KERNEL_LOGGER, kernel_notices_filtered
from nncanon.study import color_limits, layer_labels, linear_head_layers, plot_head_effects, target_notes
from nncanon.testing import tiny_hf_model, tiny_model, tiny_tokenizer
from nncanon.versions import transformers_minor

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PROMPT = "The Eiffel Tower is in the city of"


def _p(model, token: int) -> float:
    with torch.no_grad(), model.trace(PROMPT):
        probability = model.next_token_probs[0, token].save()
    return float(probability)


# -- the README --------------------------------------------------------------


def test_readme_shows_the_cpu_torch_build_and_the_demo_models():
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in README
    assert 'nncanon.demo_model("llama")' in README
    assert "nncanon support llama" in README
    image = re.search(r"!\[[^\]]*\]\((docs/assets/head_effects\.png)\)", README).group(1)
    assert (ROOT / image).read_bytes()[:4] == b"\x89PNG"  # the heatmap nncanon ablate writes


def test_readme_ablate_table_is_what_the_demo_models_give():
    table = re.search(r"```text\n(prompt .*?)```", README, re.S).group(1)
    header = next(line for line in table.splitlines() if line.startswith("run "))
    names = re.findall(r"(\S+) \(layer \d+, \w+\)", header)
    assert names == list(nncanon.demo.DEMO_MODELS)
    clean = next(line for line in table.splitlines() if line.startswith("clean")).split()[1:]
    for name, shown in zip(names, clean, strict=True):
        model = nncanon.demo_model(name)
        paris = model.tokenizer(" Paris", add_special_tokens=False).input_ids[0]
        assert float(shown) == pytest.approx(_p(model, paris), abs=5e-4), name


def test_the_ablation_folder_is_ignored_by_git():
    default = build_parser().parse_args(["ablate"]).out
    assert f"{default}/" in (ROOT / ".gitignore").read_text().splitlines()


# -- the CLI -----------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_has_no_markup_and_every_option_its_default(capsys):
    parser = build_parser()
    for name, command in {"": parser, **_subparsers(parser)}.items():
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"] if name else ["--help"])
        assert exit_.value.code == EXIT_OK
        text = capsys.readouterr().out
        assert "``" not in text and "`" not in text, name
        formatter = command._get_formatter()
        for action in command._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction) or not action.option_strings:
                continue
            assert action.help, f"{name} {action.option_strings}"
            assert "default" in formatter._get_help_string(action), f"{name} {action.option_strings}"
    assert "(default: ' Paris')" in " ".join(_help("ablate").split())


def _help(command: str) -> str:
    return _subparsers(build_parser())[command].format_help()


def test_support_accepts_a_demo_name(capsys):
    assert main(["support", "llama", "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(json.dumps(nncanon.demo_model("llama").support().to_dict()))


def test_ablate_names_the_token_of_a_target_without_its_space(tmp_path, capsys):
    code = main(["ablate", "--model", "llama", "--target", "Paris", "--layer", "0", "--out", str(tmp_path),
                 "--quiet", "--shared-scale"])
    assert code == EXIT_OK
    captured = capsys.readouterr()
    model = nncanon.demo_model("llama")
    bare = model.tokenizer("Paris", add_special_tokens=False).input_ids[0]
    spaced = model.tokenizer(" Paris", add_special_tokens=False).input_ids[0]
    assert bare != spaced
    note = next(line for line in captured.err.splitlines() if line.startswith("note (llama)"))
    assert "'Paris' has no leading space" in note and f"(id {bare})" in note and f"(id {spaced})" in note
    clean = next(line for line in captured.out.splitlines() if line.startswith("clean")).split()[1]
    assert float(clean) == pytest.approx(_p(model, bare), abs=5e-4)  # the token named is the token scored
    assert (tmp_path / "head_effects.png").read_bytes()[:4] == b"\x89PNG"


def test_target_notes():
    model = nncanon.demo_model("llama")
    assert target_notes(model, " Paris") == []
    (note,) = target_notes(model, " Eiffel Tower")
    first = model.tokenizer(" Eiffel Tower", add_special_tokens=False).input_ids[0]
    assert "is 2 tokens" in note and f"(id {first})" in note


# -- an unreachable hub ------------------------------------------------------


@pytest.fixture
def no_hub(monkeypatch):
    """A hub endpoint that refuses connections at once (port 9 on this machine), and no proxy."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def _names_the_ways_in(message: str) -> None:
    assert "\n" not in message.strip()
    assert "local folder" in message and "HF_HUB_OFFLINE=1" in message and "demo_model(" in message


def test_an_unreachable_hub_id_fails_fast_in_python(no_hub):
    start = time.monotonic()
    with pytest.raises(ModelUnavailable) as error:
        nncanon.StandardizedTransformer("someone/not-cached-anywhere")
    assert time.monotonic() - start < 10  # transformers' own retries take tens of seconds
    assert isinstance(error.value, OSError)
    assert "'someone/not-cached-anywhere'" in str(error.value) and "unreachable" in str(error.value)
    _names_the_ways_in(str(error.value))


def test_an_unreachable_hub_id_fails_in_one_line_in_the_cli(no_hub, capsys):
    assert main(["support", "someone/not-cached-anywhere"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    _names_the_ways_in(err)


def test_a_missing_folder_is_not_blamed_on_the_hub(no_hub, tmp_path, capsys):
    assert main(["support", str(tmp_path / "missing")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "no such folder" in err and "unreachable" not in err and "demo_model(" in err


def test_offline_mode_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailable, match="HF_HUB_OFFLINE is set") as error:
        nncanon.StandardizedTransformer("someone/not-cached-anywhere")
    _names_the_ways_in(str(error.value))


# -- the heatmap -------------------------------------------------------------


def test_heatmap_scales_and_labels(tmp_path):
    effects = {"a": torch.tensor([[0.1, -0.4], [0.2, float("nan")]]), "b": torch.tensor([[0.05, 0.0]])}
    assert color_limits(effects) == pytest.approx({"a": 0.4, "b": 0.05})
    assert color_limits(effects, shared_scale=True) == pytest.approx({"a": 0.4, "b": 0.4})
    assert layer_labels(3, {1}) == ["0", "1 (linear)", "2"]
    path = plot_head_effects(effects, " Paris", str(tmp_path / "h.png"), prompt=PROMPT, shared_scale=True,
                             linear_layers={"a": {1}})
    assert Path(path).read_bytes()[:4] == b"\x89PNG"


def test_linear_head_layers_of_the_hybrid():
    model = nncanon.demo_model("hybrid")
    expected = {i for i, layer in enumerate(model.layers) if "linear_attn" in layer.__dict__}
    assert linear_head_layers(model) == expected and len(expected) == 3
    assert linear_head_layers(nncanon.demo_model("llama")) == set()


# -- quiet where nncanon triggers a notice, not elsewhere ---------------------


def test_wrapping_rwkv_warns_nothing_but_the_users_own_warnings_show():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_model("rwkv")
        assert not [w for w in caught if "submodule named" in str(w.message)]
        warnings.warn("Module 'x' has a submodule named 'output', which nnsight already serves on every module",
                      UserWarning, stacklevel=1)
    assert [w for w in caught if "submodule named" in str(w.message)], "the filter must not outlive nncanon's load"


def test_kernel_notices_are_dropped_only_inside_nncanon():
    from transformers.utils import logging as transformers_logging

    hf = tiny_hf_model("qwen3_next")  # gated DeltaNet: its CPU kernel falls back to the reference code
    ids = tiny_tokenizer()(PROMPT, return_tensors="pt").input_ids
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger(KERNEL_LOGGER)
    logger.addHandler(handler)
    try:
        transformers_logging.warning_once.cache_clear()
        with kernel_notices_filtered(), torch.no_grad():
            hf(ids)
        assert not [r for r in records if "falling back" in r]
        with torch.no_grad():
            hf(ids)  # the user's own forward: the notice is theirs
        assert [r for r in records if "falling back" in r]
    finally:
        logger.removeHandler(handler)


@pytest.mark.skipif(transformers_minor() >= (5, 25), reason=(
    "from transformers 5.25 Falcon attends through the attention interface: no registered family's proof switches "
    "its twin's attention implementation any more"))
def test_the_proofs_implementation_switch_notice_is_dropped_only_inside_nncanon(tmp_path, monkeypatch):
    """Proving Falcon's sdpa call makes an sdpa copy of the twin, and transformers says Falcon cannot switch
    (a plain ``logger.warning``): not the user's doing, so not shown; the user's own switch still shows it."""
    from nncanon.quiet import SWITCH_LOGGER

    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger(SWITCH_LOGGER)
    logger.addHandler(handler)
    notice = "setting its attention implementation"
    try:
        nncanon.StandardizedTransformer(tiny_hf_model("falcon_7b_style", attn_implementation="sdpa"),
                                        tokenizer=tiny_tokenizer(), verify="always")
        assert not [r for r in records if notice in r]
        monkeypatch.setattr("nncanon.quiet.SWITCH_NOTICE", "a notice transformers never logs")
        nncanon.StandardizedTransformer(tiny_hf_model("falcon_7b_style", attn_implementation="sdpa"),
                                        tokenizer=tiny_tokenizer(), verify="always")
        assert [r for r in records if notice in r], "the proof must switch Falcon's copy for this test to mean anything"
    finally:
        logger.removeHandler(handler)
