"""Host memory on CPU runs: keep freed memory in the process, as CUDA's caching allocator does on GPUs.

PyTorch's CPU tensors come from glibc's malloc, which serves every block above its mmap threshold
(at most 32 MiB) with a fresh `mmap` and gives it back with `munmap` when the tensor dies. A training
iteration that makes and frees a few hundred MB of large activations then takes a page fault for
every 4 KiB page it touches, every iteration: measured on the paper-sized Pro-Prophet benchmark
(2 emulated nodes x 1 process, `tools/bench_pro_prophet.py`), about 88 000 minor faults and 0.4 s of
system time per 1.8 s step on the busy rank. It also makes step times depend on the iterations
before: on a virtual machine that hands free pages back to its host (virtio-balloon free page
reporting), an iteration needing more memory than the last few pays for re-faulting what the host
took back, and a runtime trial that alternates a light and a heavy configuration times the heavy
one 10-40 % slow.

`keep_freed_memory()` tells glibc (`mallopt`) to serve large blocks from its heap (M_MMAP_MAX 0),
never to trim the heap back to the system below 2 GiB free (M_TRIM_THRESHOLD), and to use one arena
for every thread (M_ARENA_MAX 1; a thread's own arena would `mmap` large blocks anyway). Freed
memory stays in the process and the next iteration reuses it without faults (the benchmark above:
about 10 faults and 0.23 s of system time per step). The process's resident memory then stays at
its peak, which is what a CUDA run's reserved memory does too. What still faults is growth: the
first iteration that needs more than any before it (measured: the first plain iteration of
Pro-Prophet's trial after its lighter placed ones, 13 500 faults once; every other iteration about
10). The 1 500-44 000 faults per plain iteration once measured there were a leak of the replicas'
buffers, fixed in `moe/placement.py`.

`--cpu-allocator keep` (default) applies it on `--device cpu`; `system` leaves glibc's defaults.
Without glibc (musl, macOS, Windows) nothing changes and the log says so. CUDA runs are never
affected: their tensors live in CUDA's own allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

import torch

CHOICES = ("keep", "system")  # --cpu-allocator
# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only above 2 GiB free at the heap's top

_applied: Optional[str] = None  # what the first call did (mallopt is process-wide, once is enough)


def _glibc() -> Optional[ctypes.CDLL]:
    """glibc's handle, or None where the C library is another (or absent)."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: an AttributeError elsewhere)
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory(device: torch.device, policy: str = "keep") -> str:
    """Apply `policy` (--cpu-allocator) for a run on `device`; returns the line to log."""
    global _applied
    if policy not in CHOICES:
        raise ValueError(f"--cpu-allocator must be one of {CHOICES}, got {policy!r}")
    if device.type != "cpu":
        return f"host memory: glibc defaults ({device.type} tensors use the {device.type} allocator)"
    if policy == "system":
        return "host memory: glibc defaults (--cpu-allocator system)"
    if _applied is not None:
        return _applied
    libc = _glibc()
    if libc is None:
        _applied = "host memory: the C library's defaults (not glibc: --cpu-allocator keep does nothing here)"
        return _applied
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not all(libc.mallopt(param, value) == 1 for param, value in settings):
        _applied = "host memory: glibc defaults (mallopt refused the settings of --cpu-allocator keep)"
        return _applied
    _applied = "host memory: freed memory kept in the process (--cpu-allocator keep: glibc one arena, no mmap, no trim)"
    return _applied
