"""Partition-axis inference for a range of forward ops with OR-Tools CP-SAT (Lancet Sec. 5).

To pipeline a range, every tensor in it must be split into parts along one of
its dims, and every op must be able to compute part i of its outputs from part
i of its inputs alone. We model this as a constraint problem:

  - one boolean per (tensor, dim): "tensor is partitioned along dim";
  - each tensor: exactly one of its booleans is true;
  - each op kind lists its *options*: a dim per tensor it touches such that
    the op runs part-wise (e.g. a linear layer along any batch-like dim but
    not the contracted one); exactly one option is chosen per op and it
    fixes the dims of the op's tensors;
  - tensors entering the range (read, not produced, in it) are split along a
    batch or token dim (`AxisRange.batch_dims`).

No solution means the range cannot be partitioned. Parameters are not
tensors of the range: every part uses the whole weight.

Op kinds and their options (dims are named; "shared" = dims present in every
tensor of the op):
  linear, matmul   shared minus attrs contract (input dim summed over) and out_dim
  layernorm        shared minus attrs dim (the normalized dim, default last of input)
  softmax, attention  shared minus attrs seq_dim ("T") and head_dim ("H")
  elementwise      shared
  view, reshape, transpose  attrs dim_map {input dim: output dim}, one option per pair
  gate             every tensor along attrs token_dim ("S"); with attrs
                   batch_prioritized=True the gate ranks all tokens of the batch,
                   so the range is feasible only if it starts at the gate (the
                   gate then runs on the whole batch before the pipeline)
  dispatch, combine  tensors with the capacity dim ("C") along it, the rest along "S":
                   a token's part decides which slots it fills (irregular C axis)
  a2a              shared minus attrs expert_dim ("E")
  experts          every tensor along attrs capacity_dim ("C")
  batch_mixing     shared minus attrs mixed (default ("B",)), e.g. batchnorm
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


OP_KINDS = (
    "linear",
    "matmul",
    "layernorm",
    "softmax",
    "attention",
    "elementwise",
    "view",
    "reshape",
    "transpose",
    "gate",
    "dispatch",
    "combine",
    "a2a",
    "experts",
    "batch_mixing",
)


@dataclass(frozen=True)
class AxisOp:
    """A forward op of a range: kind in OP_KINDS, activation tensors in/out, kind attrs."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"op {self.name!r}: kind {self.kind!r} not in {OP_KINDS}")


@dataclass
class AxisRange:
    """Ops in program order and the named dims of every tensor they touch, e.g. x -> ("B","T","M")."""

    tensors: dict[str, tuple[str, ...]]
    ops: list[AxisOp]
    batch_dims: tuple[str, ...] = ("B", "S")

    def range_inputs(self, start: int = 0, end: int | None = None) -> list[str]:
        """Tensors that ops[start:end] read but do not produce, in first-read order."""
        ops = self.ops[start:end]
        made = {t for op in ops for t in op.outputs}
        seen: list[str] = []
        for op in ops:
            for t in op.inputs:
                if t not in made and t not in seen:
                    seen.append(t)
        return seen


def _shared(op: AxisOp, dims: Mapping[str, tuple[str, ...]], exclude: set[str]) -> list[dict[str, str]]:
    ts = op.inputs + op.outputs
    common = [d for d in dims[ts[0]] if all(d in dims[t] for t in ts) and d not in exclude]
    return [{t: d for t in ts} for d in common]


def op_options(op: AxisOp, dims: Mapping[str, tuple[str, ...]]) -> list[dict[str, str]]:
    """The ways `op` can run part-wise: each a dict tensor -> partition dim (see module docstring)."""
    for t in op.inputs + op.outputs:
        if t not in dims:
            raise ValueError(f"op {op.name!r}: tensor {t!r} has no dims in the range")
    a, ts = op.attrs, op.inputs + op.outputs
    if op.kind in ("linear", "matmul"):
        excl = {a.get("contract", dims[op.inputs[0]][-1]), a.get("out_dim", dims[op.outputs[0]][-1])}
        return _shared(op, dims, excl)
    if op.kind == "layernorm":
        return _shared(op, dims, {a.get("dim", dims[op.inputs[0]][-1])})
    if op.kind in ("softmax", "attention"):
        return _shared(op, dims, {a.get("seq_dim", "T"), a.get("head_dim", "H"), a.get("dim", "T")})
    if op.kind == "elementwise":
        return _shared(op, dims, set())
    if op.kind in ("view", "reshape", "transpose"):
        if len(op.inputs) != 1 or len(op.outputs) != 1:
            raise ValueError(f"op {op.name!r}: {op.kind} takes one input and one output")
        (x,), (y,) = op.inputs, op.outputs
        dim_map = a.get("dim_map")
        if not dim_map:
            raise ValueError(f"op {op.name!r}: {op.kind} needs attrs['dim_map'] {{input dim: output dim}}")
        for dx, dy in dim_map.items():
            if dx not in dims[x] or dy not in dims[y]:
                raise ValueError(f"op {op.name!r}: dim_map {dx!r}->{dy!r} not in {dims[x]} -> {dims[y]}")
        return [{x: dx, y: dy} for dx, dy in dim_map.items()]
    if op.kind in ("gate", "experts"):
        d = a.get("token_dim", "S") if op.kind == "gate" else a.get("capacity_dim", "C")
        missing = [t for t in ts if d not in dims[t]]
        return [] if missing else [{t: d for t in ts}]
    if op.kind in ("dispatch", "combine"):
        c, s = a.get("capacity_dim", "C"), a.get("token_dim", "S")
        opt = {t: (c if c in dims[t] else s) for t in ts}
        return [opt] if all(opt[t] in dims[t] for t in ts) else []
    if op.kind == "a2a":
        return _shared(op, dims, {a.get("expert_dim", "E")})
    if op.kind == "batch_mixing":
        return _shared(op, dims, set(a.get("mixed", ("B",))))
    raise AssertionError(op.kind)


def solve_axes(
    rng: AxisRange, start: int = 0, end: int | None = None, time_limit_s: float = 10.0
) -> dict[str, str] | None:
    """Partition dim of every tensor of ops[start:end], or None if that range cannot be partitioned."""
    ops = rng.ops[start:end]
    if not ops:
        raise ValueError(f"empty op range [{start}, {end})")
    for j, op in enumerate(ops):
        if op.kind == "gate" and op.attrs.get("batch_prioritized", False) and j != 0:
            return None  # the gate must see the whole batch: only possible ahead of the pipeline
    from ortools.sat.python import cp_model  # imported when Lancet plans, not when the trainer starts

    m = cp_model.CpModel()
    names = []
    for op in ops:
        names += [t for t in op.inputs + op.outputs if t not in names]
    var = {}
    for t in names:
        if t not in rng.tensors:
            raise ValueError(f"tensor {t!r} has no dims in AxisRange.tensors")
        var[t] = {d: m.new_bool_var(f"{t}@{d}") for d in rng.tensors[t]}
        m.add_exactly_one(var[t].values())
    for op in ops:
        options = op_options(op, rng.tensors)
        if not options:
            return None
        picks = [m.new_bool_var(f"{op.name}#{i}") for i in range(len(options))]
        m.add_exactly_one(picks)
        for pick, opt in zip(picks, options):
            for t, d in opt.items():
                m.add_implication(pick, var[t][d])
    for t in rng.range_inputs(start, end):
        allowed = [var[t][d] for d in rng.tensors[t] if d in rng.batch_dims]
        if not allowed:
            return None
        m.add_bool_or(allowed)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # deterministic, and the problems are tiny
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.solve(m)
    if status == cp_model.INFEASIBLE:
        return None
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"CP-SAT gave no answer for ops {start}..{end} within {time_limit_s} s")
    return {t: next(d for d, v in var[t].items() if solver.value(v)) for t in names}
