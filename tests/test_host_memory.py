"""--cpu-allocator (megatron_moe/host_memory.py): with `keep`, large CPU tensors made and freed again
reuse the process's memory (no page faults after the first round); with `system`, glibc hands every
large block back and the next one faults again. Each policy runs in a fresh interpreter (mallopt is
process-wide and cannot be undone)."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_moe import host_memory
from megatron_moe.arguments import parse_args

PROBE = r"""
import json, resource, sys, threading
import torch
from megatron_moe.host_memory import keep_freed_memory

line = keep_freed_memory(torch.device("cpu"), sys.argv[1])

def faults(rounds=8):
    # page faults of this thread over `rounds` rounds of a 64 MiB tensor made, written and freed
    r0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(rounds):
        t = torch.empty(16 * 2**20)
        t.fill_(1.0)
        del t
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - r0

faults(16)  # the first rounds fault under every policy (the heap grows to its working size)
main = faults()
other = []
th = threading.Thread(target=lambda: (faults(16), other.append(faults())))
th.start()
th.join()
print(json.dumps({"line": line, "main": main, "thread": other[0]}))
"""

PAGES = 16 * 2**20 * 4 // 4096  # pages of one 64 MiB tensor


def _probe(policy: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, policy], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="not glibc: --cpu-allocator keep changes nothing here")
def test_keep_reuses_freed_memory_and_system_faults_every_round():
    kept = _probe("keep")
    assert "freed memory kept in the process" in kept["line"]
    # 8 rounds of 16384 pages each once warm: kept memory is reused (a few stray faults at most), on any thread
    assert kept["main"] < PAGES // 4 and kept["thread"] < PAGES // 4, kept
    system = _probe("system")
    assert "glibc defaults (--cpu-allocator system)" in system["line"]
    assert system["main"] >= PAGES, system  # the blocks fault in again (measured: half a block per round)


def test_other_devices_and_bad_values():
    assert "cuda tensors use the cuda allocator" in host_memory.keep_freed_memory(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="--cpu-allocator must be one of"):
        host_memory.keep_freed_memory(torch.device("cpu"), "pool")
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parse_args(["--cpu-allocator", "pool"])
    assert parse_args([]).parallel.cpu_allocator == "keep"
