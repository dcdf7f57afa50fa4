"""The edges a new user met (issue 49) that need no shim, through the installed
``cuinterpose`` command: what ``criu check`` tells a user of the package to install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_criu import fake_criu

BIN = Path(sys.executable).parent


def test_criu_check_names_what_to_install_and_links_the_spec(tmp_path: Path) -> None:
    """No criu anywhere, or one older than 4.0: CRIU 4.0 or later from the distribution
    or built from its source, the spec's address; nothing of the checkout's tools/."""
    bare = tmp_path / "bin"
    bare.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CUINTERPOSE_CRIU"}
    env["PATH"] = str(bare)  # no criu here, and none in the sbin directories either
    if any(Path(d, "criu").exists() for d in ("/usr/local/sbin", "/usr/sbin", "/sbin")):
        env["CUINTERPOSE_CRIU"] = str(fake_criu(tmp_path / "old", version="3.17"))
    runs = [
        subprocess.run([str(BIN / "cuinterpose"), "criu", "check"], env=env,
                       capture_output=True, text=True, timeout=60, check=False),
        subprocess.run([str(BIN / "cuinterpose"), "criu", "check", "--criu",
                        str(fake_criu(tmp_path / "older", version="3.17"))], env=env,
                       capture_output=True, text=True, timeout=60, check=False),
    ]  # fmt: skip
    for run in runs:
        assert run.returncode == 1, run.stderr
        said = run.stderr
        assert "install CRIU 4.0 or later, from the distribution" in said, said
        assert "built from its source (https://criu.org/Installation)" in said
        assert "specs/criu.md#criu-on-a-machine" in said and "https://" in said
        assert "tools/" not in said and "build_criu" not in said, said
    assert "no criu on PATH" in runs[0].stderr or "at least 4.0" in runs[0].stderr
    assert "CRIU 3.17: at least 4.0 is needed" in runs[1].stderr
