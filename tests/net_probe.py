"""Plain-socket probe run with ``scripts/emulate_cluster.sh --no-torchrun``.

Every node prints the launcher environment it sees, then node 0 times two
patterns with every other node, ``--mbytes`` MiB per peer:

- incast: all peers send to node 0 at once; only node 0's receive link is
  loaded by all of them, so the goodput measures the shaper on the hub side of
  the emulated switch (the switch -> node 0 direction);
- outcast: node 0 sends to all peers at once and waits for a one-byte ack
  from each; only node 0's send link carries everything, so the goodput
  measures the shaper on node 0's own veth.

No torch import: this runs in about a second.

Output lines start with ``PROBE`` followed by JSON.
"""

import argparse
import json
import os
import selectors
import socket
import time

_ENV_KEYS = (
    "NODE_RANK",
    "NNODES",
    "NPROC_PER_NODE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
)


def _emit(kind: str, **fields: object) -> None:
    """Print one ``PROBE {json}`` line, flushed."""
    print("PROBE " + json.dumps({"probe": kind, **fields}), flush=True)


def _receive_all(conns: list[socket.socket], nbytes: int) -> None:
    """Read exactly ``nbytes`` from each connection, interleaved, then return."""
    sel = selectors.DefaultSelector()
    left = {}
    for conn in conns:
        conn.sendall(b"g")  # go: all senders start together
        sel.register(conn, selectors.EVENT_READ)
        left[conn] = nbytes
    while left:
        for key, _ in sel.select():
            data = key.fileobj.recv(1 << 20)
            if not data:
                raise ConnectionError("sender closed early")
            left[key.fileobj] -= len(data)
            if left[key.fileobj] <= 0:
                sel.unregister(key.fileobj)
                del left[key.fileobj]


def _send_all(conns: list[socket.socket], nbytes: int) -> None:
    """Write ``nbytes`` to every connection concurrently, then read one ack from each."""
    payload = memoryview(b"\0" * nbytes)
    sel = selectors.DefaultSelector()
    sent = {}
    for conn in conns:
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_WRITE)
        sent[conn] = 0
    while sent:
        for key, _ in sel.select():
            conn = key.fileobj
            sent[conn] += conn.send(payload[sent[conn] :])
            if sent[conn] == nbytes:
                sel.unregister(conn)
                del sent[conn]
    for conn in conns:
        conn.setblocking(True)
        if conn.recv(1) != b"a":
            raise ConnectionError("expected an ack byte")


def _connect(addr: str, port: int, deadline_s: float = 20.0) -> socket.socket:
    """Connect to node 0, retrying until it listens or ``deadline_s`` passes."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return socket.create_connection((addr, port), timeout=deadline_s)
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def main() -> None:
    """Print the environment, then time ``--reps`` incasts and outcasts at node 0."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mbytes", type=float, default=4.0, help="MiB per peer and pattern")
    parser.add_argument("--reps", type=int, default=2, help="timed rounds of incast + outcast")
    args = parser.parse_args()

    rank, nodes = int(os.environ["NODE_RANK"]), int(os.environ["NNODES"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    _emit("env", **{k: os.environ.get(k) for k in _ENV_KEYS})
    nbytes = int(args.mbytes * 2**20)

    if rank == 0:
        server = socket.create_server((addr, port), backlog=nodes)
        conns = [server.accept()[0] for _ in range(nodes - 1)]
        times: dict[str, list[float]] = {"incast": [], "outcast": []}
        for _ in range(args.reps):
            for kind, pattern in (("incast", _receive_all), ("outcast", _send_all)):
                start = time.perf_counter()
                pattern(conns, nbytes)
                times[kind].append(time.perf_counter() - start)
        for kind, seconds in times.items():
            _emit(kind, peers=nodes - 1, bytes_per_peer=nbytes, seconds=seconds)
    else:
        conn = _connect(addr, port)
        payload = b"\0" * nbytes
        for _ in range(args.reps):
            if conn.recv(1) != b"g":
                raise ConnectionError("expected the go byte from node 0")
            conn.sendall(payload)
            got = 0
            while got < nbytes:
                chunk = conn.recv(min(1 << 20, nbytes - got))
                if not chunk:
                    raise ConnectionError("node 0 closed early")
                got += len(chunk)
            conn.sendall(b"a")


if __name__ == "__main__":
    main()
