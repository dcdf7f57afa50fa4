"""PyTorch jobs with the default CUDA allocator (cudaMalloc, shared by legacy CUDA IPC),
for tests/gpu/test_owned_torch.py: run under the shim, suspended and resumed by the
test. Never run by the suite without a GPU: it needs torch.

- ``pair``: a producer shares tensors with a consumer through ``torch.multiprocessing``
  (spawn): patterned tensors (large and small), a one-element ``counter`` and an ``ack``
  the consumer writes, plus private tensors in each. With ``run`` the producer adds 1
  to ``counter`` and the consumer reads it (it must never go down), both without pause,
  until ``stop``: no update may be lost (the producer's count equals the counter), and
  the consumer's last write to ``ack`` is what the producer reads.
- ``single``: one process multiplies matrices, and captures a CUDA graph of a matmul
  chain whose replay must give the same result after a resume.

Protocol, one JSON object a line: the job prints ``{"ready": true, "pids": [...]}``;
then ``check`` -> ``{"ok": bool, "bad": [...]}``, ``run`` / ``status`` / ``stop`` (pair)
-> ``{"running": bool, "count": n, ...}``, ``share`` (pair: a new tensor shared and
checked by the consumer) -> ``{"ok": bool}``, ``where`` -> the GPU each process's
context is on now, as the driver says (``cuDeviceGetUuid`` of ``cuCtxGetDevice``) and
as torch says, ``matmul`` (pair) -> ``{"ok": bool}`` (a product equal to the one made
at start), ``quit``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

PIECE = 64 << 20
SMALL = 300 << 10  # a tensor of the caching allocator's small pool


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _pattern(torch: Any, n: int, seed: int) -> Any:
    base = torch.arange(n, dtype=torch.int64, device="cuda")
    return ((base * 2654435761 + seed * 40503) & 0x7FFFFFFF).to(torch.int32)


def _bad(torch: Any, tensors: list[tuple[int, Any]]) -> list[int]:
    return [s for s, t in tensors if not torch.equal(t, _pattern(torch, t.numel(), s))]


def _make(torch: Any, seeds: range, size: int) -> list[tuple[int, Any]]:
    return [(s, _pattern(torch, size // 4, s)) for s in seeds]


def _where(torch: Any) -> dict[str, str]:
    """The GPU of the current context: the driver's UUID (what a remap changes) and
    torch's (its device properties, which torch may have cached at start)."""
    from cuda.bindings import driver as cu

    torch.cuda.synchronize()
    err, dev = cu.cuCtxGetDevice()
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, raw = cu.cuDeviceGetUuid(dev)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    h = bytes(raw.bytes).hex()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "driver": f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}",
        "torch": str(getattr(props, "uuid", "")),
        "ordinal": str(int(dev)),
    }


# --------------------------------------------------------------------------- pair
def _consume(inbox: Any, outbox: Any) -> None:
    import torch

    shared, counter, ack = inbox.get()
    own = _make(torch, range(500, 503), PIECE) + _make(torch, range(510, 520), SMALL)
    state = {"running": False, "reads": 0, "last": -1, "errors": []}
    stop = threading.Event()

    def watch() -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                snap = counter.clone()
                torch.cuda.current_stream().synchronize()
                now = int(snap[0])
                if now < state["last"]:
                    state["errors"].append(f"counter went back {state['last']} -> {now}")
                state["last"] = now
                state["reads"] += 1

    thread: threading.Thread | None = None
    outbox.put({"pid": os.getpid()})
    while True:
        command = inbox.get()
        if command == "check":
            outbox.put(_bad(torch, shared) + _bad(torch, own))
        elif command == "run":
            stop.clear()
            thread = threading.Thread(target=watch, daemon=True)
            thread.start()
            outbox.put({"running": True})
        elif command == "where":
            outbox.put(_where(torch))
        elif command == "stop":
            stop.set()
            if thread is not None:
                thread.join()
            ack.fill_(int(state["reads"]))
            torch.cuda.synchronize()
            outbox.put({k: state[k] for k in ("reads", "last", "errors")})
        elif isinstance(command, tuple):  # a new share
            seed, tensor = command
            outbox.put(_bad(torch, [(seed, tensor)]))
        else:
            return


def pair() -> None:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    shared = _make(torch, range(100, 104), PIECE) + _make(torch, range(110, 118), SMALL)
    private = _make(torch, range(200, 203), PIECE)
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    ack = torch.zeros(1, dtype=torch.int64, device="cuda")
    torch.manual_seed(1)
    left = torch.randn(1024, 1024, device="cuda")
    right = torch.randn(1024, 1024, device="cuda")
    product = left @ right
    torch.cuda.synchronize()
    consumer = ctx.Process(target=_consume, args=(inbox, outbox), daemon=True)
    consumer.start()
    inbox.put((shared, counter, ack))
    hello = outbox.get(timeout=300)
    count = 0
    stop = threading.Event()
    worker: threading.Thread | None = None

    def bump() -> None:
        nonlocal count
        while not stop.is_set():
            counter.add_(1)
            torch.cuda.synchronize()
            count += 1

    _say(ready=True, pids=[os.getpid(), int(hello["pid"])])
    for line in sys.stdin:
        command = line.strip()
        if command == "check":
            inbox.put("check")
            theirs = outbox.get(timeout=300)
            bad = _bad(torch, shared) + _bad(torch, private) + theirs
            _say(ok=not bad, bad=bad)
        elif command == "run":
            inbox.put("run")
            outbox.get(timeout=300)
            stop.clear()
            worker = threading.Thread(target=bump, daemon=True)
            worker.start()
            _say(running=True)
        elif command == "stop":
            stop.set()
            if worker is not None:
                worker.join()
            inbox.put("stop")
            seen = outbox.get(timeout=300)
            _say(
                running=False, count=count, counter=int(counter[0]), ack=int(ack[0]), consumer=seen
            )
        elif command == "status":
            _say(running=worker is not None and not stop.is_set(), count=count)
        elif command == "where":
            inbox.put("where")
            _say(producer=_where(torch), consumer=outbox.get(timeout=300))
        elif command == "matmul":
            _say(ok=bool(torch.equal(left @ right, product)))
        elif command == "share":
            seed = 900 + count
            fresh = _pattern(torch, PIECE // 4, seed)
            torch.cuda.synchronize()
            inbox.put((seed, fresh))
            _say(ok=not outbox.get(timeout=300))
        elif command == "quit":
            break
    inbox.put("quit")
    consumer.join(timeout=60)


# --------------------------------------------------------------------------- single
def single() -> None:
    import torch

    torch.manual_seed(0)
    a = torch.randn(2048, 2048, device="cuda")
    b = torch.randn(2048, 2048, device="cuda")
    kept = _make(torch, range(300, 304), PIECE) + _make(torch, range(310, 330), SMALL)
    static_in = torch.randn(1024, 1024, device="cuda")
    weights = [torch.randn(1024, 1024, device="cuda") / 32 for _ in range(4)]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up on a side stream, as torch wants before capture
            x = static_in
            for w in weights:
                x = torch.relu(x @ w)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        x = static_in
        for w in weights:
            x = torch.relu(x @ w)
        static_out = x
    graph.replay()
    torch.cuda.synchronize()
    reference = static_out.clone()
    product = a @ b

    def check() -> list[str]:
        bad = [f"tensor {s}" for s in _bad(torch, kept)]
        if not torch.equal(a @ b, product):
            bad.append("matmul")
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(static_out, reference):
            bad.append("graph replay")
        c = torch.randn(512, 512, device="cuda")
        if not torch.allclose(c @ torch.eye(512, device="cuda"), c):
            bad.append("fresh matmul")
        return bad

    _say(ready=True, pids=[os.getpid()])
    for line in sys.stdin:
        command = line.strip()
        if command == "check":
            bad = check()
            _say(ok=not bad, bad=bad)
        elif command == "where":
            _say(producer=_where(torch))
        elif command == "quit":
            break


if __name__ == "__main__":
    {"pair": pair, "single": single}[sys.argv[1]]()
