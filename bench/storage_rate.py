"""The storage's own parallel write and read rate, measured the way the shims store their
staged bytes beside the CRIU images (STORE_STAGED / FETCH_STAGED: specs/protocol.md):
THREADS threads, each writing its share of TOTAL bytes into one file of DIR with pwrite
from an 8 MiB buffer, then reading it back with pread. Neither side syncs (the shim's
store does not either), so the figures are what the page cache and the disk behind it
take and give back in the same conditions as a dump and a restore. Then the write again
into fresh files, each thread from a populated source as large as its share (as a shim
writes its staged memory, which comes from DRAM, where one 8 MiB buffer stays in the
cache): ``write_whole_gbps``.

    python3 bench/storage_rate.py [--dir /tmp] [--gib 8] [--threads 16] [--out rate.json]

Prints one line per direction and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile
import threading
import time
from pathlib import Path

CHUNK = 8 << 20


def _run(paths: list[Path], share: int, write: bool, whole: bool = False) -> float:
    """Seconds for every thread to write (or read) ``share`` bytes of its own file; with
    ``whole``, each writes from a populated source of ``share`` bytes of its own."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(paths) + 1)

    def work(path: Path) -> None:
        buf = bytearray(os.urandom(1 << 16) * (CHUNK >> 16))
        source = mmap.mmap(-1, share) if whole else None
        if source is not None:
            for offset in range(0, share, CHUNK):  # populated before the clock starts
                source[offset : offset + CHUNK] = buf[: min(CHUNK, share - offset)]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        try:
            start.wait()
            view = memoryview(buf)
            whole_view = memoryview(source) if source is not None else None
            for offset in range(0, share, CHUNK):
                n = min(CHUNK, share - offset)
                if write and whole_view is not None:
                    done = os.pwrite(fd, whole_view[offset : offset + n], offset)
                elif write:
                    done = os.pwrite(fd, view[:n], offset)
                else:
                    done = os.preadv(fd, [view[:n]], offset)
                if done != n:
                    raise OSError(f"{path}: {'wrote' if write else 'read'} {done} of {n} bytes")
        except BaseException as exc:  # reported by the caller, with the path
            errors.append(exc)
        finally:
            os.close(fd)
            if source is not None:
                whole_view = None
                source.close()

    threads = [threading.Thread(target=work, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - began
    if errors:
        raise SystemExit(f"storage rate: {errors[0]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads < 1 or args.gib * (1 << 30) < args.threads * CHUNK:
        parser.error(f"--threads must be at least 1, and --gib give each thread {CHUNK >> 20} MiB")
    total = int(args.gib * (1 << 30))
    share = total // args.threads // CHUNK * CHUNK
    work = Path(tempfile.mkdtemp(prefix="storage-rate-", dir=args.dir))
    paths = [work / f"staged-{i}.bin" for i in range(args.threads)]
    fresh = [work / f"whole-{i}.bin" for i in range(args.threads)]
    try:
        wrote = _run(paths, share, write=True)
        read = _run(paths, share, write=False)
        for p in paths:
            p.unlink()
        whole = _run(fresh, share, write=True, whole=True)
    finally:
        for p in paths + fresh:
            p.unlink(missing_ok=True)
        work.rmdir()
    moved = share * args.threads
    result = {
        "dir": str(args.dir),
        "bytes": moved,
        "threads": args.threads,
        "write_s": round(wrote, 3),
        "write_gbps": round(moved / wrote / 1e9, 2),
        "read_s": round(read, 3),
        "read_gbps": round(moved / read / 1e9, 2),
        "write_whole_s": round(whole, 3),
        "write_whole_gbps": round(moved / whole / 1e9, 2),
    }
    print(
        f"storage {args.dir}: {moved / (1 << 30):.1f} GiB in {args.threads} files, "
        f"write {result['write_gbps']} GB/s ({wrote:.2f} s), "
        f"read back {result['read_gbps']} GB/s ({read:.2f} s), "
        f"write from a source as large {result['write_whole_gbps']} GB/s ({whole:.2f} s)",
        flush=True,
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
