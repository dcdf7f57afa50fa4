"""One rank of ``test_quiesce_nccl.py``: a loop of ``all_reduce`` + check in a thread,
as a training or serving job runs, under the shim (the job is never told to pause).

Commands on stdin, one a line; answers on stdout as JSON lines:
  status       -> {"iters": N, "bad": [...], "errors": [...]}
  stop N       -> the loop ends after iteration N (the same N for every rank: a
                  collective needs all of them), then {"stopped": N, "bad", "errors"}
  quit
The rank answers {"ready": true, "pid": PID} once its loop has run a first iteration.
Iteration k all-reduces a tensor of (rank + k) in every element and checks every
element of the result on the host: the sum over ranks of (r + k).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist


def say(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    n = 1 << 22  # 16 MiB of float32: the P2P path
    state: dict[str, object] = {"iters": 0, "bad": [], "errors": [], "stop_at": None}
    first = threading.Event()
    done = threading.Event()

    def loop() -> None:
        k = 0
        try:
            while state["stop_at"] is None or k < int(state["stop_at"]):  # type: ignore[arg-type]
                k += 1
                x = torch.full((n,), float(rank + k), device=dev)
                dist.all_reduce(x)
                want = float(sum(r + k for r in range(world)))
                if not bool(torch.all(x == want)):  # a host synchronization every time
                    state["bad"].append(k)  # type: ignore[attr-defined]
                state["iters"] = k
                first.set()
        except Exception as exc:  # reported, never hidden
            state["errors"].append(f"iteration {k}: {exc!r}")  # type: ignore[attr-defined]
        finally:
            first.set()
            done.set()

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    first.wait()
    say({"ready": True, "pid": os.getpid(), "iters": state["iters"]})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "status":
            say({"iters": state["iters"], "bad": state["bad"], "errors": state["errors"]})
        elif cmd[0] == "stop":
            state["stop_at"] = int(cmd[1])
            done.wait()
            say({"stopped": state["iters"], "bad": state["bad"], "errors": state["errors"]})
        elif cmd[0] == "quit":
            break
    dist.destroy_process_group()
    say({"bye": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
