"""Instruction IR of one training pass (Lancet, Jiang et al., MLSys 2024, Sec. 4).

A pass is a list of instructions in program order. Each instruction names the values it reads
and writes; a dependency edge runs from the producer of a value to every instruction that reads
it. Values no instruction produces (saved activations, parameters, the loss gradient) are inputs
of the whole pass, ready from the start: they create no edges.

Instruction kinds:
  "fwd"   forward compute          "dX"  activation-gradient compute
  "dW"    weight-gradient compute  "a2a" an all-to-all (communication)
  "comm"  other communication      "other" anything else (compute)

The weight-gradient scheduler (`wgrad_schedule.py`) asks which dW instructions may run while an
all-to-all is in flight: those with no directed path to or from it (`overlappable_dw`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

KINDS = frozenset({"fwd", "dX", "dW", "a2a", "comm", "other"})


@dataclass(frozen=True)
class Instr:
    """One instruction: `kind` in KINDS, named input/output values, and its cost in ms."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    cost_ms: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"instruction {self.name!r}: kind {self.kind!r} not in {sorted(KINDS)}")
        if self.cost_ms < 0:
            raise ValueError(f"instruction {self.name!r}: negative cost_ms {self.cost_ms}")
        # lists accepted, tuples stored: the instruction stays hashable
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))


class Graph:
    """Instructions in program order with producer -> consumer dependency edges.

    Program order must be a topological order: a value is read only after the
    instruction that produces it, and each value has at most one producer.
    Violations raise ValueError naming the instruction and value.
    """

    def __init__(self, instrs: Iterable[Instr]) -> None:
        self.instrs: list[Instr] = list(instrs)
        self._index: dict[str, int] = {}
        producer: dict[str, str] = {}
        self._succ: dict[str, list[str]] = {}
        self._pred: dict[str, list[str]] = {}
        for pos, ins in enumerate(self.instrs):
            if ins.name in self._index:
                raise ValueError(f"duplicate instruction name {ins.name!r}")
            self._index[ins.name] = pos
            self._succ[ins.name] = []
            preds: list[str] = []
            for v in ins.inputs:
                if v in producer and producer[v] not in preds:
                    preds.append(producer[v])
            self._pred[ins.name] = preds
            for p in preds:
                self._succ[p].append(ins.name)
            for v in ins.outputs:
                if v in producer:
                    raise ValueError(f"value {v!r} produced by both {producer[v]!r} and {ins.name!r}")
                producer[v] = ins.name
        # A read of a value produced later breaks program order; find it now, not in the scheduler.
        for ins in self.instrs:
            for v in ins.inputs:
                if v in producer and self._index[producer[v]] > self._index[ins.name]:
                    raise ValueError(
                        f"instruction {ins.name!r} reads {v!r} before its producer {producer[v]!r} in program order"
                    )

    def __len__(self) -> int:
        return len(self.instrs)

    def __getitem__(self, name: str) -> Instr:
        """The instruction called `name` (KeyError if absent)."""
        return self.instrs[self._index[name]]

    def position(self, name: str) -> int:
        """Program-order index of instruction `name`."""
        return self._index[name]

    def of_kind(self, kind: str) -> list[Instr]:
        """Instructions of `kind`, in program order."""
        return [i for i in self.instrs if i.kind == kind]

    def _walk(self, start: str, edges: dict[str, list[str]]) -> set[str]:
        seen: set[str] = set()
        todo = deque(edges[start])
        while todo:
            n = todo.popleft()
            if n not in seen:
                seen.add(n)
                todo.extend(edges[n])
        return seen

    def descendants(self, name: str) -> set[str]:
        """All instructions reachable from `name` by a directed path of length >= 1 (BFS)."""
        return self._walk(name, self._succ)

    def ancestors(self, name: str) -> set[str]:
        """All instructions with a directed path of length >= 1 to `name` (BFS)."""
        return self._walk(name, self._pred)


def overlappable_dw(graph: Graph, a2a: str) -> list[str]:
    """dW instructions with no directed path to or from all-to-all `a2a`, in program order.

    Such an instruction neither waits for the all-to-all's result nor feeds it,
    so it may run on the compute stream while the all-to-all is in flight.
    """
    if graph[a2a].kind != "a2a":
        raise ValueError(f"{a2a!r} is a {graph[a2a].kind!r} instruction, not an all-to-all")
    related = graph.descendants(a2a) | graph.ancestors(a2a)
    return [i.name for i in graph.instrs if i.kind == "dW" and i.name not in related]
