"""Programs whose core no one here wrote (torch's AdamW, transformers' generate, numba's
and CuPy's CUDA IPC), kept running while tests/gpu/test_running_programs.py suspends
and resumes them from outside.

    python running_programs.py train|generate|jax|numba|cupy

One JSON object a line on stdout. Commands come on stdin, read by a thread of their own
so that the program's loop never waits for the test: ``status`` is answered at once
from that thread (it makes no CUDA call, so it answers while the process is suspended);
every other command is queued and carried out by the main thread between two units of
its work, where the CUDA calls belong. ``finish`` ends the loop and prints the verdict.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

Handler = Callable[[str], dict[str, Any]]


class Control:
    def __init__(self) -> None:
        self.count = 0
        self.finish = threading.Event()
        self._todo: queue.Queue[str] = queue.Queue()
        self._lock = threading.Lock()

    def say(self, obj: dict[str, Any]) -> None:
        with self._lock:
            print(json.dumps(obj), flush=True)

    def serve(self) -> None:
        def read() -> None:
            for line in sys.stdin:
                command = line.strip()
                if command == "status":
                    self.say({"count": self.count})
                elif command == "finish":
                    self.finish.set()
                elif command:
                    self._todo.put(command)
            self.finish.set()

        threading.Thread(target=read, daemon=True).start()

    def poll(self, handlers: dict[str, Handler], block: bool = False) -> None:
        """Carry out the queued commands (in the main thread)."""
        while True:
            try:
                command = self._todo.get(timeout=0.05) if block else self._todo.get_nowait()
            except queue.Empty:
                return
            name, _, arg = command.partition(" ")
            handler = handlers.get(name)
            self.say(handler(arg) if handler else {"error": f"unknown command {command!r}"})


# ------------------------------------------------------------------- torch training
STEP_CAP = 50_000  # a loop the test forgot stops here rather than running for ever


def train(ctl: Control) -> None:
    import torch

    torch.use_deterministic_algorithms(True)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
        ).cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
        # The batch is made on the GPU from the step's own seed: a step recomputed from
        # scratch sees the same data whatever happened in between.
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        x = torch.randn(256, 512, device="cuda", generator=g)
        y = torch.randn(256, 512, device="cuda", generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.item())

    model, opt = fresh()
    ctl.say({"ready": True, "pids": [os.getpid()]})
    loss = 0.0
    while not ctl.finish.is_set() and ctl.count < STEP_CAP:
        loss = step(model, opt, ctl.count)
        ctl.count += 1
    steps = ctl.count
    trained = [p.detach().cpu().clone() for p in model.parameters()]
    model, opt = fresh()
    for i in range(steps):
        step(model, opt, i)
    again = [p.detach().cpu() for p in model.parameters()]
    identical = all(torch.equal(a, b) for a, b in zip(trained, again, strict=True))
    ctl.say({"steps": steps, "identical": identical, "last_loss": loss})


# ---------------------------------------------------------- transformers generation
def generate(ctl: Control) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=128
    )
    model = transformers.GPT2LMHeadModel(config).cuda().eval()
    prompt = torch.arange(1, 9, device="cuda").unsqueeze(0)
    mask = torch.ones_like(prompt)

    def once() -> list[int]:
        with torch.no_grad():
            out = model.generate(
                prompt, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0
            )
        return [int(t) for t in out[0].tolist()]

    first = once()
    ctl.say({"ready": True, "pids": [os.getpid()]})
    mismatches = 0
    while not ctl.finish.is_set() and ctl.count < STEP_CAP:
        mismatches += once() != first
        ctl.count += 1
    ctl.say({"generations": ctl.count, "mismatches": mismatches, "tokens": first[8:]})


# ------------------------------------------------------------------ a JAX loop
def jax_loop(ctl: Control) -> None:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (1024, 1024))
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    first = float(f(a))
    ctl.say({"ready": True, "pids": [os.getpid()]})
    mismatches = 0
    while not ctl.finish.is_set() and ctl.count < STEP_CAP:
        mismatches += float(f(a)) != first
        ctl.count += 1
    ctl.say({"iterations": ctl.count, "mismatches": mismatches, "value": first})


# ------------------------------------------------------- numba and CuPy legacy IPC
SHARED_BYTES = {"numba": 4 << 20, "cupy": 4096}


def _child_numba(handle: Any, conn: Any, size: int) -> None:
    import numpy as np
    from numba import cuda

    with handle as view:
        conn.send({"ready": True})
        while True:
            what, value = conn.recv()
            if what == "check":
                conn.send(bool((view.copy_to_host() == value).all()))
            elif what == "write":
                view.copy_to_device(np.full(size, value, dtype=np.uint8))
                cuda.synchronize()
                conn.send(True)
            else:
                return


def _child_cupy(handle: bytes, conn: Any, size: int) -> None:
    import cupy as cp

    ptr = cp.cuda.runtime.ipcOpenMemHandle(handle)
    memory = cp.cuda.UnownedMemory(ptr, size, owner=None)
    view = cp.ndarray((size,), cp.uint8, cp.cuda.MemoryPointer(memory, 0))
    conn.send({"ready": True})
    while True:
        what, value = conn.recv()
        if what == "check":
            conn.send(bool((view == value).all()))
        elif what == "write":
            view.fill(value)
            cp.cuda.runtime.deviceSynchronize()
            conn.send(True)
        else:
            cp.cuda.runtime.ipcCloseMemHandle(ptr)
            return


def shared(ctl: Control, library: str) -> None:
    """The parent fills memory with 7, shares it with a child by CUDA IPC, and from then
    on: ``check V`` asks both whether every byte is V, ``write V`` has the child write V
    and the parent check that it sees it."""
    import multiprocessing as mp

    size = SHARED_BYTES[library]
    if library == "numba":
        import numpy as np
        from numba import cuda

        device = cuda.to_device(np.full(size, 7, dtype=np.uint8))
        handle: Any = device.get_ipc_handle()

        def host() -> Any:
            return device.copy_to_host()

        target: Callable[..., None] = _child_numba
    else:
        import cupy as cp

        device = cp.full((size,), 7, dtype=cp.uint8)
        handle = cp.cuda.runtime.ipcGetMemHandle(device.data.ptr)

        def host() -> Any:
            return cp.asnumpy(device)

        target = _child_cupy

    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    child = spawn.Process(target=target, args=(handle, theirs, size))
    child.start()
    assert ours.recv() == {"ready": True}

    def check(arg: str) -> dict[str, Any]:
        value = int(arg)
        ours.send(("check", value))
        return {"parent": bool((host() == value).all()), "child": bool(ours.recv())}

    def write(arg: str) -> dict[str, Any]:
        ours.send(("write", int(arg)))
        wrote = bool(ours.recv())
        return {"child_wrote": wrote, "parent_sees": bool((host() == int(arg)).all())}

    ctl.say({"ready": True, "pids": [os.getpid(), child.pid]})
    while not ctl.finish.is_set():
        ctl.poll({"check": check, "write": write}, block=True)
    ours.send(("quit", 0))
    child.join(60)
    ctl.say({"child_exit": child.exitcode})


def main() -> None:
    kind = sys.argv[1]
    ctl = Control()
    ctl.serve()
    if kind == "train":
        train(ctl)
    elif kind == "generate":
        generate(ctl)
    elif kind == "jax":
        jax_loop(ctl)
    elif kind in SHARED_BYTES:
        shared(ctl, kind)
    else:
        raise SystemExit(f"unknown program {kind!r}")


if __name__ == "__main__":
    main()
