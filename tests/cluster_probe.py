"""Probe run on the emulated cluster by tests/test_emulated_cluster.py.

Started by torchrun in every node namespace (scripts/emulate_cluster.sh), it
joins a gloo group from the torchrun environment and prints one JSON line per
measurement, each starting with ``PROBE``:

- ``allreduce``: every rank contributes ``rank + 1``; the sum must be
  ``W * (W + 1) / 2``.
- ``sendrecv``: first rank of node 0 sends ``--mbytes`` MiB to the first rank
  of the last node, which answers with one float; seconds per round trip,
  after a warm-up, for ``--reps`` repetitions.
- ``exchange`` (only with ``--patterns sendrecv,exchange``): the same two ranks
  send ``--mbytes`` MiB to each other at once. Measured here: gloo moves the
  two directions of one pair about one after the other (twice the one-way
  time), although the emulated links are full duplex for plain TCP.

Only rank 0 prints the timings; every rank prints its all-reduce value.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def _emit(kind: str, **fields: object) -> None:
    """Print one ``PROBE {json}`` line and flush so the prefixer sees it now."""
    print("PROBE " + json.dumps({"probe": kind, **fields}), flush=True)


def _time_pair(peer_a: int, peer_b: int, nbytes: int, reps: int, both_ways: bool) -> list[float]:
    """Seconds per transfer of ``nbytes`` between ranks ``peer_a`` and ``peer_b``.

    One way: ``peer_a`` sends a float32 tensor of nbytes/4 elements, ``peer_b``
    replies with a 1-element ack; the time is measured at ``peer_a`` from send
    to ack. Both ways: each sends nbytes to the other at the same time, so each
    direction of each link carries nbytes. The first transfer is a warm-up
    (connection setup, allocation) and is not returned.
    """
    rank = dist.get_rank()
    payload = torch.ones(nbytes // 4, dtype=torch.float32)
    inbox = torch.empty_like(payload)
    ack = torch.zeros(1)
    peer = peer_b if rank == peer_a else peer_a
    times = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        if both_ways:
            ops = [dist.P2POp(dist.isend, payload, peer), dist.P2POp(dist.irecv, inbox, peer)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        elif rank == peer_a:
            dist.send(payload, peer)
            dist.recv(ack, peer)
        else:
            dist.recv(inbox, peer)
            dist.send(ack, peer)
        if rep > 0:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    """Join the group, run the all-reduce and the timed transfers, print JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mbytes", type=float, default=8.0, help="MiB per timed transfer")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up")
    parser.add_argument("--patterns", default="sendrecv", help="comma list of sendrecv, exchange")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = int(os.environ["NNODES"])
    procs = world // nodes

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    _emit("allreduce", rank=rank, world=world, value=value.item(), ifname=os.environ.get("GLOO_SOCKET_IFNAME"))

    if nodes > 1 and args.reps > 0:
        first, last = 0, (nodes - 1) * procs  # first ranks of node 0 and of the last node
        nbytes = int(args.mbytes * 2**20) // 4 * 4
        for kind in args.patterns.split(","):
            if kind not in ("sendrecv", "exchange"):
                raise SystemExit(f"--patterns: unknown pattern {kind!r}")
            both = kind == "exchange"
            if rank in (first, last):
                times = _time_pair(first, last, nbytes, args.reps, both)
                if rank == first:
                    _emit(kind, bytes=nbytes, seconds=times)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
