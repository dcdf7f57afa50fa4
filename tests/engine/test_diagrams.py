"""The diagrams and step tables in specs/ are generated from phases/ and must be current.

``CUINTERPOSE_REGENERATE_SPECS=1 .venv/bin/pytest tests/engine/test_diagrams.py`` rewrites them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from cuinterpose.engine.fsm import MACHINES, MachineSpec, mermaid
from cuinterpose.phases import OPS
from transitions.extensions.diagrams import GraphMachine

SPECS = Path(__file__).resolve().parent.parent.parent / "specs"
# Where each machine is explained (its diagram and step table embedded).
SPEC_FILES = {"capture": "capture.md", "restore": "restore.md", "rollback": "recovery.md"}
REGENERATE = os.environ.get("CUINTERPOSE_REGENERATE_SPECS") == "1"


def steps_table(spec: MachineSpec) -> str:
    rows = [
        "| step | op sent | reply phase | guards (before) | tears down | progress |",
        "|---|---|---|---|---|---|",
    ]
    for step in spec.steps:
        rows.append(
            f"| {step.trigger} | {step.op or '(local)'} | {step.expected_phase or '-'} | "
            f"{', '.join(step.guards) or '-'} | {'yes' if step.tears_down else 'no'} | "
            f"{step.progress.value} |"
        )
    rows.append("")
    rows += [f"- `{g.name}`: {g.description}" for g in spec.guards]
    return "\n".join(rows) + "\n"


def generated(kind: str, spec: MachineSpec) -> str:
    if kind == "DIAGRAM":
        return "```mermaid\n" + mermaid(spec) + "```\n"
    return steps_table(spec)


def _block(kind: str, name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- BEGIN GENERATED {kind} {name} -->\n)(.*?)(<!-- END GENERATED {kind} {name} -->)",
        re.DOTALL,
    )


def _normal(text: str) -> list[str]:
    # Editors strip trailing blanks; they are no part of the diagram.
    return [line.rstrip() for line in text.strip("\n").splitlines()]


@pytest.mark.parametrize("name", sorted(MACHINES))
@pytest.mark.parametrize("kind", ["DIAGRAM", "STEPS"])
def test_specs_embed_the_current_generated_text(name: str, kind: str) -> None:
    path = SPECS / SPEC_FILES[name]
    text = path.read_text(encoding="utf-8")
    pattern = _block(kind, name)
    match = pattern.search(text)
    assert match, f"{path} lacks the GENERATED {kind} {name} markers"
    fresh = generated(kind, MACHINES[name])
    if REGENERATE:
        text = pattern.sub(lambda m: m.group(1) + fresh + m.group(3), text)
        path.write_text(text, encoding="utf-8")
        return
    assert _normal(match.group(2)) == _normal(fresh), (
        f"{path}: the embedded {kind.lower()} is stale; rerun with CUINTERPOSE_REGENERATE_SPECS=1"
    )


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_the_diagram_shows_every_state_step_and_guard(name: str) -> None:
    spec = MACHINES[name]
    source = mermaid(spec)
    assert source.startswith(f"---\ntitle: {spec.title}\n---\nstateDiagram-v2\n")
    for state in spec.all_states:
        assert f'state "{state}" as {state}' in source
    for step in spec.steps:
        label = step.trigger + (f" [{' & '.join(step.guards)}]" if step.guards else "")
        assert f"{step.source} --> {step.dest}: {label}\n" in source
    assert f"[*] --> {spec.initial}" in source


def test_a_change_in_phases_changes_the_diagram() -> None:
    import attrs

    spec = MACHINES["capture"]
    renamed = attrs.evolve(
        spec, steps=(*spec.steps[:-1], attrs.evolve(spec.steps[-1], dest="done")), final="done"
    )
    assert "prepared --> done: WRITE_STATE" in mermaid(renamed)
    assert mermaid(renamed) != mermaid(spec)


def test_the_mermaid_engine_needs_no_graphviz() -> None:
    machine = GraphMachine(states=["a", "b"], initial="a", graph_engine="mermaid")
    assert machine.graph_cls.__module__ == "transitions.extensions.diagrams_mermaid"


def test_protocol_spec_lists_the_codecs_values() -> None:
    from cuinterpose.engine.wire import HEADER_STRUCT, RECORD_STRUCT, Op, Phase, Status

    text = (SPECS / "protocol.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| (\d+) \| (\w+) \|", text, re.MULTILINE))
    for enum_type in (Op, Phase, Status):
        for member in enum_type:
            assert (str(member.value), member.name) in rows, f"{enum_type.__name__}.{member.name}"
    # The op table's last column is the engine's tears_down.
    tears = dict(re.findall(r"^\| (\d+) \| \w+ \|(?: [^|]* \|){3} (yes|no) \|$", text, re.M))
    assert tears == {str(o.number): "yes" if o.tears_down else "no" for o in OPS}
    assert f"`'{HEADER_STRUCT.format}'`" in text
    assert "'<HHI16s16s32sQQQQQQQiiiiIBBHII' + 'iiQ' * 8" in text
    assert RECORD_STRUCT.size == 288 and HEADER_STRUCT.size == 128
