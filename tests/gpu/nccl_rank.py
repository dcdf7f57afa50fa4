"""One rank of the two-rank NCCL job of ``test_nccl_two_ranks.py`` (run under the shim).

Commands on stdin, one a line; answers on stdout as JSON lines:
  check  -> all-reduce, broadcast and all-gather give the right values, and the tensor
            kept since the start still holds its bytes: {"ok": bool, ...}
  quit
The rank answers {"ready": true, "pid": PID} once its NCCL communicator has run
collectives (its P2P connections exist).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys

import torch
import torch.distributed as dist


def say(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def collectives(rank: int, world: int, dev: torch.device, n: int) -> dict[str, object]:
    x = torch.full((n,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    want = float(sum(range(1, world + 1)))
    b = torch.arange(n, device=dev, dtype=torch.float32) * (rank + 1)
    dist.broadcast(b, src=0)
    parts = [torch.empty(n, device=dev) for _ in range(world)]
    dist.all_gather(parts, torch.full((n,), float(rank), device=dev))
    torch.cuda.synchronize(dev)
    ok = (
        bool(torch.all(x == want))
        and bool(torch.equal(b, torch.arange(n, device=dev, dtype=torch.float32)))
        and all(bool(torch.all(p == float(r))) for r, p in enumerate(parts))
    )
    return {"ok": ok, "sum": float(x[0]), "want": want}


def main() -> int:
    # SIGUSR1: every thread's Python stack on stderr (the test asks when a rank hangs).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    n = 1 << 22  # 16 MiB of float32: large enough for the P2P path
    kept = torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(rank))
    kept_sum = float(kept.double().sum())
    first = collectives(rank, world, dev, n)
    say({"ready": True, "pid": os.getpid(), **first})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "check":
            # Progress on stderr, so that a hang says where it is.
            print("check: local", file=sys.stderr, flush=True)
            local = float(torch.ones(1024, device=dev).sum())
            torch.cuda.synchronize(dev)
            print(f"check: local ok ({local}); collectives", file=sys.stderr, flush=True)
            out = collectives(rank, world, dev, n)
            print("check: collectives returned", file=sys.stderr, flush=True)
            intact = float(kept.double().sum()) == kept_sum
            say({**out, "ok": bool(out["ok"]) and intact, "kept_intact": intact})
        elif cmd == "quit":
            break
    dist.destroy_process_group()
    say({"bye": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
