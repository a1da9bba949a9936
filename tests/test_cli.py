"""The command line: its output against the surface, its files, and its exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import transformers

import nncanon
from nncanon.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from nncanon.demo import DEMO_MODELS
from nncanon.testing import tiny_hf_model, tiny_tokenizer
from nncanon.versions import transformers_minor

PROMPT = "The Eiffel Tower is in the city of"


def _table(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """The ablate table: the column labels and ``{run: cells}``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    labels = re.findall(r"(\S+ \(layer \d+, \w+\))", lines[start])
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = line.split()
        rows[" ".join(cells[: len(cells) - len(labels)])] = cells[len(cells) - len(labels) :]
    return labels, rows


def _probability(model, layer: int, zero: str | None) -> float:
    """P(" Paris") with ``zero`` (a component of block ``layer``) zeroed: the ablation page's recipe."""
    token = model.tokenizer(" Paris", add_special_tokens=False).input_ids[0]
    with torch.no_grad(), model.trace(PROMPT):
        if zero == "attention":
            model.layers[layer].self_attn.attention_output[:] = 0
        elif zero == "linear":
            model.layers[layer].linear_attn.linear_attention_output[:] = 0
        elif zero == "mlp":
            model.layers[layer].mlp.mlp_output[:] = 0
        probability = model.next_token_probs[0, token].save()
    return float(probability)


def test_ablate_on_the_demo_models_prints_the_recipe_and_a_heatmap(tmp_path, capsys):
    assert main(["ablate", "--out", str(tmp_path), "--quiet"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert "Loading weights" not in err and "%|" not in err, "--quiet shows no progress bar, transformers' included"
    labels, rows = _table(out)
    assert [label.split()[0] for label in labels] == list(DEMO_MODELS)
    assert {"clean", "mlp", "head 0", "head 3"} <= set(rows)
    for column, label in enumerate(labels):
        name, layer, kind = re.match(r"(\S+) \(layer (\d+), (\w+)\)", label).groups()
        model = nncanon.demo_model(name)
        mixer = "attention" if kind == "attention" else "linear mixer"
        assert float(rows["clean"][column]) == pytest.approx(_probability(model, int(layer), None), abs=5e-4)
        assert float(rows[mixer][column]) == pytest.approx(_probability(model, int(layer), kind), abs=5e-4)
        assert float(rows["mlp"][column]) == pytest.approx(_probability(model, int(layer), "mlp"), abs=5e-4)
        assert float(rows["clean"][column]) > 0.5, "the demo models know the Eiffel Tower"
    png = tmp_path / "head_effects.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in out


def test_ablate_fast_plots_the_first_order_estimate(tmp_path, capsys):
    """``--fast``: the heatmap is attribution patching's estimate of zeroing each head on the target's log-odds
    (P near 1 saturates P's gradient), equal to ``Σ head · ∂logodds/∂head`` computed with hooks and autograd on the
    plain model, and marked "estimated" in the output and on the picture."""
    from nncanon.proof.checks.gradient_references import gradient_reference
    from nncanon.proof.checks.references import encode, site_reference
    from nncanon.study import head_effects, target_token

    assert main(["ablate", "--model", "gpt2", "--fast", "--out", str(tmp_path), "--quiet"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "estimated (attribution patching) effect on the log-odds of P(target)" in out
    assert (tmp_path / "head_effects.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = nncanon.demo_model("gpt2")
    token = target_token(model, " Paris")
    effects = head_effects(model, PROMPT, " Paris", fast=True)
    inputs = encode(model, PROMPT)

    def probability(logits):  # the log-odds: log P - log(1 - P), a logit difference that does not saturate near 1
        p = torch.softmax(logits[:, -1].double(), -1)[:, token]
        return (torch.log(p) - torch.log1p(-p)).sum()

    for layer in range(model.num_layers):
        heads = site_reference(model, layer, "attention_head_outputs", inputs)
        grad = gradient_reference(model, layer, ["attention_head_outputs"], inputs, probability)
        expected = (heads * grad["attention_head_outputs"]).sum(dim=(1, -1))[0]
        torch.testing.assert_close(effects[layer], expected, rtol=1e-4, atol=1e-7)


def test_ablate_refuses_bad_models_and_layers(tmp_path, capsys):
    assert main(["ablate", "--model", str(tmp_path / "missing"), "--quiet"]) == EXIT_USAGE
    assert "cannot load" in capsys.readouterr().err
    assert main(["ablate", "--model", "gpt2", "--layer", "99", "--out", str(tmp_path), "--quiet"]) == EXIT_USAGE
    assert "--layer 99 is out of range for gpt2 (4 layers)" in capsys.readouterr().err


def test_support_prints_the_report_of_a_folder(tmp_path, capsys):
    tiny_hf_model("qwen3_next").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert main(["support", str(tmp_path), "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    model = nncanon.StandardizedTransformer(str(tmp_path))
    assert report == json.loads(json.dumps(model.support().to_dict()))
    assert main(["support", str(tmp_path)]) == EXIT_OK
    assert "linear_attn" in capsys.readouterr().out


def test_support_names_an_unknown_family(tmp_path, capsys):
    config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)
    config.save_pretrained(tmp_path)
    assert main(["support", str(tmp_path)]) == EXIT_USAGE
    assert "bert" in capsys.readouterr().err


def test_families_checks_the_selected_variants(capsys):
    assert main(["families", "-k", "mpt", "--quiet"]) == EXIT_OK
    out = capsys.readouterr().out
    # MPT computes attention inline: the kernel's per-head inputs are read at its own calls, nothing declined.
    assert re.search(r"^mpt\s+mpt\s+mpt\s+2\s+\S+\s+-\s+ok$", out, re.MULTILINE), out
    assert "1 of 1 variants pass" in out
    # Falcon under eager before transformers 5.25 multiplies them inline (its sdpa call runs under sdpa only):
    # declined by rule; from 5.25 it attends through transformers' interface, nothing declined.
    assert main(["families", "-k", "falcon_7b", "--quiet"]) == EXIT_OK
    declined = "query_states, key_states, value_states" if transformers_minor() < (5, 25) else "-"
    row = rf"^falcon_7b_style\s.*\s{declined}\s+ok$"
    assert re.search(row, capsys.readouterr().out, re.MULTILINE)
    # Falcon-H1 runs attention and a Mamba mixer side by side: the identity sums both.
    assert main(["families", "-k", "falcon_h1", "--quiet"]) == EXIT_OK
    assert re.search(r"^falcon_h1\s.*\s-\s+ok$", capsys.readouterr().out, re.MULTILINE)
    assert main(["families", "-k", "no-such-family", "--quiet"]) == EXIT_USAGE


def test_families_skips_a_model_type_transformers_lacks(capsys, monkeypatch):
    from nncanon import registry

    mpt, absent = registry.variant("mpt"), registry.Variant("mpt_absent", "no_such_type", "NoSuchConfig", {})
    monkeypatch.setattr(registry, "variants", lambda: [mpt, absent])
    assert main(["families", "-k", "mpt", "--quiet"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"skipped: {absent.unavailable}" in out
    assert "1 of 2 variants pass (2 model types), 1 skipped (not buildable here: see status)." in out


def _matrix(selection: str, out) -> None:
    # In a process of its own: the matrix runs pytest.
    done = subprocess.run(
        [sys.executable, "-m", "nncanon", "matrix", "-k", selection, "--out", str(out), "--quiet"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == EXIT_OK, done.stdout[-3000:] + done.stderr[-3000:]


def test_matrix_writes_the_status_of_the_selected_variants(tmp_path):
    _matrix("mpt", tmp_path)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["versions"]["torch"] == torch.__version__
    assert status["versions"]["transformers"] == transformers.__version__
    assert status["variants"]["mpt"]["status"] == "pass" and status["variants"]["mpt"]["tests"] > 10
    assert "| mpt | mpt | pass |" in (tmp_path / "status.md").read_text()
    # A second filtered run adds its rows and keeps the others, and says what it ran.
    _matrix("ctrl", tmp_path)
    merged = json.loads((tmp_path / "status.json").read_text())
    assert {"mpt", "ctrl"} <= set(merged["variants"]) and merged["selection"] == "mpt"
    assert merged["last_filtered_run"]["selection"] == "ctrl"


@pytest.mark.parametrize(
    "arguments, code, says",
    [
        (["-k", "no_such_variant_anywhere"], EXIT_USAGE, "selected no variant's test"),
        (["-k", "mpt", "-n", "bogus"], EXIT_USAGE, "pytest refused the arguments"),
    ],
    ids=["selects-nothing", "usage-error"],
)
def test_a_matrix_run_that_did_not_run_writes_nothing(tmp_path, arguments, code, says):
    before = '{"variants": {"mpt": {"status": "pass"}}}\n'
    (tmp_path / "status.json").write_text(before)
    done = subprocess.run([sys.executable, "-m", "nncanon", "matrix", *arguments, "--out", str(tmp_path), "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == code, done.stderr[-3000:]
    assert says in done.stderr and "are unchanged" in done.stderr
    assert (tmp_path / "status.json").read_text() == before and not (tmp_path / "status.md").exists()


def test_an_interrupted_matrix_run_writes_nothing(tmp_path, monkeypatch):
    """Ctrl-C after some variants ran: pytest returns "interrupted" (2) with partial results; none is written,
    neither the registry's status files nor the families page."""
    import nncanon.docs_tables
    import nncanon.matrix

    registry = tmp_path / "model_registry"
    (tmp_path / "tests" / "families").mkdir(parents=True)
    registry.mkdir()
    (registry / "status.json").write_text("{}\n")
    written = []

    class Report:
        nodeid = "tests/families/test_invariants.py::test_contribution_identity[gpt2]"
        when, outcome = "call", "passed"

    def interrupted(arguments, plugins):
        plugins[0].pytest_runtest_logreport(Report())
        return pytest.ExitCode.INTERRUPTED

    monkeypatch.setattr(nncanon.matrix, "registry_dir", lambda: registry)
    monkeypatch.setattr(pytest, "main", interrupted)
    monkeypatch.setattr(nncanon.docs_tables, "write", lambda: written.append("families.md"))
    assert nncanon.matrix.run_matrix(quiet=True) == EXIT_FAILED
    assert (registry / "status.json").read_text() == "{}\n" and not (registry / "status.md").exists()
    assert written == []


def test_a_variant_whose_tests_all_skipped_is_not_reported_as_passing(tmp_path, monkeypatch):
    """A variant that could not run here (a library its model class needs is missing) is written "not run"
    with the skip's reason; a variant with a passed test and none failed is "pass"."""
    import json

    import nncanon.docs_tables
    import nncanon.matrix

    registry = tmp_path / "model_registry"
    (tmp_path / "tests" / "families").mkdir(parents=True)
    registry.mkdir()

    class Report:
        when = "call"

        def __init__(self, variant: str, outcome: str, longrepr=None):
            self.nodeid = f"tests/families/test_invariants.py::test_contribution_identity[{variant}]"
            self.outcome, self.longrepr = outcome, longrepr

    def run(arguments, plugins):
        plugins[0].pytest_runtest_logreport(Report("gpt2", "passed"))
        plugins[0].pytest_runtest_logreport(Report("gemma3n", "skipped", ("f.py", 1, "Skipped: needs timm")))
        return pytest.ExitCode.OK

    monkeypatch.setattr(nncanon.matrix, "registry_dir", lambda: registry)
    monkeypatch.setattr(pytest, "main", run)
    monkeypatch.setattr(nncanon.docs_tables, "write", lambda: None)
    assert nncanon.matrix.run_matrix(quiet=True) == EXIT_OK
    rows = json.loads((registry / "status.json").read_text())["variants"]
    assert rows["gpt2"]["status"] == "pass"
    assert rows["gemma3n"]["status"] == "not run: needs timm"


def test_help_everywhere():
    for command in ([], ["ablate"], ["support"], ["families"], ["matrix"]):
        with pytest.raises(SystemExit) as exit_:
            main([*command, "--help"])
        assert exit_.value.code == EXIT_OK
    with pytest.raises(SystemExit) as exit_:
        main(["no-such-command"])
    assert exit_.value.code == EXIT_USAGE
    assert EXIT_FAILED == 1


def _cli(*arguments: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nncanon", *arguments], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def _one_line(stderr: str) -> str:
    """The lines of stderr, transformers' loading bars aside: exactly one, and no traceback."""
    bars = ("Loading weights", "Writing model shards", "it/s]")
    lines = [line for line in stderr.splitlines() if line.strip() and not any(bar in line for bar in bars)]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "arguments, says",
    [
        (["ablate", "--model", "llama", "--target", ""], r"--target '' encodes to no token for llama"),
        (["ablate", "--model", "llama", "--layer", "9"], r"--layer 9 is out of range for llama \(4 layers\)"),
        (["support", "gpt2", "--attn", "bogus"], r"'bogus' is not an attention implementation; one of eager"),
        (["ablate", "--layer", "one"], r"argument --layer: invalid int value: 'one'"),
    ],
    ids=["empty-target", "layer", "attn", "argparse"],
)
def test_usage_errors_exit_2_with_one_line(arguments, says, tmp_path):
    done = _cli(*arguments, cwd=tmp_path)
    assert done.returncode == EXIT_USAGE
    assert re.search(says, _one_line(done.stderr))
    assert not (tmp_path / "nncanon-ablate").exists(), "no work before the usage error"


def test_an_unwritable_out_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = _cli("ablate", "--model", "llama", "--out", str(blocker / "figures"), cwd=tmp_path)
    assert done.returncode == EXIT_USAGE and done.stdout == "", "refused before the study prints its table"
    assert re.search(r"--out '.*a-file/figures': cannot create the folder: .*a-file is a file", _one_line(done.stderr))


def test_a_folder_with_a_config_alone_is_served_by_support_and_refused_by_ablate_before_any_study(tmp_path):
    folder = tmp_path / "config-only"
    tiny_hf_model("gpt2").config.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert _cli("support", str(folder)).returncode == EXIT_OK  # support() needs no weights
    done = _cli("ablate", "--model", str(folder), "--out", str(tmp_path / "out"), "--quiet")
    assert done.returncode == EXIT_USAGE and done.stdout == ""
    assert re.search(r"has a config but no weights .*model\.save_pretrained\(folder\)", _one_line(done.stderr))


def test_support_on_a_folder_without_tokenizer_files_is_a_usage_error(tmp_path):
    tiny_hf_model("gpt2").save_pretrained(tmp_path / "no-tokenizer")
    done = _cli("support", str(tmp_path / "no-tokenizer"))
    assert done.returncode == EXIT_USAGE
    assert re.search(r"has no tokenizer files .*tokenizer\.save_pretrained\(folder\)", _one_line(done.stderr))
    with pytest.raises(nncanon.TokenizerNotFound, match="no tokenizer files"):
        nncanon.StandardizedTransformer(str(tmp_path / "no-tokenizer"))


def test_a_multi_token_target_says_which_token_is_scored(tmp_path, capsys):
    assert main(["ablate", "--model", "llama", "--target", " Eiffel Tower", "--out", str(tmp_path), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"note \(llama\): the target ' Eiffel Tower' is 2 tokens .*P\(target\) is the probability of "
                     r"the first", captured.err)
    model = nncanon.demo_model("llama")
    token = model.tokenizer(" Eiffel", add_special_tokens=False).input_ids[0]
    with torch.no_grad(), model.trace(PROMPT):
        probability = model.next_token_probs[0, token].save()
    _, rows = _table(captured.out)
    assert float(rows["clean"][0]) == pytest.approx(float(probability), abs=5e-4)
def test_matrix_reads_the_variant_of_a_test_with_more_parameters():
    """``test_check_holds[gpt-sw3-heads]`` is variant ``gpt-sw3``'s ``heads`` check, not a variant of its own."""
    from nncanon.matrix import _split

    assert _split("llama-heads", "test_check_holds") == ("llama", "test_check_holds[heads]")
    assert _split("gpt-sw3-resume", "test_check_holds") == ("gpt-sw3", "test_check_holds[resume]")
    assert _split("gpt-sw3", "test_head_shapes") == ("gpt-sw3", "test_head_shapes")
