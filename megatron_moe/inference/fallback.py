"""Never slower: Lina's scheduled MoE checks itself against unscheduled inference and falls back.

For the first `probe_forwards` forwards (every MoE layer of each) the runner runs every MoE layer
both ways on the same tokens, in alternating order, timing each: the unscheduled layer
(`Block.ffn_residual`, what runs without --lina-inference; `unscheduled` replaces it in
benchmarks) and `ScheduledMoE`. The unscheduled output is returned, so the probed forwards give
exactly unscheduled inference's tokens and logits. Then one all-reduce MAX over the world gives
each way's slowest-rank total, and every rank keeps the scheduling only if it is faster (`decision`,
logged by rank 0 on logger "megatron_moe.inference"). Every rank makes the same number of MoE layer
calls (see engine.py), so every rank reaches the all-reduce at the same call.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from megatron_moe.distributed.collectives import all_reduce_raw
from megatron_moe.inference.engine import FFNRunner, InferenceEngine
from megatron_moe.inference.popularity import check_profile, load_profile
from megatron_moe.inference.scheduled import ScheduledMoE, gate_fingerprint
from megatron_moe.model.gpt2 import Block

log = logging.getLogger("megatron_moe.inference")


class CheckedLina:
    """An `InferenceEngine.ffn_runner`: `scheduled` if it measured faster than unscheduled inference
    over the first `probe_forwards` forwards, else the engine's own MoE layers (module docstring)."""

    def __init__(
        self,
        engine: InferenceEngine,
        scheduled: ScheduledMoE,
        probe_forwards: int = 4,
        unscheduled: Optional[FFNRunner] = None,
    ):
        if probe_forwards < 1:
            raise ValueError(f"--lina-probe-forwards must be >= 1, got {probe_forwards}")
        self.engine, self.scheduled = engine, scheduled
        self.unscheduled = unscheduled  # None: the blocks' own MoE layers
        self.probe_calls = probe_forwards * len(engine.moe_blocks)
        self.calls = 0
        self.sched_s = self.plain_s = 0.0  # this rank's totals over the probe
        self.slowest: Optional[tuple[float, float]] = None  # (scheduled, unscheduled) seconds, max over ranks
        self.decision: Optional[str] = None  # None while probing, then "scheduled" or "unscheduled"

    def probe_times(self) -> tuple[float, float]:
        """This rank's (scheduled, unscheduled) seconds over the probe (what the decision all-reduces)."""
        return self.sched_s, self.plain_s

    def __call__(self, block_idx: int, block: Block, x_1RM: torch.Tensor) -> torch.Tensor:
        if self.decision == "scheduled":
            return self.scheduled(block_idx, block, x_1RM)
        if self.decision == "unscheduled":
            return self._unscheduled(block_idx, block, x_1RM)
        out: Optional[torch.Tensor] = None
        for scheduled_way in (True, False) if self.calls % 2 == 0 else (False, True):
            t0 = time.perf_counter()
            if scheduled_way:
                self.scheduled(block_idx, block, x_1RM)
                self.sched_s += time.perf_counter() - t0
            else:
                out = self._unscheduled(block_idx, block, x_1RM)
                self.plain_s += time.perf_counter() - t0
        self.calls += 1
        if self.calls == self.probe_calls:
            self._decide()
        assert out is not None
        return out

    def _unscheduled(self, block_idx: int, block: Block, x_1RM: torch.Tensor) -> torch.Tensor:
        if self.unscheduled is not None:
            return self.unscheduled(block_idx, block, x_1RM)
        return block.ffn_residual(x_1RM)[0]

    def _decide(self) -> None:
        """All-reduce MAX of the probe times over the world; the same decision on every rank."""
        ps = self.engine.ps
        t = torch.tensor(list(self.probe_times()), dtype=torch.float64, device=self.engine.device)
        all_reduce_raw(t, ps.group("world"), op="max")
        sched, plain = float(t[0]), float(t[1])
        self.slowest = (sched, plain)
        self.decision = "scheduled" if sched < plain else "unscheduled"
        if ps.rank("world") == 0:
            log.info(
                "lina inference: scheduled %.1f ms vs unscheduled %.1f ms over %d MoE layer calls (slowest rank): %s",
                sched * 1e3,
                plain * 1e3,
                self.probe_calls,
                "keeping the scheduling" if self.decision == "scheduled" else "falling back to unscheduled",
            )


def use_lina(engine: InferenceEngine, profile_path: str, max_per_rank: int = 4, probe_forwards: int = 4) -> CheckedLina:
    """Load and check a profile and run the engine's MoE blocks under Lina's scheduling (phase1_2),
    checked against unscheduled inference (`CheckedLina`). Collective."""
    profile = load_profile(profile_path)
    check_profile(profile, gate_fingerprint(engine), profile_path, len(engine.moe_blocks))
    runner = CheckedLina(engine, ScheduledMoE(engine, profile, "phase1_2", max_per_rank), probe_forwards)
    engine.set_ffn_runner(runner)
    return runner
