"""Named timeline ranges and the torch.profiler window of a run.

`annotate(name)` names every range: a `torch.profiler.record_function` (torch.profiler / Chrome
traces) plus, when CUDA is available, an NVTX range (Nsight Systems); a context manager or a
decorator (`@annotate("moe/dispatch")`). Range names (docs/PROFILING.md explains each):
moe/router, moe/dispatch, moe/all_to_all, moe/experts, moe/combine, lina/micro_op, lancet/part,
train/step, train/forward_backward, train/optimizer.

`StepProfiler` runs torch.profiler on the iterations [start, end) of the chosen ranks and writes one
Chrome trace per rank.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import statistics
import time
from typing import Optional, Sequence

import torch


@functools.lru_cache(maxsize=1)
def _nvtx_enabled() -> bool:
    """NVTX only where CUDA is there (checked once; does not initialize CUDA)."""
    return torch.cuda.is_available()


class annotate(contextlib.ContextDecorator):
    """A named range: record_function (profiler traces) + NVTX on CUDA. Context manager or decorator."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._rf: Optional[torch.profiler.record_function] = None

    def __enter__(self) -> "annotate":
        if _nvtx_enabled():
            torch.cuda.nvtx.range_push(self.name)
        self._rf = torch.profiler.record_function(self.name)
        self._rf.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        rf, self._rf = self._rf, None
        if rf is not None:
            rf.__exit__(*exc)
        if _nvtx_enabled():
            torch.cuda.nvtx.range_pop()

    def _recreate_cm(self) -> "annotate":
        # a decorated function may run re-entrantly or on several threads: one object per call
        return annotate(self.name)


def _all_threads_config():
    """Kineto option to record every thread (Lina's launcher thread, the autograd engine's), where
    this torch has it; otherwise None (only threads that existed at start are recorded)."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def trace_path(profile_dir: str, rank: int, start: int, end: int) -> str:
    """Where rank `rank`'s trace of iterations [start, end) goes."""
    return os.path.join(profile_dir, f"trace_rank{rank:05d}_iter{start}-{end}.json")


class StepProfiler:
    """torch.profiler over the iterations [start, end) of this rank when it is in `ranks`.

    `before_step(iteration)` / `after_step(iteration)` around each iteration (iteration = iterations
    done); `close()` writes a trace cut short by an early exit. Written to a temporary name and
    renamed, so a reader never sees half a file.
    """

    def __init__(
        self,
        enabled: bool,
        start: int,
        end: int,
        ranks: Sequence[int],
        rank: int,
        profile_dir: Optional[str],
        device: torch.device,
    ) -> None:
        self.active = bool(enabled) and rank in set(ranks)
        self.start, self.end, self.rank = start, end, rank
        self.dir = profile_dir
        self.device = device
        self.prof: Optional[torch.profiler.profile] = None
        self.written: Optional[str] = None

    def before_step(self, iteration: int) -> None:
        if self.active and self.prof is None and self.written is None and self.start <= iteration < self.end:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=acts, record_shapes=False, with_stack=False, experimental_config=_all_threads_config()
            )
            self.prof.start()
            self.first = iteration

    def after_step(self, iteration: int) -> Optional[str]:
        """`iteration` = iterations done now; stops and writes the trace at the window's end."""
        if self.prof is not None and iteration >= self.end:
            return self._write(iteration)
        return None

    def close(self, iteration: int) -> Optional[str]:
        return self._write(iteration) if self.prof is not None else None

    def _write(self, iteration: int) -> str:
        assert self.prof is not None and self.dir is not None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.stop()
        os.makedirs(self.dir, exist_ok=True)
        path = trace_path(self.dir, self.rank, self.first, iteration)
        tmp = f"{path}.tmp-{os.getpid()}.json"
        self.prof.export_chrome_trace(tmp)
        os.replace(tmp, path)
        self.prof, self.written = None, path
        return path


def stamp(cuda: bool):
    """A point in time: a CUDA event recorded on the current stream, or perf_counter seconds."""
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def span_ms(spans: list, cuda: bool) -> list[float]:
    """Durations (ms) of (start, end) stamps; on CUDA after a synchronize (the events completed)."""
    if cuda:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in spans]
    return [1e3 * (b - a) for a, b in spans]


def paired_ratio(
    candidate_ms: Sequence[float],
    reference_ms: Sequence[float],
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The benchmarks' paired comparison: (median, low, high) of candidate[i] / reference[i] over the
    rounds i, each round timing both back to back (round-robin), so a slow spell of a shared machine
    hits both sides of a ratio. low / high: a percentile-bootstrap confidence interval of that median
    at `level` (the rounds resampled with replacement `resamples` times; seeded, so the same samples
    give the same interval). It treats rounds as independent: drift slower than a round cancels in
    the ratio, drift within a round does not, and the interval cannot see it."""
    if len(candidate_ms) != len(reference_ms) or not candidate_ms:
        raise ValueError(
            f"paired_ratio needs one reference time per candidate time, got {len(candidate_ms)} and {len(reference_ms)}"
        )
    if not 0.0 < level < 1.0 or resamples < 1:
        raise ValueError(f"paired_ratio: level must be in (0, 1) and resamples >= 1, got {level}, {resamples}")
    ratios = [c / r for c, r in zip(candidate_ms, reference_ms)]
    rng, n = random.Random(seed), len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    lo = medians[min(resamples - 1, int(tail * resamples))]
    hi = medians[max(0, min(resamples - 1, int((1.0 - tail) * resamples) - 1))]
    return statistics.median(ratios), lo, hi
