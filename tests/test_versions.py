"""The one place that knows what the installed transformers has (nncanon.versions) and how the suite uses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
import torch
import transformers
from packaging.specifiers import SpecifierSet

from nncanon.registry import Variant, variants
from nncanon.versions import (
    NEWEST_MINOR,
    OLDEST_MINOR,
    missing_from_transformers,
    missing_libraries,
    transformers_minor,
)

from .conftest import variant_params


def test_installed_minor_is_in_the_supported_range():
    assert transformers_minor() == tuple(int(part) for part in transformers.__version__.split(".")[:2])
    assert OLDEST_MINOR <= transformers_minor() <= NEWEST_MINOR


def test_pyproject_asks_for_the_supported_range():
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (requirement,) = [r for r in project["dependencies"] if r.startswith("transformers")]
    oldest, newest = (".".join(map(str, minor)) for minor in (OLDEST_MINOR, (NEWEST_MINOR[0], NEWEST_MINOR[1] + 1)))
    assert requirement.replace(" ", "") == f"transformers>={oldest},<{newest}"


#: The torch versions the whole suite passed on (docs/versions.md): 2.13.0 in CI, 2.14.1 in a documented run.
TESTED_TORCH = ("2.13.0", "2.14.1")


def test_pyproject_admits_every_tested_torch_and_keeps_the_one_installed():
    """The range admits what passed (a user on torch 2.14 is not downgraded), nothing newer, and the torch installed
    here: pip upgrades no installed requirement that satisfies its range, so installing the package where torch
    2.13.0 is (README, .ci/run) never pulls another torch."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (requirement,) = [r for r in project["dependencies"] if r.startswith("torch")]
    allowed = SpecifierSet(requirement.removeprefix("torch"))
    assert all(version in allowed for version in TESTED_TORCH), requirement
    assert "2.15.0" not in allowed, f"{requirement} admits a torch no run of the suite tested"
    assert torch.__version__.split("+")[0] in allowed
    page = (Path(__file__).parents[1] / "docs" / "versions.md").read_text()
    assert all(version in page for version in TESTED_TORCH)


def test_missing_model_type_and_class_say_which():
    assert missing_from_transformers("llama", "LlamaConfig", None) is None
    assert missing_from_transformers("no_such_type") == (
        f"transformers {transformers.__version__} has no model type 'no_such_type'"
    )
    assert missing_from_transformers("llama", "NoSuchConfig") == (
        f"transformers {transformers.__version__} has no NoSuchConfig (model type 'llama')"
    )


def test_a_variant_transformers_lacks_is_skipped_with_the_reason(monkeypatch):
    absent = Variant("absent", "no_such_type", "NoSuchConfig", {})
    assert absent.unavailable == f"transformers {transformers.__version__} has no model type 'no_such_type'"
    monkeypatch.setattr("tests.conftest.VARIANTS", [*variants()[:1], absent])
    present, skipped = variant_params()
    assert present.marks == [] and present.values[0] == variants()[0]
    (mark,) = skipped.marks
    assert (mark.name, mark.kwargs["reason"]) == ("skip", absent.unavailable)


def test_a_variant_the_record_says_this_minor_cannot_run_is_skipped_with_the_reason(monkeypatch):
    from nncanon import registry

    original = registry.records()
    minor = "{}.{}".format(*transformers_minor())

    def entry(minors, names):
        record = {**original["llama"], "unavailable": [{"transformers": minors, "variants": names, "why": "why"}]}
        monkeypatch.setattr(registry, "records", lambda: {**original, "llama": record})
        return registry.variant("llama").unavailable

    assert entry([minor], ["llama"]) == f"transformers {transformers.__version__} cannot run variant 'llama': why"
    assert entry(["5.0"], ["llama"]) is None  # another minor
    assert entry([minor], ["llama_other"]) is None  # another variant


def test_available_variants_are_exactly_those_without_a_reason():
    everything = variants()
    assert variants(available=True) == [v for v in everything if v.unavailable is None]
    assert all(isinstance(v.unavailable, str) for v in everything if v not in variants(available=True))
    runnable = [v for v in everything if missing_libraries(v.requires) is None]
    if transformers_minor() == NEWEST_MINOR:  # every record's model type is in the newest minor
        assert variants(available=True) == runnable
    if transformers_minor() == (5, 24):  # it lacks exactly the types new in 5.25 (docs/versions.md)
        assert {v.model_type for v in runnable if v.unavailable} == NEW_IN_5_25


#: The registered model types that transformers 5.25 adds.
NEW_IN_5_25 = {"ergo", "kolibri1_1", "minicpm5_moe", "param2moe"}


@pytest.mark.parametrize("variant", variant_params(["llama"]))
def test_variant_params_selects_by_name(variant):
    assert variant.name == "llama"


def test_a_load_on_an_untested_minor_warns_with_the_range_and_a_tested_install(monkeypatch):
    import warnings

    from nncanon import UntestedTransformersWarning, versions
    from nncanon.testing import tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("error", UntestedTransformersWarning)
        tiny_model("gpt2")  # the installed minor is in the range: no warning
    for untested in ((5, NEWEST_MINOR[1] + 1), (5, OLDEST_MINOR[1] - 1)):
        monkeypatch.setattr(versions, "transformers_minor", lambda minor=untested: minor)
        shown = ".".join(map(str, untested))
        with pytest.warns(UntestedTransformersWarning, match=rf"transformers {shown} \(.* installed\) is outside .*"
                          r"proved on a twin.*pip install \"transformers>=5\.21,<5\.26\""):
            model = tiny_model("gpt2")
        assert model.support().layers_with("attention_output") == [0, 1]  # the load goes on and proves
