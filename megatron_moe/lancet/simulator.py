"""Timeline simulator of a batch-partitioned range of ops (Lancet Sec. 5).

A range of ops (compute or communication, each with its whole-batch cost) is split along the
batch into k parts. Per part, a compute op costs what was measured for one part of a k-way split
when it carries that (`part_ms`: profiled at the part's batch, as Lancet's profiler times ops at
the shapes they run at), else cost/k + overhead_ms (the fixed cost of launching k small kernels
instead of one); a communication op costs cost/k, or model.predict(bytes/k) when it carries a byte
count and a CommCostModel is given (the C/n rule for an irregular all-to-all).

Each part is cut into stages: maximal runs of consecutive compute or of consecutive comm ops, run
on one compute and one comm stream. Each stream runs its stages in the pipeline order Lancet
produces when it duplicates every op per part: stage by stage, within a stage part 0, 1, ...,
k-1. Stage j of part i starts when stage j-1 of part i and the previous stage on its stream have
finished. k = 1 means "not partitioned": the sequential sum of whole-batch costs, no overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from megatron_moe.lancet.cost import CommCostModel

OP_KINDS = ("compute", "comm")


@dataclass(frozen=True)
class SimOp:
    """An op of a range: kind "compute" or "comm", whole-batch cost in ms, optional comm bytes, and
    for a compute op optionally `part_ms`: (k, ms of one part of a k-way split) pairs, measured."""

    name: str
    kind: str
    cost_ms: float
    bytes: float | None = None
    part_ms: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"op {self.name!r}: kind {self.kind!r} not in {OP_KINDS}")
        if self.cost_ms < 0:
            raise ValueError(f"op {self.name!r}: negative cost_ms {self.cost_ms}")


@dataclass
class SimResult:
    """makespan_ms: end of the last stage; exposed_comm_ms: time comm runs while compute is idle; comm_ms:
    busy time of the comm stream; timeline: (part, stage, stream, start_ms, end_ms) of every stage."""

    makespan_ms: float
    exposed_comm_ms: float
    comm_ms: float
    timeline: list[tuple[int, int, str, float, float]] = field(default_factory=list)


def op_cost(op: SimOp, k: int, cost_model: CommCostModel | None = None, overhead_ms: float = 0.0) -> float:
    """Cost in ms of `op` on one of k parts (k = 1: the whole-batch cost, no overhead)."""
    if k < 1:
        raise ValueError(f"number of parts must be >= 1, got {k}")
    if op.kind == "comm":
        if op.bytes is not None and cost_model is not None:
            return cost_model.a2a_part_ms(op.bytes, k)
        return op.cost_ms / k
    if k == 1:
        return op.cost_ms
    measured = dict(op.part_ms or ())
    return measured[k] if k in measured else op.cost_ms / k + overhead_ms


def sequential_ms(ops: Sequence[SimOp], cost_model: CommCostModel | None = None) -> float:
    """Unpartitioned time of the range: every op on the whole batch, one after another."""
    return sum(op_cost(op, 1, cost_model) for op in ops)


def split_stages(ops: Sequence[SimOp]) -> list[list[SimOp]]:
    """Cut `ops` into maximal runs of the same kind (the stages of one part)."""
    stages: list[list[SimOp]] = []
    for op in ops:
        if stages and stages[-1][0].kind == op.kind:
            stages[-1].append(op)
        else:
            stages.append([op])
    return stages


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s = 0.0, 0.0
    cur_e: float | None = None  # end of the current merged interval; None before the first one
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _uncovered_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) minus union(b) (both lists of [start, end) intervals)."""
    return _union_length(a + b) - _union_length(b)


def simulate(
    ops: Sequence[SimOp], k: int, cost_model: CommCostModel | None = None, overhead_ms: float = 0.0
) -> SimResult:
    """P(range, k): makespan and exposed comm of the range split into k parts.

    With k = 1 every stage follows the previous one, so the makespan is
    sequential_ms(ops) and all communication is exposed.
    """
    if not ops:
        return SimResult(0.0, 0.0, 0.0)
    stages = split_stages(ops)
    durs = [sum(op_cost(op, k, cost_model, overhead_ms) for op in st) for st in stages]
    stream_free = {"compute": 0.0, "comm": 0.0}
    end = [[0.0] * len(stages) for _ in range(k)]  # end[part][stage]
    timeline = []
    busy: dict[str, list[tuple[float, float]]] = {"compute": [], "comm": []}
    for j, st in enumerate(stages):
        stream = st[0].kind
        for i in range(k):
            start = max(stream_free[stream], end[i][j - 1] if j > 0 else 0.0)
            end[i][j] = start + durs[j]
            stream_free[stream] = end[i][j]
            timeline.append((i, j, stream, start, end[i][j]))
            busy[stream].append((start, end[i][j]))
    makespan = max(e for _, _, _, _, e in timeline)
    return SimResult(
        makespan_ms=makespan,
        exposed_comm_ms=_uncovered_length(busy["comm"], busy["compute"]),
        comm_ms=sum(e - s for s, e in busy["comm"]),
        timeline=timeline,
    )
