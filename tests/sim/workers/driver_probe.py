"""Asks the libcuda.so.1 that the library path finds one question and prints the answer.

    python driver_probe.py count DEVICE   the device count, then cuDeviceGet(DEVICE)'s result
    python driver_probe.py marker         the simulator's marker function's answer
    python driver_probe.py which          absent, sim or real: what libcuda.so.1 loads
    python driver_probe.py before-init    cuDeviceGetCount's result without cuInit

Used by tests/sim/test_resolver.py, which reads the output.
"""

from __future__ import annotations

import ctypes
import sys

from cuda.bindings import driver as cu  # type: ignore[import-untyped]


def count(device: int) -> None:
    cu.cuInit(0)
    print(cu.cuDeviceGetCount()[1])
    print(cu.cuDeviceGet(device)[0].name)


def marker() -> None:
    lib = ctypes.CDLL("libcuda.so.1")
    print(lib.cuinterposeSimIsSimulated())


def which() -> None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        print("absent")
    else:
        print("sim" if hasattr(lib, "cuinterposeSimIsSimulated") else "real")


def before_init() -> None:
    print(cu.cuDeviceGetCount()[0].name)


def main(argv: list[str]) -> int:
    question, *rest = argv
    if question == "count":
        count(int(rest[0]))
    elif question == "marker":
        marker()
    elif question == "which":
        which()
    elif question == "before-init":
        before_init()
    else:
        print(f"driver_probe: unknown question {question!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
