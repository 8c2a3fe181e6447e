"""Lancet's planning pass: which ranges to partition (and into how many parts), which dW GEMMs to run
under which all-to-all, and the predicted times.

`make_plan` profiles the model (`model_ir.py`), runs the partition DP with the simulator and CP-SAT
feasibility (`partition_dp.plan_ops`), builds the backward IR, runs Algorithm 1 (`schedule_wgrad`) and
predicts forward / backward / iteration time. A partitioned layer's all-to-alls enter Algorithm 1 with
the time its backward pipeline leaves exposed (simulated): dW only has to cover the rest. Cost
approximations: a GEMM's dX costs its forward time; the attention core's backward twice its forward;
LayerNorm dW half its forward; a range's backward is the range reversed with compute doubled.
Profiles differ between ranks and the plan must not (message sizes and the order of gradient
hand-overs depend on it), so `make_plan` broadcasts rank 0's.

Never slower: `candidate_plans` plans every mode the switches allow ("none", "dw", "partition",
"both") from one profile, the partitioned modes also at half the part budget (`coarse_budget`:
"partition@k4" for --lancet-max-partitions 8); the controller times the `top_candidates` on the real
model and keeps the fastest (`controller.choose_plan`). The second budget because the model ranks
plans of one budget better than plans of different budgets (a part's launch and small ops are not
in the op profile): on the emulated cluster it predicted 8 parts 4-8 % faster than 4, and the two
measured within 3 % of each other (docs/BENCHMARKS.md, "Lancet: the measured candidates include
half the part budget"). `fit_contention` fits

    measured ~= scale * predicted + contention * overlapped_ms

to those measurements, overlapped_ms being the all-to-all time the plan predicts hidden under
compute (a2a_ms - a2a_exposed_ms: on CPU ranks gloo's all-to-alls take cycles from the compute they
overlap, which profiling ops one at a time misses): least squares on relative errors, the
contention in [0, 1] (an overlapped ms costs at most the ms it hides), only `scale` when no
candidate overlaps.

A `LancetPlan` is plain data (picklable, `to_json`); `LancetPlan.manual` makes one by hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Optional

import torch.distributed as dist

from megatron_moe import choose
from megatron_moe.lancet.cost import CommCostModel, OpProfiler
from megatron_moe.lancet.ir import Graph, Instr
from megatron_moe.lancet.model_ir import (
    Costs,
    ModelOps,
    build_model_ops,
    deferrable_dw_names,
    feasibility,
    model_shapes,
    profile_a2a_model,
    profile_costs,
    runtime_range,
)
from megatron_moe.lancet.partition_dp import PartitionPlan, PlannedRange, plan_ops
from megatron_moe.lancet.partitioned_moe import RangeSpec, needs_whole_batch_gate
from megatron_moe.lancet.simulator import SimOp, sequential_ms, simulate
from megatron_moe.lancet.wgrad_schedule import build_gpt_moe_backward, schedule_wgrad

if TYPE_CHECKING:
    from megatron_moe.parallel_state import ParallelState


@dataclass
class LancetPlan:
    """What the runtime does and what the cost model predicts.

    ranges: partitioned ranges (k > 1) as RangeSpecs; assignment: all-to-all
    name -> dW names (Algorithm 1; empty lists without dW scheduling);
    leftover: dW run where the plain backward runs them; dp: every range of
    the DP (op names, k, predicted ms); predicted: forward_ms, backward_ms,
    iteration_ms, a2a_ms, a2a_exposed_ms; knobs: rho, gamma, iota.
    """

    ranges: list[RangeSpec] = field(default_factory=list)
    assignment: dict = field(default_factory=dict)
    leftover: list = field(default_factory=list)
    dp: list = field(default_factory=list)
    predicted: dict = field(default_factory=dict)
    knobs: dict = field(default_factory=dict)
    wgrad: bool = False
    name: str = "manual"
    selection: dict = field(default_factory=dict)

    @classmethod
    def manual(cls, ranges=(), assignment: Optional[dict] = None) -> "LancetPlan":
        """A plan given by hand: `ranges` to partition and, if given, a dW assignment (enables dW scheduling)."""
        return cls(list(ranges), dict(assignment or {}), [], [], {}, {}, assignment is not None)

    def to_json(self) -> dict:
        """The plan as JSON-ready dicts and lists."""
        d = asdict(self)
        d["ranges"] = [asdict(r) for r in self.ranges]
        return d


def backward_graph(model, costs: Costs, a2a_ms: float) -> Graph:
    """Backward IR of `model` with profiled costs; non-deferrable dW instructions become "other"."""
    dw, L = costs.dw, len(model.blocks)
    per_layer = []
    for block in model.blocks:
        f = costs.fwd["moe" if block.is_moe else "dense"]
        c = {
            "attn.proj.dX": f["attn.proj"],
            "attn.proj.dW": dw["attn.proj.dW"],
            "attn.core.dX": 2 * f["attn.core"],
            "attn.qkv.dX": f["attn.qkv"],
            "attn.qkv.dW": dw["attn.qkv.dW"],
            "ln1.dX": f["ln1"],
            "ln1.dW": 0.5 * f["ln1"],
            "ln2.dX": f["ln2"],
            "ln2.dW": 0.5 * f["ln2"],
        }
        if block.is_moe:
            c.update(
                {
                    "moe.combine.dX": f["moe.combine"],
                    "moe.a2a_combine": a2a_ms,
                    "moe.expert.fc2.dX": f["moe.experts"] / 2,
                    "moe.expert.fc2.dW": dw["moe.expert.fc2.dW"],
                    "moe.expert.fc1.dX": f["moe.experts"] / 2,
                    "moe.expert.fc1.dW": dw["moe.expert.fc1.dW"],
                    "moe.a2a_dispatch": a2a_ms,
                    "moe.dispatch.dX": f["moe.dispatch"],
                    "moe.gate.dX": f["moe.gate"],
                    "moe.gate.dW": dw["moe.gate.dW"],
                }
            )
        else:
            c.update(
                {
                    "mlp.fc2.dX": f["mlp.fc2"],
                    "mlp.fc2.dW": dw["mlp.fc2.dW"],
                    "mlp.fc1.dX": f["mlp.fc1"],
                    "mlp.fc1.dW": dw["mlp.fc1.dW"],
                }
            )
        per_layer.append(c)
    head = {"head.dX": costs.head_ms, "head.dW": dw["head.dW"], "embed.dW": costs.embed_ms}
    g = build_gpt_moe_backward(L, [l for l, b in enumerate(model.blocks) if b.is_moe], per_layer, head)
    ok = deferrable_dw_names(model)
    return Graph(
        [
            Instr(i.name, "other", i.inputs, i.outputs, i.cost_ms) if i.kind == "dW" and i.name not in ok else i
            for i in g.instrs
        ]
    )


def _layer_of(name: str) -> int:
    return int(name.split(".", 1)[0][1:])


def _backward_ops(ops: list) -> list:
    """The backward of `ops`: reversed, compute doubled (dX + dW)."""

    def twice(o: SimOp) -> SimOp:
        parts = None if o.part_ms is None else tuple((k, 2 * ms) for k, ms in o.part_ms)
        return SimOp(o.name, o.kind, 2 * o.cost_ms, o.bytes, parts)

    return [o if o.kind == "comm" else twice(o) for o in reversed(ops)]


def _simulate_ranges(mo: ModelOps, dp: PartitionPlan, comm: CommCostModel, overhead_ms: float) -> dict:
    """Forward and backward simulation of every DP range; the backward is the range reversed with
    compute doubled (dX + dW). Returns sums and each partitioned layer's backward exposed comm."""
    forward_ms = backward_ms = exposed_ms = 0.0
    layer_exposed: dict[int, float] = {}
    for r in dp.ranges:
        ops = list(mo.sim[r.start : r.end])
        f = simulate(ops, r.k, comm, overhead_ms)
        b = simulate(_backward_ops(ops), r.k, comm, overhead_ms)
        forward_ms += f.makespan_ms
        backward_ms += b.makespan_ms
        exposed_ms += f.exposed_comm_ms + b.exposed_comm_ms
        if r.k > 1:
            for layer in {_layer_of(o.name) for o in ops if o.kind == "comm"}:
                layer_exposed[layer] = b.exposed_comm_ms
    return {
        "forward_ms": forward_ms,
        "backward_ms": backward_ms,
        "exposed_ms": exposed_ms,
        "layer_exposed": layer_exposed,
    }


def _range_spec(mo: ModelOps, r: PlannedRange) -> RangeSpec:
    """The RangeSpec of a partitioned DP range (plan_ops partitions only ranges the runtime can run)."""
    where = runtime_range(mo, r.start, r.end)
    if where is None:
        raise RuntimeError(f"planned range of ops [{r.start}, {r.end}) in {r.k} parts is not a runtime range")
    layer, start, end = where
    return RangeSpec(layer, start, end, r.k)


def residual_graph(graph: Graph, layer_exposed: dict) -> Graph:
    """The backward IR with each partitioned layer's all-to-alls costing what the pipeline leaves
    exposed (split evenly between its two), so Algorithm 1 covers only the remaining time."""

    def cost(i: Instr) -> float:
        if i.kind == "a2a" and _layer_of(i.name) in layer_exposed:
            return layer_exposed[_layer_of(i.name)] / 2
        return i.cost_ms

    return Graph([Instr(i.name, i.kind, i.inputs, i.outputs, cost(i)) for i in graph.instrs])


def predict(mo: ModelOps, sims: dict, graph: Graph, assignment: dict, comm: CommCostModel) -> dict:
    """Predicted ms: forward T(N) and the simulated backward (`_simulate_ranges`), minus the
    all-to-all time the assigned dW hide (each all-to-all of `graph`, a residual graph, hides at
    most its own cost)."""
    hidden = sum(
        min(a.cost_ms, sum(graph[w].cost_ms for w in assignment.get(a.name, ()))) for a in graph.of_kind("a2a")
    )
    a2a = sum(simulate([o], 1, comm).comm_ms for o in mo.sim if o.kind == "comm")
    fwd, bwd = sims["forward_ms"], sims["backward_ms"]
    return {
        "forward_ms": fwd,
        "backward_ms": bwd - hidden,
        "iteration_ms": fwd + bwd - hidden,
        "a2a_ms": 2 * a2a,
        "a2a_exposed_ms": max(0.0, sims["exposed_ms"] - hidden),
        "dw_hidden_ms": hidden,
    }


def make_plan(
    model,
    ps: "ParallelState",
    opts,
    B: int,
    T: int,
    *,
    wgrad: Optional[bool] = None,
    partition: Optional[bool] = None,
    costs: Optional[Costs] = None,
    comm: Optional[CommCostModel] = None,
    profiler: Optional[OpProfiler] = None,
    broadcast: bool = True,
) -> LancetPlan:
    """Profile (unless `costs` / `comm` are given), plan and predict; the same plan on every rank.

    opts: OptimizationsConfig (--lancet-wgrad, --lancet-partition, --lancet-max-partitions rho,
    --lancet-group-ms gamma, --lancet-max-range iota); `wgrad` / `partition` override its switches.
    Collective when `comm` is None (all-to-all profiling) or `broadcast` is set.
    """
    wgrad = opts.lancet_wgrad if wgrad is None else wgrad
    partition = opts.lancet_partition if partition is None else partition
    if opts.lancet_max_partitions < 1:
        raise ValueError(f"--lancet-max-partitions must be >= 1, got {opts.lancet_max_partitions}")
    if opts.lancet_group_ms <= 0:
        raise ValueError(f"--lancet-group-ms must be > 0, got {opts.lancet_group_ms}")
    if opts.lancet_max_range < 1:
        raise ValueError(f"--lancet-max-range must be >= 1, got {opts.lancet_max_range}")
    sh = model_shapes(model, ps, B, T)
    costs = costs or profile_costs(model, ps, B, T, profiler, max_parts=opts.lancet_max_partitions)
    comm = comm or profile_a2a_model(ps, int(sh.a2a_bytes()))
    mo = build_model_ops(model, costs, sh)
    rho = min(opts.lancet_max_partitions, B)
    if partition:
        # groups never straddle a place where a runtime range may start or end
        cuts = {j for d in list(mo.starts.values()) + list(mo.ends.values()) for j in d}
        dp = plan_ops(
            mo.sim, opts.lancet_group_ms, opts.lancet_max_range, rho, comm, costs.overhead_ms, feasibility(mo), cuts
        )
    else:
        total = sequential_ms(mo.sim, comm)
        dp = PartitionPlan(total, [PlannedRange(0, len(mo.sim), 1, total)])
    ranges = [_range_spec(mo, r) for r in dp.ranges if r.k > 1]
    forced_k = forced_partitions()
    if partition and forced_k > 1:  # every MoE block, whatever the prediction
        ranges = [
            RangeSpec(l, "gate" if needs_whole_batch_gate(b.moe) else "attn", "block", min(forced_k, B))
            for l, b in enumerate(model.blocks)
            if b.is_moe and B > 1
        ]
    sims = _simulate_ranges(mo, dp, comm, costs.overhead_ms)
    graph = residual_graph(backward_graph(model, costs, comm.predict(sh.a2a_bytes())), sims["layer_exposed"])
    if wgrad:
        sched = schedule_wgrad(graph)
        assignment, leftover = sched.assignment, sched.leftover
    else:
        assignment, leftover = {}, [i.name for i in graph.of_kind("dW")]
    plan = LancetPlan(
        ranges,
        assignment,
        leftover,
        [{"ops": [mo.sim[r.start].name, mo.sim[r.end - 1].name], "k": r.k, "predicted_ms": r.ms} for r in dp.ranges],
        predict(mo, sims, graph, assignment, comm),
        {
            "rho": opts.lancet_max_partitions,
            "gamma_ms": opts.lancet_group_ms,
            "iota": opts.lancet_max_range,
            "overhead_ms": costs.overhead_ms,
            "forced_k": forced_k,
        },
        wgrad,
    )
    if broadcast and dist.is_initialized() and dist.get_world_size() > 1:
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
    return plan


MODES = {"none": (False, False), "dw": (True, False), "partition": (False, True), "both": (True, True)}
CANDIDATES = 2  # plans of each part budget `top_candidates` times beside "none"


def forced_partitions() -> int:
    """Parts every MoE block's range runs in whatever the planner predicts (tests: `choose.override`
    or MMOE_CHOOSE "lancet partitions=K"); 0: the planner decides."""
    k = choose.forced("lancet partitions")
    if k is not None and (not k.isdigit() or int(k) < 2):
        raise ValueError(f"lancet partitions: a forced part count must be an integer >= 2, got {k!r}")
    return int(k or 0)


def candidate_plans(
    model,
    ps: "ParallelState",
    opts,
    B: int,
    T: int,
    *,
    costs: Optional[Costs] = None,
    comm: Optional[CommCostModel] = None,
    profiler: Optional[OpProfiler] = None,
    broadcast: bool = True,
) -> dict:
    """name -> LancetPlan for "none" and every mode the switches allow (--lancet-wgrad for "dw",
    --lancet-partition for "partition", both for "both"), all from one profile (collective like make_plan);
    a partitioned mode also as "<mode>@k<K>" planned with at most K = `coarse_budget` parts, when that
    plan differs from the mode's own."""
    sh = model_shapes(model, ps, B, T)
    costs = costs or profile_costs(model, ps, B, T, profiler, max_parts=opts.lancet_max_partitions)
    comm = comm or profile_a2a_model(ps, int(sh.a2a_bytes()))
    coarse = coarse_budget(opts.lancet_max_partitions)
    out = {}
    for name, (w, p) in MODES.items():
        if (w and not opts.lancet_wgrad) or (p and not opts.lancet_partition):
            continue
        plan = make_plan(model, ps, opts, B, T, wgrad=w, partition=p, costs=costs, comm=comm, broadcast=broadcast)
        plan.name = name
        out[name] = plan
        if p and coarse is not None:
            half = replace(opts, lancet_max_partitions=coarse)
            fewer = make_plan(model, ps, half, B, T, wgrad=w, partition=p, costs=costs, comm=comm, broadcast=broadcast)
            if fewer.ranges and fewer.ranges != plan.ranges:
                fewer.name = f"{name}@k{coarse}"
                out[fewer.name] = fewer
    return out


def coarse_budget(max_partitions: int) -> Optional[int]:
    """The second part budget `candidate_plans` plans at: half of --lancet-max-partitions (at least 2),
    None when that is not below it."""
    k = max(2, max_partitions // 2)
    return k if k < max_partitions else None


def top_candidates(plans: dict, n: int = CANDIDATES) -> list:
    """ "none", the n plans of the full part budget other than "none" with the smallest predicted
    iteration time, and the n such plans of the coarse budget ("<mode>@k<K>", `candidate_plans`),
    simplest first for `choose.pick`: "none", then by mode ("dw", "partition", "both"), the coarse
    budget before the full one; plans with nothing to install ("partition" without ranges) are dropped."""
    if "none" not in plans:
        raise ValueError("the candidate plans must include 'none'")
    order = list(plans)
    rest = [m for m in order if m != "none" and (plans[m].ranges or plans[m].wgrad)]
    rest.sort(key=lambda m: (plans[m].predicted["iteration_ms"], order.index(m)))
    full, coarse = [m for m in rest if "@" not in m], [m for m in rest if "@" in m]
    picked = full[:n] + coarse[:n]
    return ["none"] + sorted(picked, key=lambda m: (list(MODES).index(m.split("@")[0]), "@" not in m))


def overlapped_ms(plan: LancetPlan) -> float:
    """All-to-all time the plan predicts hidden under compute (0 for "none")."""
    p = plan.predicted
    a2a = p.get("a2a_ms", 0.0)
    v = a2a - p.get("a2a_exposed_ms", 0.0)
    return v if v > 1e-9 * max(1.0, a2a) else 0.0  # round-off of a sum of exposures is not overlap


def fit_contention(rows) -> dict:
    """Fit measured ~= scale * predicted + contention * overlapped (module docstring) to rows of
    (predicted_ms, overlapped_ms, measured_ms), least squares on relative error. Returns scale,
    contention (ms of slowdown per ms of overlapped communication), and each row's relative
    prediction error before and after the fit."""
    rows = [(float(p), float(o), float(m)) for p, o, m in rows]
    if not rows or any(m <= 0 or p <= 0 for p, _, m in rows):
        raise ValueError(f"fit_contention needs rows with positive predicted and measured ms, got {rows}")
    w = [1.0 / (m * m) for _, _, m in rows]
    spp = sum(wi * p * p for wi, (p, _, _) in zip(w, rows))
    spo = sum(wi * p * o for wi, (p, o, _) in zip(w, rows))
    soo = sum(wi * o * o for wi, (_, o, _) in zip(w, rows))
    spm = sum(wi * p * m for wi, (p, _, m) in zip(w, rows))
    som = sum(wi * o * m for wi, (_, o, m) in zip(w, rows))
    det = spp * soo - spo * spo
    c = (spp * som - spo * spm) / det if soo > 0 and det > 1e-12 * spp * soo else 0.0
    # contention in [0, 1] (module docstring): noise must not turn a few ms of overlap into a factor
    c = min(1.0, max(0.0, c))
    scale = (spm - c * spo) / spp  # the first normal equation, refitted given c
    before = [(p - m) / m for p, _, m in rows]
    after = [(scale * p + c * o - m) / m for p, o, m in rows]
    return {"scale": scale, "contention": c, "error_before": before, "error_after": after}


def fitted_ms(plan: LancetPlan, fit: dict) -> float:
    """The plan's predicted iteration time corrected by a `fit_contention` result."""
    return fit["scale"] * plan.predicted["iteration_ms"] + fit["contention"] * overlapped_ms(plan)
