"""Real checkpoints never lose a value to their twin.

`model_registry/checkpoints/` holds the published ``config.json`` of real checkpoints (GPT-J-6B, RWKV-4,
RecurrentGemma-2B, Zamba2-1.2B, Bamba-9B, DeepSeek-V2-Lite, Granite-4.0-H, Kimi-Linear...; no weights). Each is
loaded as a user would, from its folder (built on meta), and its load-time proof must stand on a twin that
runs: no value declined for a reason of the proof (``not proved...``), only for what the family says the
block has not (a Zamba2 hybrid block's shared transformer adds nothing to the stream, say).
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import transformers

from nncanon import StandardizedTransformer
from nncanon.registry import registry_dir
from nncanon.testing import tiny_tokenizer

CORPUS = registry_dir() / "checkpoints"
INDEX = json.loads((CORPUS / "index.json").read_text())


def _missing(entry: dict) -> str | None:
    """Why the installed transformers cannot load this checkpoint's type (an older minor), else ``None``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if entry["model_type"] not in CONFIG_MAPPING:
        return f"transformers {transformers.__version__} has no model type {entry['model_type']!r}"
    return None


def _params() -> list:
    params = []
    for entry in INDEX:
        reason = _missing(entry)
        params.append(pytest.param(entry, id=entry["checkpoint"], marks=[pytest.mark.skip(reason=reason)] if reason
                                   else []))
    return params


def test_the_corpus_holds_the_checkpoints_researchers_load():
    names = {entry["checkpoint"] for entry in INDEX}
    assert len(names) >= 40
    for required in ("EleutherAI/gpt-j-6b", "Salesforce/codegen-350M-mono", "EleutherAI/pythia-160m",
                     "EleutherAI/gpt-neox-20b", "RWKV/rwkv-4-169m-pile", "google/recurrentgemma-2b",
                     "Zyphra/Zamba2-1.2B", "ibm-fms/Bamba-9B", "deepseek-ai/DeepSeek-V2-Lite",
                     "moonshotai/Kimi-Linear-48B-A3B-Instruct", "tiiuae/falcon-7b", "tiiuae/falcon-40b",
                     "google/gemma-2-9b", "google/gemma-2-27b", "mistralai/Mixtral-8x7B-v0.1",
                     "allenai/OLMoE-1B-7B-0924"):
        assert required in names
    assert any(name.startswith("ibm-granite/granite-4.0-h") for name in names)
    for entry in INDEX:
        assert (CORPUS / entry["folder"] / "config.json").is_file()
        assert entry["folder"] == entry["checkpoint"].replace("/", "--")


@pytest.mark.parametrize("entry", _params())
def test_a_real_checkpoint_loses_no_value_to_its_twin(entry, tmp_path):
    folder = tmp_path / entry["folder"]
    folder.mkdir()
    shutil.copy(CORPUS / entry["folder"] / "config.json", folder / "config.json")
    tiny_tokenizer().save_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a load that declines everything warns: none may here
        warnings.filterwarnings("ignore", message=".*(falling back|Model config|standardize_rope|xIELU).*")
        model = StandardizedTransformer(str(folder))
    assert model._module.device.type == "meta"
    report = model.support()
    assert report.cause is None, report.cause
    # (a checkpoint saved in bfloat16 loads in bfloat16, and is proved on a twin cast as it: docs/quantization.md)
    proved = r"proved on a twin (cast as this model \((bfloat16|float16)\) )?of this config"
    assert re.match(proved, report.provenance), report.provenance
    lost = {(row.index, value): reason for row in report.layers for value, reason in row.reasons.items()
            if reason is not None and reason.startswith("not proved")}
    assert not lost, next(iter(lost.values()))
    assert not {name: r for name, r in report.model_declines.items() if r.startswith("not proved")}
    gradients = {(row.index, value): reason for row in report.layers for value, reason in row.gradient_reasons.items()
                 if "not proved" in reason}
    assert not gradients, next(iter(gradients.values()))


def test_the_corpus_is_listed_in_the_readme():
    readme = (CORPUS / "README.md").read_text()
    for entry in INDEX:
        assert f"`{entry['checkpoint']}`" in readme
    assert Path(CORPUS / "index.json").is_file()


@pytest.mark.parametrize("checkpoint", ["openai-community/gpt2"])
def test_what_the_twin_proved_holds_on_the_full_size_model(checkpoint):
    """The verifier on the full-size model of a real config (random weights): every value against plain hooks on
    that model, the contribution identity, ablations, invokes, gradients... hold as on its twin.

    Every width is the checkpoint's (the stream's 768, 12 heads, the MLP's 3072, the vocabulary's 50257); its depth
    is 2 of its 12 blocks (the blocks are alike: each check runs per block, the skip and resume checks at the first
    and the middle one). ``benchmarks/full_size.py`` runs every checkpoint of the corpus of at most 600M parameters
    at its whole depth."""
    from nncanon.proof.full_size import verify_full_size

    entry = next(e for e in INDEX if e["checkpoint"] == checkpoint)
    config = transformers.AutoConfig.from_pretrained(CORPUS / entry["folder"])
    depth, width = config.n_layer, config.n_embd
    config.n_layer = 2
    run = verify_full_size(config)
    block = 12 * width**2 + 13 * width  # GPT-2's block: qkv, output, two MLP matrices with their biases, two norms
    assert run.parameters == entry["parameters"] - (depth - 2) * block
    failed = [result.describe() for result in run.verdict.failed()]
    assert not failed, failed[:3]
    checked = {result.check for result in run.verdict.results}
    assert {"read", "identity", "ablation", "invokes", "heads", "lens", "skip", "gradients"} <= checked
