"""Cost models for Lancet's planner: communication time by size, and cached op timings.

CommCostModel: piecewise-linear time of one collective by bytes, from (bytes, ms) samples
(`model_ir.profile_a2a_model`): linear between samples, the nearest segment's line outside them
(never below 0 ms). A part of an all-to-all of C bytes split into n costs what an all-to-all of
C/n bytes costs (Lancet Sec. 5).

OpProfiler: measures a compute op once per (op key, shape) and keeps the result in memory and in a
JSON file (written atomically), so later runs and other planners reuse it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from bisect import bisect_right
from typing import Any, Callable, Iterable, Sequence

from megatron_moe.fileio import atomic_write_json


class CommCostModel:
    """Piecewise-linear ms-per-collective model over message size in bytes."""

    def __init__(self, samples: Iterable[tuple[float, float]]) -> None:
        pts = sorted((float(b), float(ms)) for b, ms in samples)
        if len(pts) < 2:
            raise ValueError(f"CommCostModel needs >= 2 (bytes, ms) samples, got {len(pts)}")
        if len({b for b, _ in pts}) != len(pts):
            raise ValueError("CommCostModel samples repeat a size; give one time per size")
        self.bytes = [b for b, _ in pts]
        self.ms = [m for _, m in pts]

    def predict(self, nbytes: float) -> float:
        """Time in ms of one collective moving `nbytes` (interpolated / extrapolated)."""
        if nbytes <= 0:
            return 0.0
        # Segment j..j+1 containing nbytes; clamped to the first/last segment outside the range.
        j = min(max(bisect_right(self.bytes, nbytes) - 1, 0), len(self.bytes) - 2)
        b0, b1 = self.bytes[j], self.bytes[j + 1]
        m0, m1 = self.ms[j], self.ms[j + 1]
        return max(0.0, m0 + (m1 - m0) * (nbytes - b0) / (b1 - b0))

    def a2a_part_ms(self, capacity_bytes: float, n_parts: int) -> float:
        """Time of one of `n_parts` all-to-alls that together move a `capacity_bytes` buffer."""
        if n_parts < 1:
            raise ValueError(f"n_parts must be >= 1, got {n_parts}")
        return self.predict(capacity_bytes / n_parts)


def _time_ms(
    fn: Callable[[], Any], warmup: int, iters: int, clock: Callable[[], float], sync: Callable[[], None] | None
) -> float:
    """Median wall time of fn() in ms over `iters` timed calls after `warmup` untimed ones."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters}, {warmup}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if sync:
            sync()
        t0 = clock()
        fn()
        if sync:
            sync()  # an asynchronous device op only finishes at the sync
        times.append((clock() - t0) * 1e3)
    return statistics.median(times)


class OpProfiler:
    """Measure-once cache of op timings: (op key, shape) -> median ms, persisted as JSON.

    clock and sync are injectable: `sync` (e.g. torch.cuda.synchronize) is
    called around each timed run so asynchronous kernels are counted.
    """

    def __init__(
        self,
        cache_path: str | None,
        clock: Callable[[], float] = time.perf_counter,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.cache_path = cache_path
        self.clock = clock
        self.sync = sync
        self.cache: dict[str, float] = {}
        if cache_path and os.path.exists(cache_path):
            try:
                with open(cache_path) as f:
                    loaded = json.load(f)
                self.cache = {str(k): float(v) for k, v in loaded.items()}
            except (OSError, ValueError, AttributeError, TypeError) as e:
                raise ValueError(f"op profile cache {cache_path} is not a JSON object of ms: {e}") from e

    @staticmethod
    def key(op_key: str, shape: Sequence[int]) -> str:
        """Cache key of an op at a shape, e.g. 'linear|4x128x512'."""
        if "|" in op_key:
            raise ValueError(f"op_key {op_key!r} must not contain '|'")
        return f"{op_key}|{'x'.join(str(int(s)) for s in shape)}"

    def time(self, op_key: str, shape: Sequence[int], fn: Callable[[], Any], warmup: int = 2, iters: int = 5) -> float:
        """Median ms of fn() for (op_key, shape); measured on first request, then cached."""
        k = self.key(op_key, shape)
        if k not in self.cache:
            self.cache[k] = _time_ms(fn, warmup, iters, self.clock, self.sync)
            if self.cache_path:
                atomic_write_json(self.cache_path, self.cache)
        return self.cache[k]
