"""Where the built C libraries are.

The build (``make build``) writes them under ``build/`` at the top of the
repository (``build-asan/`` for the sanitizer build); nothing is compiled at
run time. ``CUINTERPOSE_BUILD_DIR`` points elsewhere, for an installed copy or
for the sanitizer build.
"""

from __future__ import annotations

import os
from pathlib import Path

SHIM_NAME = "libcuinterpose.so"
SIM_DRIVER_NAME = "libcuda.so.1"


class ArtifactMissingError(FileNotFoundError):
    """A built library is not where the build puts it."""


def build_dir() -> Path:
    override = os.environ.get("CUINTERPOSE_BUILD_DIR")
    if override:
        return Path(override).resolve()
    return Path(__file__).resolve().parent.parent / "build"


def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ArtifactMissingError(
            f"{what} not found at {path}: run `make build` (or set CUINTERPOSE_BUILD_DIR)"
        )
    return path


def shim_library() -> Path:
    """Path of the built ``libcuinterpose.so``."""
    return _require(build_dir() / "shim_c" / SHIM_NAME, "the shim")


def sim_library_dir() -> Path:
    """Directory holding the simulated ``libcuda.so.1``, for the library path."""
    lib = _require(build_dir() / "shim_c" / "sim" / SIM_DRIVER_NAME, "the simulated driver")
    return lib.parent
