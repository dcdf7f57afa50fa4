"""README.md's "Using it" example, run as written: its ``app.py`` and its shell session.

Both blocks are taken from the README by their markers; the session runs under
``bash -e`` in a fresh directory, with the ``cuinterpose`` and ``python`` of
``bin_dir`` first on PATH. What each step printed is checked by the callers
(tests/shim/test_using_it.py on the checkout's build, tests/packaging on the
installed wheel).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

REPO = Path(__file__).resolve().parent.parent


def blocks(readme: Path = REPO / "README.md") -> tuple[str, str]:
    text = readme.read_text()
    app = re.search(r"<!-- using-it app -->\s*```python\n(.*?)```", text, re.S)
    session = re.search(r"<!-- using-it session -->\s*```sh\n(.*?)```", text, re.S)
    assert app and session, "README.md's Using it section lost its example blocks"
    return app[1], session[1]


@attrs.frozen
class Ran:
    done: subprocess.CompletedProcess[str]
    app_log: str

    def summaries(self) -> list[dict[str, Any]]:
        out = []
        for line in self.done.stdout.splitlines():
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == "summary":
                    out.append(event)
        return out


def run(workdir: Path, bin_dir: Path, base_env: Mapping[str, str], timeout: float = 300) -> Ran:
    """Run the session in ``workdir``; the simulated driver's accounting gets a namespace
    of its own, removed afterwards."""
    app, session = blocks()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "app.py").write_text(app)
    namespace = f"readme-{uuid.uuid4().hex[:12]}"
    env = dict(base_env)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["CUINTERPOSE_SIM_NAMESPACE"] = namespace
    try:
        done = subprocess.run(
            # A failed step must not leave the program running (nor holding the pipes).
            ["bash", "-e", "-c", f"trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{session}"],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    finally:
        Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{namespace}").unlink(missing_ok=True)
    log = workdir / "app.log"
    return Ran(done, log.read_text() if log.exists() else "")


def check(ran: Ran) -> None:
    """What the README says each step does."""
    done = ran.done
    story = f"--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}"
    assert done.returncode == 0, story
    assert "suspend can work here" in done.stdout, story
    assert "bytes intact" in ran.app_log, story
    assert re.search(r"cuinterpose launch: pid \d+ runs python app.py", done.stderr), story
    assert "cuinterpose launch: on the simulated driver: no NVIDIA driver here" in done.stderr
    assert "--driver" not in blocks()[1], "README's session names a driver"
    suspended, resumed = ran.summaries()
    assert (suspended["outcome"], suspended["exit_code"]) == ("suspended", 0), suspended
    # The printed resume carries what a plain shell lacks: the control directory.
    assert suspended["next"].startswith("cuinterpose resume --checkpoint-dir ckpt --control-dir /"), suspended  # noqa: E501
    assert (resumed["outcome"], resumed["exit_code"]) == ("resumed", 0), resumed
    # status before, during and after: RUNNING/ACTIVE, CHECKPOINTED/PREPARED
    assert "CHECKPOINTED" in done.stdout and "PREPARED" in done.stdout, story
    assert "Traceback" not in done.stderr, story
