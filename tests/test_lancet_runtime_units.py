"""Lancet runtime pieces in one process: deferred dW GEMMs, the dW queue, the planner on a
real model with given costs, the report, and errors."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_moe.config import OptimizationsConfig
from megatron_moe.lancet.controller import setup
from megatron_moe.lancet.model_ir import build_model_ops, feasibility, model_shapes, runtime_range
from megatron_moe.lancet.partitioned_moe import RangeSpec
from megatron_moe.lancet.planner import LancetPlan, make_plan
from megatron_moe.lancet.wgrad_runtime import DeferredDW, WgradRuntime
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.experts import Experts
from megatron_moe.parallel_state import local_state
from test_lancet_runtime import config, synthetic_costs


class _Window(torch.autograd.Function):
    """Stands for an all-to-all: its backward opens the dW window of `name`."""

    @staticmethod
    def forward(ctx, x, rt, name):
        ctx.rt, ctx.name = rt, name
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.rt.run_window(ctx.name)
        return g, None, None


def _linear_grads(defer: WgradRuntime | None, uses: int, window: bool):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 5))
    b = torch.nn.Parameter(torch.randn(6))
    x = torch.randn(2, 3, 5, requires_grad=True)
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    lin = defer.linear("lin.dW") if defer is not None else F.linear
    # the "all-to-all" comes before the linear in forward, so after it in backward
    xin = _Window.apply(x, defer, "a2a") if window else x
    y = sum(lin(xin * (i + 1), w, b) for i in range(uses))
    (y * torch.arange(6.0)).sum().backward()
    return w.grad, b.grad, x.grad, seen


def test_deferred_linear_is_bitwise_autograd_and_hook_fires_once_when_final():
    ref_w, ref_b, ref_x, ref_seen = _linear_grads(None, 1, False)
    for window in (False, True):
        rt = WgradRuntime({"a2a": ["lin.dW"]})
        w, b, x, seen = _linear_grads(rt, 1, window)
        assert torch.equal(w, ref_w) and torch.equal(b, ref_b) and torch.equal(x, ref_x)
        assert len(seen) == 1 and torch.equal(seen[0], w)
        assert rt.pending() == 0 and dict(rt.stats.runs) == {"lin.dW": 1}
        # no window: the end-of-backward callback ran it; window: it ran under the "all-to-all"
        assert (rt.stats.flushed, rt.stats.in_window) == ((0, 1) if window else (1, 0))
    # a weight used twice (two parts): one hook call, with the sum of both contributions
    ref_w2, _, ref_x2, _ = _linear_grads(None, 2, False)
    rt = WgradRuntime({})
    w2, _, x2, seen2 = _linear_grads(rt, 2, False)
    assert len(seen2) == 1 and torch.equal(seen2[0], w2)
    assert torch.allclose(w2, ref_w2, atol=1e-6) and torch.equal(x2, ref_x2)
    assert rt.stats.immediate == 2 and rt.stats.runs["lin.dW"] == 2
    assert rt.stats.merged == 1  # both uses' rows in one GEMM


def test_expert_dw_of_several_parts_accumulates_into_one_gradient_per_weight():
    """Grouped experts used by 3 parts (a partitioned range; one expert gets no row in a part): the
    queue holds each part's row operands until the weight's last use and accumulates their GEMMs into
    one gradient per weight, handed to AccumulateGrad without a copy, with the gradients of plain
    autograd (which sums 3 full-size per-part gradients)."""
    grads, stats = [], []
    for defer in (False, True):
        ex = Experts(4, 32, 64, local_state(), seed=3, name="ex")
        rt = WgradRuntime({})
        if defer:
            ex.set_dw_queue(rt, "L1.moe.expert.")
        g = torch.Generator().manual_seed(1)
        counts = [[2, 1, 0, 4], [1, 1, 2, 1], [3, 3, 1, 2]]
        xs = [torch.randn(sum(c), 32, generator=g, requires_grad=True) for c in counts]
        sum((ex.forward_ragged(x, c, 0.5) ** 2).sum() for x, c in zip(xs, counts)).backward()
        grads.append([x.grad for x in xs] + [p.grad for p in ex.parameters()])
        stats.append(rt.stats)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
    assert stats[0].merged == 0 and not stats[0].runs  # no queue: plain autograd
    assert stats[1].merged == 2 and dict(stats[1].runs) == {"L1.moe.expert.fc1.dW": 3, "L1.moe.expert.fc2.dW": 3}


def test_deferred_expert_gemms_equal_the_plain_experts_bitwise():
    grads = []
    for defer in (False, True):
        ex = Experts(4, 32, 64, local_state(), seed=3, name="ex")
        if defer:
            rt = WgradRuntime({})
            ex.set_dw_queue(rt, "")
        x = torch.randn(4, 5, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        (ex(x, grad_scale=0.5) ** 2).sum().backward()
        grads.append([x.grad] + [p.grad for p in ex.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_deferred_dw_never_runs_twice():
    rt = WgradRuntime({"a2a": ["w.dW"]})
    p = torch.nn.Parameter(torch.zeros(2))
    item = DeferredDW("w.dW", p, lambda: torch.ones(2))
    rt._uses[p] += 1
    rt._run(item)
    assert torch.equal(p.grad, torch.ones(2))
    with pytest.raises(RuntimeError, match="ran twice"):
        rt._run(item)


def _plan(k: int, policy: str, partition: bool = True, **opts) -> tuple:
    cfg = config(k, policy)
    for key, v in opts.items():
        setattr(cfg.opts, key, v)
    model = GPT2MoE(cfg, local_state())
    costs, comm = synthetic_costs()
    plan = make_plan(
        model, local_state(), cfg.opts, 3, 8, wgrad=True, partition=partition, costs=costs, comm=comm, broadcast=False
    )
    return model, plan


def test_planner_partitions_moe_ranges_and_honours_knobs():
    model, plan = _plan(1, "position", lancet_group_ms=0.5)
    assert plan.ranges and all(r.layer in (1, 3) and 1 < r.k <= 3 for r in plan.ranges)
    assert plan.predicted["iteration_ms"] > 0 and plan.predicted["forward_ms"] > 0
    # the pipeline hides partitioned layers' all-to-alls: Algorithm 1 gets only what it leaves exposed
    assert all(plan.assignment[f"L{r.layer}.moe.a2a_{a}"] == [] for r in plan.ranges for a in ("dispatch", "combine"))
    _, wg = _plan(1, "position", partition=False)
    assert wg.ranges == [] and wg.predicted["dw_hidden_ms"] > 0
    # Algorithm 1 on the full all-to-all: the dispatch all-to-all hides the layer's expert dW first
    assert set(wg.assignment["L3.moe.a2a_dispatch"]) >= {"L3.moe.expert.fc1.dW", "L3.moe.expert.fc2.dW"}
    assert wg.assignment["L3.moe.a2a_combine"] == []  # nothing deferrable precedes it
    assigned = {w for ws in wg.assignment.values() for w in ws}
    assert len(assigned | set(wg.leftover)) == len(assigned) + len(wg.leftover) == 16  # deferrable only
    assert not any("gate" in w or ".ln" in w or "head" in w for w in assigned)
    _, plan_rho = _plan(1, "position", lancet_group_ms=0.5, lancet_max_partitions=2)
    assert plan_rho.ranges and all(r.k <= 2 for r in plan_rho.ranges)
    _, plan_one = _plan(1, "position", lancet_group_ms=0.5, lancet_max_partitions=1)
    assert plan_one.ranges == []
    _, plan_iota = _plan(1, "position", lancet_group_ms=0.5, lancet_max_range=3)
    assert plan_iota.ranges == []  # no runtime range is 3 ops or shorter
    for k, policy in ((2, "position"), (1, "batch_prioritized")):
        _, p = _plan(k, policy, lancet_group_ms=0.5)
        assert p.ranges and all(r.start == "gate" for r in p.ranges), (k, policy, p.ranges)


def test_feasibility_accepts_runtime_ranges_only():
    model = GPT2MoE(config(1, "position"), local_state())
    costs, _ = synthetic_costs()
    mo = build_model_ops(model, costs, model_shapes(model, local_state(), 3, 8))
    names = [op.name for op in mo.sim]
    lo, hi = names.index("L1.ln1"), names.index("L2.attn.proj") + 1
    assert runtime_range(mo, lo, hi) == (1, "attn", "next_attn")
    ok = feasibility(mo)
    assert ok(lo, hi) and ok(names.index("L1.moe.gate"), names.index("L1.moe.combine") + 1)
    assert not ok(lo, names.index("L1.moe.experts"))  # ends inside the layer
    assert runtime_range(mo, names.index("L0.ln1"), hi) == (1, "dense", "next_attn") and ok(names.index("L0.ln1"), hi)
    assert not ok(names.index("L0.attn.qkv"), hi)  # starts inside a dense block
    bp = GPT2MoE(config(1, "batch_prioritized"), local_state())
    mo_bp = build_model_ops(bp, costs, model_shapes(bp, local_state(), 3, 8))
    assert not feasibility(mo_bp)(lo, hi) and feasibility(mo_bp)(names.index("L1.moe.gate"), hi)


def test_report_and_remove(tmp_path):
    model, plan = _plan(1, "position", lancet_group_ms=0.5)
    path = tmp_path / "lancet.json"
    cfg = model.cfg
    cfg.opts.lancet_report = str(path)
    ids = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(0))
    plain = model(ids, ids)[0].item()
    ctl = setup(model, local_state(), cfg.opts, plan=plan)
    lm, aux = model(ids, ids)
    ctl.backward(lm + aux)
    assert abs(lm.item() - plain) < 1e-6
    ctl.write_report(measured_iter_ms=12.5)
    rep = json.loads(path.read_text())
    assert rep["measured_iteration_ms"] == 12.5 and rep["knobs"]["rho"] == 8
    assert [r["layer"] for r in rep["ranges"]] == [r.layer for r in plan.ranges]
    assert all(r["measured_forward_ms"] > 0 for r in rep["ranges"])
    assert math.isfinite(rep["predicted"]["iteration_ms"]) and rep["dp"]
    ctl.remove()
    assert model.runners == {} and model.blocks[0].attn.qkv.dw_queue is None
    assert model(ids, ids)[0].item() == plain


def test_bad_ranges_and_knobs_are_clear_errors():
    with pytest.raises(ValueError, match="start"):
        RangeSpec(1, "middle", "block", 2)
    with pytest.raises(ValueError, match="--lancet-max-partitions"):
        RangeSpec(1, "gate", "block", 0)
    cfg = config(2, "position")
    model = GPT2MoE(cfg, local_state())
    with pytest.raises(
        ValueError,
        match=r"RangeSpec\(layer=1, start='attn', end='block', k=2\): CP-SAT finds no "
        r"partition axes \(an op in it cannot be split\)",
    ):
        setup(model, local_state(), cfg.opts, plan=LancetPlan.manual([RangeSpec(1, "attn", "block", 2)]))
    assert model.runners == {}  # nothing installed
    with pytest.raises(ValueError, match="no dense block follows MoE block 3"):
        setup(model, local_state(), cfg.opts, plan=LancetPlan.manual([RangeSpec(3, "gate", "dense", 2)]))
    cfg.model.dropout = 0.1
    with pytest.raises(ValueError, match="--hidden-dropout"):
        setup(
            GPT2MoE(cfg, local_state()),
            local_state(),
            cfg.opts,
            plan=LancetPlan.manual([RangeSpec(1, "gate", "block", 2)]),
        )
    with pytest.raises(ValueError, match="--lancet-group-ms"):
        make_plan(model, local_state(), OptimizationsConfig(lancet_group_ms=0), 3, 8)


def test_chained_ranges_in_consecutive_moe_blocks_match_plain():
    """Every block MoE: a range ending in the next block's attention hands over to that block's range."""
    cfg = config(1, "position")
    cfg.moe.moe_layer_freq = 1
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(2))
    plans = [
        None,
        LancetPlan.manual(
            [
                RangeSpec(0, "attn", "next_attn", 2),
                RangeSpec(1, "ln2", "next_attn", 3),
                RangeSpec(2, "gate", "block", 2),
            ],
            {},
        ),
    ]
    out = []
    for plan in plans:
        model = GPT2MoE(cfg, local_state())
        ctl = setup(model, local_state(), cfg.opts, plan=plan)
        lm, aux = model(ids[:, :-1], ids[:, 1:])
        ctl.backward(lm + aux)
        drops = [b.moe.last_stats["dropped"] for b in model.blocks]
        out.append((lm + aux, [p.grad for p in model.parameters()], drops))
    (l0, g0, d0), (l1, g1, d1) = out
    assert d0 == d1 and sum(d0) > 0 and abs(l0.item() - l1.item()) < 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(g0, g1)) < 1e-6


def test_groups_never_span_a_cut():
    from megatron_moe.lancet.partition_dp import group_ops

    assert group_ops([1, 1, 1, 1], 2.0) == [(0, 2), (2, 4)]
    assert group_ops([1, 1, 1, 1], 2.0, cuts={1, 3}) == [(0, 1), (1, 3), (3, 4)]


def test_parts_are_priced_at_their_measured_batch():
    from megatron_moe.lancet.model_ir import profile_costs
    from megatron_moe.lancet.simulator import SimOp, op_cost, simulate

    op = SimOp("L1.moe.experts", "compute", 8.0, None, ((2, 7.0), (4, 3.0)))
    assert op_cost(op, 1) == 8.0 and op_cost(op, 2) == 7.0 and op_cost(op, 4) == 3.0
    assert op_cost(op, 8, overhead_ms=0.5) == 8.0 / 8 + 0.5  # not measured: cost / k + overhead
    plain = SimOp("x", "compute", 8.0)
    assert simulate([op], 2).makespan_ms == 14.0 and simulate([plain], 2, overhead_ms=0.5).makespan_ms == 9.0

    model = GPT2MoE(config(1, "position"), local_state())
    costs = profile_costs(model, local_state(), 4, 8, iters=1, max_parts=8)
    assert sorted(costs.parts) == [2, 3, 4]  # at most B parts
    assert costs.parts[3] is costs.parts[2]  # ceil(4 / 3) = ceil(4 / 2) = 2 samples: one measurement
    for k, c in costs.parts.items():
        assert set(c["moe"]) == set(costs.fwd["moe"]) and set(c["dense"]) == set(costs.fwd["dense"]) and c["head"] > 0
    mo = build_model_ops(model, costs, model_shapes(model, local_state(), 4, 8))
    by_name = {o.name: o for o in mo.sim}
    assert dict(by_name["L1.moe.experts"].part_ms) == {k: c["moe"]["moe.experts"] for k, c in costs.parts.items()}
    assert dict(by_name["head"].part_ms)[4] == costs.parts[4]["head"]
    assert by_name["L1.moe.a2a_dispatch"].part_ms is None  # comm: the all-to-all model prices its parts
    assert profile_costs(model, local_state(), 4, 8, iters=1).parts == {}  # max_parts 1: no part costs
