"""README.md's "Using it" session on the checkout's release build (``build/``): the
program of one's own launched under the shim, listed, suspended and resumed, with
nothing on the library path (the CLI loads the driver the shim reports)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests import readme_session, simenv

pytestmark = pytest.mark.slow


def test_the_readme_session_runs(stack: None, tmp_path: Path) -> None:
    build = simenv.REPO / "build"
    if not (build / "shim_c" / "libcuinterpose.so").is_file():
        pytest.skip("build/ has no shim: run `make build`")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "ASAN_", "UBSAN_"))}
    env.pop("SNAPSHOT_CONTROL_DIR", None)
    env["CUINTERPOSE_BUILD_DIR"] = str(build)  # the release build: no sanitizer runtime
    ran = readme_session.run(tmp_path / "session", Path(sys.executable).parent, env)
    readme_session.check(ran)
