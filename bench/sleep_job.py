"""Issue 47's torch process, put to sleep and woken by ``bench/sleep_wake.py``.

Never run by the suite: it needs torch and a GPU. Expandable segments are on
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, set by the caller), so every byte
torch holds is a VMM allocation the shim tracks.

- ``single --gib N``: N GiB of int32 tensors of 256 MiB, each filled with a pattern of
  its seed (every tensor kept: reserved = held, the 49 GiB process of
  docs/benchmarks.md at ``--gib 49``).
- ``ceiling --gib N``: no job: the pinned DtoH and HtoD copy ceilings of one N GiB
  buffer, measured with CUDA events (5 copies each way after a warm-up), printed as one
  JSON line, then it exits.

Protocol on stdin/stdout, one JSON object a line: ``{"ready": ..., "pids": [...],
"tensor_bytes": ...}`` once set up; then

- ``check``: ``{"ok": bool, "bad": [seeds]}``, every tensor against its pattern;
- ``rewrite GIB``: the next GIB of tensors (in turn, cycling) get new seeds and are
  filled again: ``{"rewritten_bytes": n}``;
- ``sleep`` / ``wake``: what vLLM's sleep mode (level 1) does, by hand: ``sleep`` copies
  every tensor into pinned CPU memory allocated for it (``pin_memory=True``, as vLLM's
  CuMemAllocator does at each sleep) and gives the GPU memory back
  (``untyped_storage().resize_(0)``, ``torch.cuda.empty_cache()``); ``wake`` takes GPU
  memory again, copies every tensor back and drops the CPU copies. Each answers
  ``{"seconds": s, "bytes": n}`` (the GPU synchronized before the clock stops);
- ``quit``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

PIECE = 256 << 20  # bytes per tensor


def _pattern(torch: Any, n: int, seed: int) -> Any:
    base = torch.arange(n, dtype=torch.int64, device="cuda")
    return ((base * 2654435761 + seed * 40503) & 0x7FFFFFFF).to(torch.int32)


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


class Single:
    def __init__(self, torch: Any, gib: float) -> None:
        self.torch = torch
        count = max(1, int(gib * (1 << 30)) // PIECE)
        self.seeds = [1000 + k for k in range(count)]
        self.tensors = [_pattern(torch, PIECE // 4, s) for s in self.seeds]
        self.next = 0
        self.cpu: list[Any] = []
        torch.cuda.synchronize()

    def bad(self) -> list[int]:
        t = self.torch
        return [s for s, x in zip(self.seeds, self.tensors, strict=True)
                if not t.equal(x, _pattern(t, x.numel(), s))]  # fmt: skip

    def rewrite(self, gib: float) -> int:
        n = max(1, int(gib * (1 << 30)) // PIECE)
        for _ in range(min(n, len(self.tensors))):
            k = self.next
            self.seeds[k] += 7919
            self.tensors[k].copy_(_pattern(self.torch, PIECE // 4, self.seeds[k]))
            self.next = (k + 1) % len(self.tensors)
        self.torch.cuda.synchronize()
        return min(n, len(self.tensors)) * PIECE

    def sleep(self) -> float:
        t = self.torch
        start = time.perf_counter()
        self.cpu = []
        for x in self.tensors:
            host = t.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
            host.copy_(x, non_blocking=True)
            self.cpu.append(host)
        t.cuda.synchronize()
        for x in self.tensors:
            x.untyped_storage().resize_(0)
        t.cuda.empty_cache()
        t.cuda.synchronize()
        return time.perf_counter() - start

    def wake(self) -> float:
        t = self.torch
        start = time.perf_counter()
        for x, host in zip(self.tensors, self.cpu, strict=True):
            x.untyped_storage().resize_(host.numel() * host.element_size())
            x.copy_(host, non_blocking=True)
        t.cuda.synchronize()
        self.cpu = []
        return time.perf_counter() - start


def ceiling(gib: float) -> None:
    import torch

    n = int(gib * (1 << 30))
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rates: dict[str, list[float]] = {"dtoh": [], "htod": []}
    for way in ("dtoh", "htod"):
        for i in range(6):
            start.record()
            if way == "dtoh":
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            if i:  # the first warms up
                rates[way].append(n / (start.elapsed_time(end) / 1e3) / 1e9)
    _say(bytes=n, dtoh_gbps=rates["dtoh"], htod_gbps=rates["htod"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("single", "ceiling"))
    parser.add_argument("--gib", type=float, default=1.0)
    args = parser.parse_args()
    if args.kind == "ceiling":
        ceiling(args.gib)
        return
    import torch

    job = Single(torch, args.gib)
    _say(ready=True, pids=[os.getpid()], tensor_bytes=len(job.tensors) * PIECE,
         reserved_bytes=int(torch.cuda.memory_reserved()))  # fmt: skip
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "check":
            bad = job.bad()
            _say(ok=not bad, bad=bad)
        elif words[0] == "rewrite":
            _say(rewritten_bytes=job.rewrite(float(words[1])))
        elif words[0] == "sleep":
            _say(seconds=job.sleep(), bytes=len(job.tensors) * PIECE)
        elif words[0] == "wake":
            _say(seconds=job.wake(), bytes=len(job.tensors) * PIECE)
        elif words[0] == "quit":
            return
        else:
            _say(error=f"unknown command {words[0]!r}")


if __name__ == "__main__":
    main()
