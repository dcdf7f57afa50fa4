"""Takes a shim's lease and holds it until its stdin closes, then exits without RELEASE.

    python -m tests.shim.workers.lease_holder SOCKET_PATH TOKEN_HEX   (from the checkout)

Prints the HANDSHAKE reply's status (``OK`` once it holds the lease). Used by
tests/shim/test_teams.py: a lease holder whose process is gone.
"""

from __future__ import annotations

import sys

from cuinterpose.engine import wire

from tests.shim import shimenv


def main(path: str, token_hex: str) -> int:
    request = wire.Request(wire.Op.HANDSHAKE, authorization=bytes.fromhex(token_hex))
    reply, _ = shimenv.request(path, request)
    print(reply.status.name, flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
