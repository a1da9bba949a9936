"""Tables generated from the registry for the docs: where each family keeps its values, and the matrix.

``python -m nncanon.docs_tables`` rewrites ``docs/families.md``; a test checks it is current.
"""

from __future__ import annotations

import json
from pathlib import Path

from .families import REGISTRY, Family
from .proof.checks import CHECKS
from .proof.shrink import COUNT_KIND, RULES, VOCABULARY_KIND, WIDTH_KIND, WINDOW_KIND
from .registry import STATUS_FILE, records, registry_dir
from .served import Site, describe_factor


def describe(site: Site | None) -> str:
    """A site in words: ``self_attn`` output[0], ``post_feedforward_layernorm`` output, ..."""
    if site is None:
        return "-"
    where = f"`{site.module}`" if site.module else "the block"
    if site.weighted is not None:  # a per-stream write, taken over (`Site.weighted`)
        weight, output = site.weighted
        return f"op `{weight}` × op `{output}` in {where}, per stream (added to op `{site.op}`)"
    if site.op is not None:
        where = f"op `{site.op}` in {where}"
    text = f"{where} {site.key}" + (f"[{site.index}]" if site.index is not None else "")
    if site.scale is not None:
        text += f" × {describe_factor(site.scale)}"
    if site.flat:
        text += " (flat b·s)"
    if site.clone:
        text += " (copied: changed in place later)"
    return text


def _layouts(family: Family) -> list[tuple[str, Family]]:
    if not family.layouts:
        return [("", family)]
    return [(kind, layout) for kind, layout in zip(family.layouts, family.all_layouts()[1:], strict=True)]


def contributions_table() -> str:
    """One row per family (and block kind): where attention, mixer and MLP contributions are read."""
    rows = [
        "| family | model types | block kind | attention (`attention_output`) | mixer (`linear_attention_output`) "
        "| MLP (`mlp_output`) | logits |",
        "|---|---|---|---|---|---|---|",
    ]
    seen: set[str] = set()
    for family in sorted(set(REGISTRY.values()), key=lambda f: f.name):
        if family.name in seen:
            continue
        seen.add(family.name)
        steps = ", ".join(step.describe() for step in family.logit_steps) or "-"
        for kind, layout in _layouts(family):
            attention = describe(layout.attention_output) if layout.attention else "-"
            mixer = describe(layout.mixer_output) if layout.mixer else "-"
            mlp = describe(layout.mlp_output)
            rows.append(
                f"| {family.name} | {', '.join(family.model_types)} | {kind or '-'} | {attention} | {mixer} "
                f"| {mlp} | {steps} |"
            )
    return "\n".join(rows)


def matrix_table() -> str:
    """The registry: every model type, its family, its tiny variants, checkpoints and last matrix status."""
    status_path = registry_dir() / STATUS_FILE
    status = json.loads(status_path.read_text())["variants"] if status_path.exists() else {}
    rows = [
        "| model type | family | variants (status) | declined (with the reason in `support()`) | known checkpoints |",
        "|---|---|---|---|---|",
    ]
    for model_type, record in sorted(records().items()):
        family = REGISTRY.get(model_type)
        variants = ", ".join(
            f"{name} ({status[name]['status']})" if name in status else name for name in record["variants"]
        )
        declined = "; ".join(
            f"{name}: {_declined(values)}" for name, values in record.get("declined_variants", {}).items()
        ) or "-"
        checkpoints = ", ".join(f"`{c}`" for c in record.get("checkpoints", [])) or "-"
        rows.append(
            f"| {model_type} | {family.name if family else '**unregistered**'} | {variants} | {declined} "
            f"| {checkpoints} |"
        )
    return "\n".join(rows)


def shrinking_table() -> str:
    """The twin's shrinking rules (`nncanon.proof.shrink.RULES`): what each size becomes."""

    factor = {WIDTH_KIND: "÷ F", COUNT_KIND: "the config's", WINDOW_KIND: "the table's (the config's at step 4)",
              VOCABULARY_KIND: "the table's"}
    rows = ["| size | kind | config attributes | step 1: the table | steps 2-4: common factor F |",
            "|---|---|---|---|---|"]
    rows += [f"| {rule.what} | {rule.kind} | {', '.join(f'`{name}`' for name in rule.names)} | {rule.becomes} | "
             f"{factor[rule.kind]} |" for rule in RULES]
    return "\n".join(rows)


def checks_table() -> str:
    """The verifier's checks (`nncanon.proof.checks.CHECKS`), in the order they run, and what each proves:
    the values, or their gradients (``value.grad``)."""

    rows = ["| check | proves | what it asserts |", "|---|---|---|"]
    rows += [f"| `{check.name}` | {'`value.grad`' if check.gradient else 'the value'} | {check.doc} |"
             for check in CHECKS]
    return "\n".join(rows)


def _declined(values: list | dict) -> str:
    """A record's declines: ``a, b`` (every layer that has them) or ``layers[0]: a, b``."""
    if isinstance(values, dict):
        return ", ".join(f"layers[{layer}]: {', '.join(names)}" for layer, names in values.items())
    return ", ".join(values)


FAMILIES_PAGE = """# Families

Generated from the registry by `python -m nncanon.docs_tables` (a test keeps it current).
{count} model types in {families} families are registered. `nncanon matrix` runs the invariant suite on
every one of them and records the status shown here. A value a variant declines is one its blocks have
but that nncanon cannot serve exactly (a post-norm model's contributions, say); `model.support()` gives
the reason, and reading it raises `ValueNotAvailable` with that reason.

Multimodal checkpoints whose causal-LM class is their text model load through their text config, as
transformers builds them: Qwen3.5 (`qwen3_5` → `qwen3_5_text`), Qwen3.5-MoE (`qwen3_5_moe` →
`qwen3_5_moe_text`) and Llama-4 (`llama4` → `llama4_text`). Gemma-3's checkpoints build the whole
multimodal model, which is registered itself (`gemma3`).

## Where each family keeps its contributions

Every value is read where the family really adds it to the residual stream: a module's output, a
norm's output (post-norm families), an operation inside a forward, scaled by a config factor where the
block scales it.

{contributions}

## The registry

{matrix}
"""


def families_page() -> str:
    return FAMILIES_PAGE.format(
        count=len(REGISTRY),
        families=len({f.name for f in REGISTRY.values()}),
        contributions=contributions_table(),
        matrix=matrix_table(),
    )


def docs_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "docs"


#: Tables pasted into hand-written pages, each after a ``<!-- generated: nncanon.docs_tables.NAME -->`` line.
GENERATED_TABLES = {"shrinking_table": shrinking_table, "checks_table": checks_table}


def refresh_tables(page: str) -> str:
    """``page`` with the table after each generated-table marker replaced by the current one."""
    lines, out, skipping = page.split("\n"), [], False
    for line in lines:
        if skipping:
            if line.startswith("|"):
                continue
            skipping = False
        out.append(line)
        marker = line.strip().removeprefix("<!-- generated: nncanon.docs_tables.").removesuffix(" -->")
        if marker in GENERATED_TABLES and line.strip().startswith("<!-- generated:"):
            out.append(GENERATED_TABLES[marker]())
            skipping = True
    return "\n".join(out)


def write() -> list[Path]:
    """Write the families page and refresh the generated tables of every other page."""
    path = docs_dir() / "families.md"
    path.write_text(families_page())
    written = [path]
    for page in sorted(docs_dir().glob("*.md")):
        text = page.read_text()
        refreshed = refresh_tables(text)
        if refreshed != text:
            page.write_text(refreshed)
            written.append(page)
    return written


if __name__ == "__main__":
    for path in write():
        print(f"wrote {path}")
