"""The kept host copy's chunk hash (shim_c/keephash.h) in Python: a third, independent
reading of the definition, against which the known-answer vectors (vectors.json) are
checked, as are the simulated driver's C twin and the GPU kernel's PTX (run.py).

Also: the PTX the shim carries, read back from shim_c/keep_hash_ptx.h."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parents[2]
PTX_HEADER: Final = REPO / "shim_c" / "keep_hash_ptx.h"
VECTORS: Final = Path(__file__).with_name("vectors.json")
THREADS: Final = 256
CHUNK_WORDS: Final = (2 << 20) // 8
M64: Final = (1 << 64) - 1


def mix_a(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def mix_b(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


def chunk_hash(words: list[int]) -> tuple[int, int]:
    """One chunk's two words: lane t folds words t, t + 256, ...; the lanes XORed."""
    ha = hb = 0
    for t in range(THREADS):
        a = 0x243F6A8885A308D3 ^ t
        b = 0x13198A2E03707344 ^ (t << 32)
        for w in words[t::THREADS]:
            a = mix_a(a ^ w)
            b = mix_b((b + w) & M64)
        k = t + 1
        ha ^= mix_a((a + k * 0x9E3779B97F4A7C15) & M64)
        hb ^= mix_b(b ^ ((k * 0xC2B2AE3D27D4EB4F) & M64))
    return ha, hb


def data(seed: int, words: int, pattern: str = "random") -> bytes:
    """A vector's input: `words` little-endian 64-bit words, random (from `seed`), all
    zero, or float32 0, 1, 2, ... (what a model's tensors hold more often than noise)."""
    if pattern == "zeros":
        return bytes(8 * words)
    if pattern == "ramp":
        import struct

        return struct.pack(f"<{2 * words}f", *range(2 * words))
    return random.Random(seed).randbytes(8 * words)


def vector_data(v: dict[str, object]) -> bytes:
    return data(int(v["seed"]), int(v["words"]), str(v.get("pattern", "random")))  # type: ignore[call-overload]


def hashes(raw: bytes) -> list[tuple[int, int]]:
    """Every chunk's hash of `raw` (a whole number of words)."""
    words = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
    return [chunk_hash(words[c : c + CHUNK_WORDS]) for c in range(0, len(words), CHUNK_WORDS)]


def vectors() -> list[dict[str, object]]:
    """[{"seed", "words", "hashes": [[hex a, hex b], ...]}]"""
    loaded = json.loads(VECTORS.read_text())
    assert isinstance(loaded, list)
    return loaded


def ptx() -> str:
    """The PTX text keep_hash_ptx.h holds, as the shim hands it to cuModuleLoadData."""
    text = PTX_HEADER.read_text()
    body = "".join(re.findall(r'^    "(.*)"$', text, flags=re.M))
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m[1]], body)
