"""``nncanon matrix``: the invariant suite on every registered family, written as a status matrix.

Runs ``tests/families`` (from a source checkout) with pytest, collects each test's outcome per
registry variant, and writes ``model_registry/status.json`` and ``model_registry/status.md`` with the
versions of torch, transformers and nnsight it ran against. The families docs page shows it.
A run that did not go to its end (interrupted, refused by pytest, or selecting nothing) writes nothing.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from .docs_tables import docs_dir, write
from .registry import STATUS_FILE, registry_dir, variants

_ID = re.compile(r"::(?P<test>[^\[]+)\[(?P<variant>[^\]]+)\]")


def _split(test_id: str, test: str) -> tuple[str, str]:
    """The variant of a test id's parameters, and the test's name with the other parameters
    (``test_check_holds[llama-heads]`` -> ``("llama", "test_check_holds[heads]")``)."""

    names = sorted((v.name for v in variants()), key=len, reverse=True)  # gpt_neox_parallel before gpt_neox
    for name in names:
        if test_id == name:
            return name, test
        if test_id.startswith(name + "-"):
            return name, f"{test}[{test_id[len(name) + 1:]}]"
    return test_id, test


class _Collector:
    """A pytest plugin recording ``{variant: {test: outcome}}`` with a progress bar."""

    def __init__(self, quiet: bool) -> None:
        self.results: dict[str, dict[str, str]] = {}
        self.skipped: dict[str, str] = {}  # variant: the reason its last skipped test gave
        self.quiet = quiet
        self.bar = None

    def pytest_collection_finish(self, session) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=len(session.items), desc="matrix", unit="test", file=sys.stderr, disable=self.quiet)

    def pytest_runtest_logreport(self, report) -> None:
        match = _ID.search(report.nodeid)
        if match is None:
            return
        variant, test = _split(match["variant"], match["test"])
        outcomes = self.results.setdefault(variant, {})
        if report.when == "call" or report.outcome != "passed":
            if outcomes.get(test) != "failed":
                outcomes[test] = report.outcome
            if report.outcome == "skipped" and isinstance(getattr(report, "longrepr", None), tuple):
                self.skipped[variant] = str(report.longrepr[2]).removeprefix("Skipped: ")
        if report.when == "teardown" and self.bar is not None:
            self.bar.update(1)


def run_matrix(selection: str = "", quiet: bool = False, workers: str = "0", out: str | None = None) -> int:
    """Run the suite (``-k selection``), write the matrix, print a summary; returns the exit code.

    The matrix goes to ``model_registry/`` (and the families docs page is regenerated), or to ``out``.
    """
    import nnsight
    import pytest
    import torch
    import transformers

    tests = registry_dir().parent / "tests" / "families"
    if not tests.is_dir():
        print("nncanon matrix runs the invariant suite from a source checkout (tests/families not found)",
              file=sys.stderr)
        return 2
    collector = _Collector(quiet)
    # anyio's plugin cannot load once nnsight (imported by nncanon) is in the process.
    arguments = [str(tests), "-q", "-p", "no:cacheprovider", "-p", "no:anyio", "--no-header", "-rN"]
    if selection:
        arguments += ["-k", selection]
    if workers != "0":
        arguments += ["-n", workers]
    start = time.time()
    code = pytest.main(arguments, plugins=[collector])
    elapsed = time.time() - start
    refusal = _incomplete(int(code), collector, selection)
    if refusal is not None:
        reason, exit_code = refusal
        print(f"\nnncanon matrix: {reason}; status.json, status.md and docs/families.md are unchanged.",
              file=sys.stderr)
        return exit_code
    known = {v.name: v.model_type for v in variants()}
    rows = {}
    for name, outcomes in sorted(collector.results.items()):
        failed = sorted(t for t, o in outcomes.items() if o == "failed")
        ran = any(o == "passed" for o in outcomes.values())
        rows[name] = {
            "model_type": known.get(name, "?"),
            # a variant whose every test skipped (a library missing here) did not pass anything
            "status": "FAIL" if failed else "pass" if ran else f"not run: {collector.skipped.get(name, 'skipped')}",
            "tests": len(outcomes),
            "failed": failed,
        }
    status = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "nnsight": nnsight.__version__, "python": sys.version.split()[0]},
        "selection": selection or None,
        "seconds": round(elapsed, 1),
        "variants": rows,
    }
    into = registry_dir() if out is None else Path(out)
    into.mkdir(parents=True, exist_ok=True)
    previous = into / STATUS_FILE
    if selection and previous.exists():  # a filtered run updates its rows, keeps the others
        merged = json.loads(previous.read_text())
        merged["variants"].update(rows)
        merged["versions"] = status["versions"]
        merged["last_filtered_run"] = {"selection": selection, "seconds": status["seconds"]}
        status = merged
    previous.write_text(json.dumps(status, indent=2, sort_keys=True) + "\n")
    (into / "status.md").write_text(_markdown(status))

    if out is None and docs_dir().is_dir():
        write()  # the families page shows the matrix
    passed = sum(r["status"] == "pass" for r in rows.values())
    print(f"\n{passed} of {len(rows)} variants pass in {elapsed:.0f}s; wrote {previous} and status.md")
    return 0 if code == 0 else 1


#: pytest's exit codes that mean the suite ran to its end: all passed, or some failed.
_RAN = (0, 1)


def _incomplete(code: int, collector: _Collector, selection: str) -> tuple[str, int] | None:
    """Why this pytest run cannot stand as a status matrix, with the exit code to return; ``None`` if it can.

    Only a run that collected variants and ran them to the end is written: not one pytest refused (a usage
    error such as ``-n bogus``), one interrupted (Ctrl-C), one that crashed, or a ``-k`` that selected nothing.
    """
    if code == 5 or (code in _RAN and not collector.results):
        return f"-k {selection!r} selected no variant's test, so there is nothing to write", 2
    if code == 4:
        return f"pytest refused the arguments (exit code {code}: a usage error; see above)", 2
    if code == 2:
        return "the run was interrupted before the end (exit code 2)", 1
    if code not in _RAN:
        return f"pytest did not run the suite to the end (exit code {code}: an internal error; see above)", 1
    return None


def _markdown(status: dict) -> str:
    v = status["versions"]
    lines = [
        "# Status matrix",
        "",
        f"Written by `nncanon matrix` against torch {v['torch']}, transformers {v['transformers']}, "
        f"nnsight {v['nnsight']}, Python {v['python']}.",
        "",
        "| variant | model type | status | tests | failed |",
        "|---|---|---|---|---|",
    ]
    for name, row in sorted(status["variants"].items()):
        lines.append(f"| {name} | {row['model_type']} | {row['status']} | {row['tests']} | "
                     f"{', '.join(row['failed']) or '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_matrix(" ".join(sys.argv[1:])))

