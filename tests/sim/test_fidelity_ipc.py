"""The simulated driver answers the legacy-IPC probe as the H200 did.

``tools/probe_legacy_ipc.py`` ran on one H200 (driver 580.159.04); its output is
``specs/records/2026-12-01-h200-legacy-ipc.txt``. The same probe runs here against the
simulated driver and every line must agree: the call, its CUresult, the sizes, pitches
and bytes read, the pointer attributes (addresses and ids only as zero or not), whether a
handle is all zeros, and every native checkpoint step and state; except the deviations
listed below, each with its reason (shim_c/sim/README.md has them too).

The record ends where the H200's probe hung: the importer left CHECKPOINTED by its failed
restore never answered its next call. The simulator hangs there too (every driver call of
a process that is not RUNNING waits at the gate), so the probe is stopped once it has
printed as many lines as the record holds.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.simenv import is_simulated, sim_env

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "specs" / "records" / "2026-12-01-h200-legacy-ipc.txt"
PROBE = REPO / "tools" / "probe_legacy_ipc.py"

# Attributes whose value names this run (addresses, ids, a context): compared as zero or not.
VARYING = {"CONTEXT", "DEVICE_POINTER", "BUFFER_ID", "RANGE_START_ADDR", "MAPPING_BASE_ADDR",
           "MEMORY_BLOCK_ID"}  # fmt: skip
FIELDS = ("op", "r", "size", "pitch", "bytes", "dead")

# (section, worker, op): (recorded, what the simulator may answer instead), and why.
DEVIATIONS = {
    # The creator's record ran on an idle stream: in the simulator its marker has
    # usually run by the time the importer asks (it may not have: a race, either answer
    # is right); on the H200 the importer's query right after it still saw it pending.
    ("rules: cuMemAlloc, ranges, attributes, IPC handles", "B", "event_query"): (
        "CUDA_ERROR_NOT_READY",
        "CUDA_SUCCESS",
    ),
}

pytestmark = pytest.mark.skipif(not is_simulated(), reason="compares the simulator with the record")


def _normal(line: str) -> tuple[str, Any]:
    """What of one probe line is the driver's rule, not this run's numbers."""
    who, _, rest = line.partition(" ")
    if who in ("A", "B"):
        out = json.loads(rest)
        kept: dict[str, Any] = {k: out[k] for k in FIELDS if k in out}
        if "handle" in out:
            kept["handle_zero"] = set(out["handle"]) == {"0"}
        if "attrs" in out:
            kept["attrs"] = {
                k: (v != 0 if k in VARYING and isinstance(v, int) else v)
                for k, v in out["attrs"].items()
            }
        return who, kept
    if who == "native":
        out = json.loads(rest)
        pids: list[str] = []
        for k in out:  # the pids, as first named: each becomes its place
            pids += [p for p in re.findall(r"\[(\d+)\]", k) if p not in pids]
        return who, {
            re.sub(r"\[(\d+)\]", lambda m: f"[{pids.index(m.group(1))}]", k): v
            for k, v in out.items()
            if not k.endswith("_s")
        }
    return "text", line


def _run_probe(lines: int, timeout_s: float) -> list[str]:
    """The probe's first ``lines`` lines on the simulator; then it is stopped, with
    its workers (one session)."""
    env = sim_env()
    env["CUINTERPOSE_SIM_NAMESPACE"] = f"fidelity-ipc-{os.getpid()}"
    probe = subprocess.Popen(
        [sys.executable, str(PROBE)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert probe.stdout is not None
    got: list[str] = []
    sel = selectors.DefaultSelector()
    sel.register(probe.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < lines and time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = probe.stdout.readline()
            if not line:
                break
            got.append(line.rstrip("\n"))
    finally:
        os.killpg(probe.pid, signal.SIGKILL)
        probe.wait()
        Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{env['CUINTERPOSE_SIM_NAMESPACE']}").unlink(
            missing_ok=True
        )
    assert len(got) == lines, f"the probe stopped after {len(got)} of {lines} lines:\n" + (
        "\n".join(got[-5:]) + "\n" + (probe.stderr.read() if probe.stderr else "")[-2000:]
    )
    return got


@pytest.mark.slow
def test_legacy_ipc_probe_matches_the_real_driver() -> None:
    recorded = RECORD.read_text().splitlines()
    simulated = _run_probe(len(recorded), timeout_s=240)
    section, differing = "", []
    for n, (real, sim) in enumerate(zip(recorded, simulated, strict=True), start=1):
        if real.startswith("== "):
            section = real[3:]
        (who, want), (_, have) = _normal(real), _normal(sim)
        if who == "text" and real.startswith("driver "):
            continue  # the version query's tuple, not a rule
        if want == have:
            continue
        key = (section, who, want.get("op") if isinstance(want, dict) else None)
        if key in DEVIATIONS and DEVIATIONS[key] == (want.get("r"), have.get("r")):
            continue
        differing.append(f"  line {n} [{section}]\n    real {want}\n    sim  {have}")
    assert not differing, "simulator differs from the H200:\n" + "\n".join(differing)
