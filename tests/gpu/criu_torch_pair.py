"""A torch.multiprocessing producer and consumer sharing a CUDA tensor, as one process
tree that CRIU can dump (bench/criu.py's ``torch`` scenario; a real GPU only).

``python criu_torch_pair.py --token T --mib N``: the root (a plain process: it imports
torch, never touches CUDA) starts a producer and a consumer with the spawn context.
The producer fills an N MiB uint8 tensor and puts it on a queue; the consumer takes it
(CUDA IPC: with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` the memory is a
VMM allocation exported as a POSIX FD, what the shim captures). Both then answer
commands on ``\\0cuip-tree-<token>-producer`` / ``-consumer`` (criu_tree.serve);
``--alone``: the producer only, its tensor shared with nobody (one torch process):

- ``digest`` [``which`` t|t2] -> sha256 of the tensor's bytes
- ``fill`` ``seed``: overwrite the tensor with a seeded pattern (the consumer's write
  must reach the producer)
- ``share`` ``seed`` (producer): a second tensor, filled, put on the second queue;
  ``take`` (consumer): take it (a new share after the restore)
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.shim.workers

import torch
import torch.multiprocessing as mp

from tests.shim.workers.criu_tree import serve

CHUNK = 64 << 20


def fill(t: torch.Tensor, seed: int) -> None:
    gen = torch.Generator(device=t.device).manual_seed(seed)
    flat = t.view(-1)
    for off in range(0, flat.numel(), CHUNK):
        part = flat[off : off + CHUNK]
        part.copy_(
            torch.randint(0, 256, part.shape, dtype=torch.uint8, device=t.device, generator=gen)
        )
    torch.cuda.synchronize()


def digest(t: torch.Tensor) -> str:
    """sha256 of a position-weighted sum of each 64 MiB (as int64 words, wrapping),
    computed on the GPU: any changed or moved word changes it, and 8 GiB take well
    under a second (hashing the bytes on the host took tens of seconds a check)."""
    h = hashlib.sha256()
    flat = t.view(-1)
    weights = torch.arange(1, CHUNK // 8 + 1, dtype=torch.int64, device=t.device)
    for off in range(0, flat.numel(), CHUNK):
        part = flat[off : off + CHUNK]
        if part.numel() % 8:
            h.update(part.cpu().numpy().tobytes())  # a tail of odd length, on the host
            continue
        words = part.view(torch.int64)
        total = (words * (weights[: words.numel()] + off)).sum()
        h.update(int(total.item()).to_bytes(8, "little", signed=True))
    return h.hexdigest()


def producer(token: str, nbytes: int, queue: Any, second: Any, alone: bool = False) -> None:
    torch.cuda.set_device(0)
    held = {"t": torch.empty(nbytes, dtype=torch.uint8, device="cuda")}
    fill(held["t"], 1)
    if not alone:
        queue.put(held["t"])

    def handle(op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "digest":
            return {"digest": digest(held[args.get("which", "t")])}
        if op == "fill":
            fill(held["t"], int(args["seed"]))
            return {}
        if op == "share":
            held["t2"] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            fill(held["t2"], int(args["seed"]))
            second.put(held["t2"])
            return {}
        raise ValueError(f"unknown op {op!r}")

    serve(token, "producer", handle)


def consumer(token: str, queue: Any, second: Any) -> None:
    torch.cuda.set_device(0)
    held = {"t": queue.get(timeout=300)}

    def handle(op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "digest":
            return {"digest": digest(held[args.get("which", "t")])}
        if op == "fill":
            fill(held["t"], int(args["seed"]))
            return {}
        if op == "take":
            held["t2"] = second.get(timeout=300)
            return {}
        raise ValueError(f"unknown op {op!r}")

    serve(token, "consumer", handle)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--token", required=True)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--alone", action="store_true", help="the producer alone, nothing shared")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue, second = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=producer, args=(args.token, args.mib << 20, queue, second, args.alone))
    ]
    if not args.alone:
        procs.append(ctx.Process(target=consumer, args=(args.token, queue, second)))
    for p in procs:
        p.start()
    status = 0
    for p in procs:
        p.join()
        status |= p.exitcode or 0
    return status


if __name__ == "__main__":
    sys.exit(main())
