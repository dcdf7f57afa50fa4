"""The torch jobs of issue 19, as processes that a benchmark suspends and resumes.

Run by ``bench/torch_staging.py`` (with or without the shim preloaded), never by hand
in the suite: it needs torch and a GPU. Expandable segments are on
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, set by the caller), so every
byte torch holds is a VMM allocation.

- ``single --gib N``: one process allocates 2N GiB of tensors in 256 MiB pieces and
  frees every other one: N GiB of tensors, 2N GiB reserved (mapped), as a real job
  holds more than it uses.
- ``pair --gib N``: a producer allocates N/2 GiB of tensors it shares with a consumer
  (``torch.multiprocessing``, spawn) and N/2 GiB private ones; the consumer holds the
  shared tensors and N/2 GiB private ones of its own.
- ``gpt2``: a small inference job, issue 30's "1.5 GB GPT-2": a GPT-2 of gpt2-medium's
  shape (24 layers, 1024 wide, 355 M fp32 parameters, 1.42 GB) built from its config
  with a fixed seed (the machine reaches no model hub) and run once (a forward and a
  greedy generation of 16 tokens); ``check`` compares every parameter with a host copy
  taken at start and the generation with the first one. ``--gib`` is ignored.

Protocol on stdin/stdout, one JSON object a line: the job prints ``{"ready": ...,
"pids": [...], "tensor_bytes": ..., "reserved_bytes": ...}`` once set up; then each
line ``check`` is answered ``{"ok": bool, "bad": [...]}`` (every tensor compared with
its pattern, in every process), ``quit`` ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

PIECE = 256 << 20  # bytes per tensor


def _pattern(torch: Any, n: int, seed: int) -> Any:
    """int32 values of a tensor of ``n`` elements, from ``seed`` (on the GPU)."""
    base = torch.arange(n, dtype=torch.int64, device="cuda")
    return ((base * 2654435761 + seed * 40503) & 0x7FFFFFFF).to(torch.int32)


def _make(torch: Any, count: int, seed0: int) -> list[tuple[int, Any]]:
    n = PIECE // 4
    return [(seed0 + k, _pattern(torch, n, seed0 + k)) for k in range(count)]


def _bad(torch: Any, tensors: list[tuple[int, Any]]) -> list[int]:
    return [s for s, t in tensors if not torch.equal(t, _pattern(torch, t.numel(), s))]


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _serve(check: Any) -> None:
    for line in sys.stdin:
        command = line.strip()
        if command == "check":
            bad = check()
            _say(ok=not bad, bad=bad)
        elif command == "quit":
            return


def single(gib: float) -> None:
    import torch

    count = max(1, int(gib * (1 << 30)) // PIECE)
    made = _make(torch, 2 * count, 1000)
    kept = made[::2]  # the other half freed: reserved, mapped, not in use
    del made
    torch.cuda.synchronize()
    _say(
        ready=True,
        pids=[__import__("os").getpid()],
        tensor_bytes=count * PIECE,
        reserved_bytes=int(torch.cuda.memory_reserved()),
    )
    _serve(lambda: _bad(torch, kept))


def _consume(inbox: Any, outbox: Any, private_count: int) -> None:
    import os

    import torch

    shared = inbox.get()
    own = _make(torch, private_count, 5000)
    torch.cuda.synchronize()
    outbox.put({"pid": os.getpid(), "reserved_bytes": int(torch.cuda.memory_reserved())})
    while True:
        command = inbox.get()
        if command == "check":
            outbox.put(_bad(torch, shared) + _bad(torch, own))
        else:
            return


def pair(gib: float) -> None:
    import os

    import torch
    import torch.multiprocessing as mp

    half = max(1, int(gib * (1 << 30)) // 2 // PIECE)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    shared = _make(torch, half, 3000)
    private = _make(torch, half, 4000)
    torch.cuda.synchronize()
    consumer = ctx.Process(target=_consume, args=(inbox, outbox, half), daemon=True)
    consumer.start()
    inbox.put(shared)
    hello = outbox.get(timeout=600)
    _say(
        ready=True,
        pids=[os.getpid(), int(hello["pid"])],
        tensor_bytes=3 * half * PIECE,
        shared_bytes=half * PIECE,
        reserved_bytes=int(torch.cuda.memory_reserved()) + int(hello["reserved_bytes"]),
    )

    def check() -> list[int]:
        inbox.put("check")
        theirs: list[int] = outbox.get(timeout=600)
        return _bad(torch, shared) + _bad(torch, private) + theirs

    _serve(check)
    inbox.put("quit")
    consumer.join(timeout=60)


def gpt2() -> None:
    import os

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(30)
    config = GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024)
    model = GPT2LMHeadModel(config).to("cuda").eval()
    host = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
    prompt = torch.arange(32, device="cuda").unsqueeze(0) * 37 % config.vocab_size

    def generate() -> list[int]:
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )
        return [int(x) for x in out[0].tolist()]

    first = generate()
    torch.cuda.synchronize()
    _say(
        ready=True,
        pids=[os.getpid()],
        tensor_bytes=sum(t.numel() * t.element_size() for t in host.values()),
        reserved_bytes=int(torch.cuda.memory_reserved()),
    )

    def check() -> list[int]:
        state = model.state_dict()
        bad = [k for k, (name, t) in enumerate(host.items())
               if not torch.equal(state[name].cpu(), t)]  # fmt: skip
        return bad + ([-1] if generate() != first else [])

    _serve(check)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=("single", "pair", "gpt2"))
    parser.add_argument("--gib", type=float, required=True)
    args = parser.parse_args()
    if args.job == "gpt2":
        gpt2()
    else:
        (single if args.job == "single" else pair)(args.gib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
