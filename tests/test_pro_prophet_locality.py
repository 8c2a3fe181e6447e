"""Pro-Prophet's locality and runtime order (moe.placement.ProProphet, two gloo ranks, EP2):

- the per-layer expert counts ride the dispatchers' count exchange: no collective of their own
  (observer event counts equal the run without Pro-Prophet, the count exchange grows by exactly
  the appended E integers per row) and they equal the all-gather reference (`gather_counts`);
- the plan for iteration j+1 is made while iteration j's dispatch all-to-all is in flight (the last
  observed collective is that all-to-all, not yet waited), identical on every rank and to the plan
  made at the end of the iteration (`plan_in_flight=False`);
- Trans / Agg through the side-stream calls (no-ops on the CPU): what the consumer reads after the
  wait is what the peer sent;
- with replicas in both MoE layers (the second layer's Agg waited at the first layer's output), every
  gradient equals the run without placement;
- calibration in the runtime: the calibration iterations alternate no placement and the plan, the
  fit is the same on every rank, and the next plan is Algorithm 1 on the fitted model.
"""

import pytest
import torch

from equivalence import MICRO_BATCH, global_batch, tiny_config
from megatron_moe.distributed.observer import CommLog
from megatron_moe.layers.sharding import local_pieces
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.placement import Placement, ProProphet, ReplicaExchange, gather_counts, routed_counts
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.pro_prophet.calibration import Calibrator
from megatron_moe.pro_prophet.perf_model import PerfConstants, PerfModel
from megatron_moe.pro_prophet.planner import heaviest_to_all, plan
from megatron_moe.testing import spawn

E, ITERS, MICRO = 4, 4, 2  # experts, iterations, micro-batches per iteration


def _config():
    cfg = tiny_config(1, num_experts=E, moe_dropless=True)
    cfg.model.num_layers = 4  # two MoE layers
    return cfg


def _iterations(ps, mode: str, log: CommLog) -> dict:
    """ITERS iterations of MICRO forward + backward passes (no optimizer step: routing stays put).

    mode "plain": no runtime (the reference); "still": a runtime whose planner moves nothing;
    "flight" / "end": heaviest-to-all planning under the all-to-all / at the end of the iteration."""
    torch.manual_seed(0)
    model = GPT2MoE(_config(), ps)
    layers = model.moe_layers()
    seen: list = []  # per plan: was the last observed collective an unwaited forward all-to-all?

    # calibrated mode: Algorithm 1 with eq. (8) on made-up constants (a token costs 1 us, a Trans 1 us)
    calib = Calibrator(PerfModel(PerfConstants(0, 0, 1e-6, 0, 0, 1e-6), 1, 1, 1, overlap=True), skip=1, iters=2)

    def planner(counts):
        last = log.records[-1]
        seen.append(last.op == "all_to_all" and last.phase == "fwd" and "blocked" not in last.info)
        if mode == "calib":
            return plan(counts, calib.model, alpha=0.0).replicas
        return heaviest_to_all(counts, 1).replicas if mode in ("flight", "end") else [()] * E

    runtime = (
        None
        if mode == "plain"
        else ProProphet(
            layers,
            ps,
            planner=planner,
            plan_in_flight=mode != "end",
            calibrator=calib if mode == "calib" else None,
            anchor=model.wte if mode == "flight" else None,  # the first layer's Trans / Agg at the embedding
        )
    )
    r, out = ps.rank("dp"), {"events": [], "a2a_bytes": [], "counts": [], "reference": [], "plans": [], "seen": seen}
    out["started"] = started = []  # per forward of the first MoE layer with replicas: Trans started before it?
    if runtime is not None:
        first = layers[0]

        def before_first(module, args):
            if first.dispatcher.placement is not None:
                ex = runtime.pending.get(first.layer_idx)
                started.append(ex is not None and all(t is not None for t in ex.trans))

        first.register_forward_pre_hook(before_first)
    for it in range(ITERS):
        log.clear()
        routed = 0
        for mb in range(MICRO):
            ids, labels = global_batch(ps.size("dp"), seed=10 * it + mb)
            sl = slice(r * MICRO_BATCH, (r + 1) * MICRO_BATCH)
            lm, aux = model(ids[sl], labels[sl])
            if it == ITERS - 1 and mb == 0:
                out["nodes"] = _node_names(lm + aux)
            (lm + aux).backward()
            routed = routed + torch.stack([routed_counts(la) for la in layers])
        evs = [e for e in log.records if e.op not in ("trans", "agg")]
        out["events"].append(sorted((e.op, e.group, e.phase) for e in evs))
        out["a2a_bytes"].append(sum(e.sent for e in evs if e.op == "all_to_all" and e.phase == "fwd"))
        if runtime is not None:
            out["counts"].append(runtime.collected_counts().tolist())
            runtime.end_iteration(it + 1)
            out["plans"].append([runtime.placement_of(la.layer_idx).replicas for la in layers])
        log.stop()
        out["reference"].append(gather_counts(ps, routed).tolist())  # the separate all-gather, unobserved
        log.start()
    out["planned_in_flight"] = runtime.planned_in_flight if runtime is not None else 0
    out["grads"] = {name: t for name, (_, t) in local_pieces(model, ps, "grad").items()}  # summed over the passes
    if mode == "calib":
        out["fitted"] = calib.fitted
        out["expected_last"] = [plan(c, calib.model, alpha=0.0).replicas for c in out["counts"][-1]]
    return out


def _node_names(loss: torch.Tensor) -> set[str]:
    """Class names of every autograd node the loss's backward runs."""
    names, seen, todo = set(), set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(nxt for nxt, _ in node.next_functions)
    return names


def _exchange(ps) -> dict:
    """Trans and Agg of one replica (expert 0 of EP rank 0 on EP rank 1) through ReplicaExchange."""
    torch.manual_seed(1)
    model = GPT2MoE(_config(), ps)
    experts = model.moe_layers()[0].experts
    ex = ReplicaExchange(Placement.of(E, 2, {0: [1]}), experts, ps, layer_idx=1, blocking=False)
    ex.launch_trans(0)
    ex.launch_trans(1)
    reps = ex.replicas()  # waited: the consumer reads the buffers now
    grads = tuple(torch.full_like(t, float(ps.rank("ep") + 3)) for t in reps)
    ex.launch_agg(grads)
    agg = ex.wait_agg()
    return {
        "reps": [t.clone() for t in reps],
        "own0": [getattr(experts, n)[0].detach().clone() for n in ("fc_w", "fc_b", "proj_w", "proj_b")],
        "agg": [None if g is None else g.clone() for g in agg],
    }


def _run(rank, world):
    ps = initialize_model_parallel(1, 2, 1)
    try:
        with CommLog() as log:
            res = {mode: _iterations(ps, mode, log) for mode in ("plain", "still", "flight", "end", "calib")}
        res["exchange"] = _exchange(ps)
        return res
    finally:
        destroy_model_parallel()


@pytest.fixture(scope="module")
def per_rank():
    return spawn(_run, 2, timeout=600)


def test_counts_ride_the_count_exchange_without_a_collective_of_their_own(per_rank):
    n_moe, D = 2, 2
    for r, res in enumerate(per_rank):
        plain, still = res["plain"], res["still"]
        assert still["events"] == plain["events"], f"rank {r}: Pro-Prophet added or removed collectives"
        assert not any(op == "all_gather" for ev in still["events"] for op, _, _ in ev)
        # each forward's count exchange carries E more int64 per destination row: D * E * 8 bytes
        extra = [s - p for s, p in zip(still["a2a_bytes"], plain["a2a_bytes"])]
        assert extra == [n_moe * MICRO * D * E * 8] * ITERS, f"rank {r}: {extra}"
        for mode in ("still", "flight", "end"):
            assert res[mode]["counts"] == res[mode]["reference"], f"rank {r} {mode}: counts differ from all-gather"
    assert per_rank[0]["still"]["counts"] == per_rank[1]["still"]["counts"]


def test_plan_under_the_all_to_all_equals_the_plan_at_the_end_on_every_rank(per_rank):
    for r, res in enumerate(per_rank):
        flight, end = res["flight"], res["end"]
        assert flight["plans"] == end["plans"], f"rank {r}: in-flight plans differ from end-of-iteration plans"
        assert any(reps for plan in flight["plans"] for layer in plan for reps in layer), "nothing was moved"
        # iteration 1 plans at its end (forwards per iteration not known yet); later ones in flight
        assert flight["planned_in_flight"] == 2 * (ITERS - 1) and end["planned_in_flight"] == 0
        assert flight["seen"] == [False] * 2 + [True] * (2 * (ITERS - 1)), flight["seen"]
        assert end["seen"] == [False] * (2 * ITERS)
    assert per_rank[0]["flight"]["plans"] == per_rank[1]["flight"]["plans"]


def test_an_empty_plan_puts_no_pro_prophet_node_in_the_graph(per_rank):
    ours = {"_AggWaitLaterBackward", "_AggWaitBackward", "_UseReplicasBackward"}
    for r, res in enumerate(per_rank):
        assert not ours & res["still"]["nodes"], f"rank {r}: {sorted(ours & res['still']['nodes'])}"
        assert res["still"]["nodes"] == res["plain"]["nodes"], f"rank {r}: the graph differs from the plain run's"
        assert {"_AggWaitLaterBackward", "_UseReplicasBackward"} <= res["flight"]["nodes"], f"rank {r}"


def test_the_anchor_starts_the_first_trans_and_waits_the_first_agg(per_rank):
    """With an anchor (mode "flight": the embedding) the first MoE layer's Agg wait hangs on the anchor's
    output (no `_AggWait` on the layer's input) and its Trans is under way when the layer's forward starts;
    without one (mode "end") the layer starts its own Trans and `_AggWait` sits on its input."""
    for r, res in enumerate(per_rank):
        flight, end = res["flight"], res["end"]
        assert "_AggWaitBackward" not in flight["nodes"] and "_AggWaitBackward" in end["nodes"], f"rank {r}"
        assert flight["started"] == [True] * (MICRO * (ITERS - 1)), f"rank {r}: {flight['started']}"
        assert end["started"] == [False] * (MICRO * (ITERS - 1)), f"rank {r}: {end['started']}"


def test_trans_and_agg_are_complete_when_their_consumer_reads_them(per_rank):
    owner, replica = per_rank[0]["exchange"], per_rank[1]["exchange"]
    for got, sent in zip(replica["reps"], owner["own0"]):
        assert got.shape[0] == 1 and torch.equal(got[0], sent)
    assert all(t.shape[0] == 0 for t in owner["reps"])  # the owner holds no replica
    for g in owner["agg"]:  # the replica's gradient (rank 1 sent its EP rank + 3) summed into expert 0 only
        assert g is not None and torch.all(g[0] == 4.0) and torch.all(g[1:] == 0.0)
    assert replica["agg"] == [None] * 4


def test_runtime_calibrates_then_plans_with_the_fit(per_rank):
    none = tuple(() for _ in range(E))
    for r, res in enumerate(per_rank):
        calib = res["calib"]
        fitted = calib["fitted"]
        assert fitted is not None and fitted == per_rank[0]["calib"]["fitted"], f"rank {r}: {fitted}"
        # installed after iteration 1: the uncalibrated model's plan; after 2: no placement (calibration);
        # after 3 (the fit) and 4: the fitted model's
        assert calib["plans"][1] == [none, none]
        assert calib["plans"][-1] == calib["expected_last"], f"rank {r}: the last plan is not the fitted model's"
        assert calib["counts"] == calib["reference"]


def test_gradients_with_replicas_in_two_layers_equal_the_run_without(per_rank):
    for r, res in enumerate(per_rank):
        ref = res["still"]["grads"]
        for mode in ("flight", "end", "calib"):
            got = res[mode]["grads"]
            assert got.keys() == ref.keys()
            for name, t in ref.items():
                err = (got[name] - t).abs().max().item()
                assert err < 1e-5, f"rank {r} {mode}: gradient of {name} differs by {err:.3g}"
