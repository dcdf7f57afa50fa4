"""The simulated driver answers the rule probe as the real H200 did.

``tools/probe_driver_rules.py`` ran on a real H200 (driver 580.159.04); its
answers are kept in ``specs/records/``. The same probe runs here against the
simulated driver and every case must give the same CUresult, except the few
deviations listed below, each with its reason (shim_c/sim/README.md has them
too). A new case in the record that the simulator answers differently fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.simenv import is_simulated, sim_env

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "specs" / "records" / "2026-11-29-h200-driver-rules.jsonl"
PROBE = REPO / "tools" / "probe_driver_rules.py"

# Values that name the machine or depend on its memory, not rules.
INFORMATIONAL = {"device_name", "create_handle_value", "checkpoint_s", "props_from_handle"}

# Where the simulator knowingly differs, and why.
DEVIATIONS = {
    # The real driver dereferences an unknown handle and the process dies of
    # SIGSEGV; the simulator answers CUDA_ERROR_INVALID_VALUE so that a test
    # sees which call was wrong. The shim never passes an unknown handle on.
    "bogus_handle_props_process": "real driver crashes on an unknown handle",
    "bogus_handle_release_process": "real driver crashes on an unknown handle",
    # Memory kept alive only by an open exported FD counts as free in the
    # simulator's per-process accounting (cuMemGetInfo is approximate).
    "mem_info_free_bytes": "memory held only by an exported FD shows as free",
}

pytestmark = pytest.mark.skipif(not is_simulated(), reason="compares the simulator with the record")


def _outcome(result: Any) -> Any:
    """The CUresult of a case: a success's value is not part of the rule."""
    if isinstance(result, list) and result and result[0] == "CUDA_SUCCESS":
        return "CUDA_SUCCESS" if len(result) == 2 and not isinstance(result[1], str) else result
    return result


def _cases(lines: str) -> dict[str, Any]:
    return {d["case"]: d["result"] for d in map(json.loads, lines.splitlines()) if d}


def test_probe_answers_match_the_real_driver() -> None:
    recorded = _cases(RECORD.read_text())
    env = sim_env()
    env["CUINTERPOSE_SIM_NAMESPACE"] = f"fidelity-{os.getpid()}"
    probe = subprocess.run(
        [sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    simulated = _cases(probe.stdout)

    missing = sorted(set(recorded) - set(simulated))
    assert not missing, f"the probe did not reach these cases on the simulator: {missing}"
    differing = {
        case: (recorded[case], simulated[case])
        for case in recorded
        if case not in INFORMATIONAL
        and case not in DEVIATIONS
        and _outcome(recorded[case]) != _outcome(simulated[case])
    }
    assert not differing, "simulator differs from the H200:\n" + "\n".join(
        f"  {case}: real {real!r}, simulated {sim!r}" for case, (real, sim) in differing.items()
    )
    # A listed deviation that no longer deviates should leave the list.
    converged = [c for c in DEVIATIONS if _outcome(recorded[c]) == _outcome(simulated[c])]
    assert not converged, f"no longer deviating, remove from DEVIATIONS: {converged}"
