"""Lancet's deferred dW on the MoE layer's kept-row paths equals the plain run on the same path.

Before, --lancet-wgrad forced the experts onto the padded batched GEMMs (every capacity slot,
no expert pipelining), so `dw` alone ran more compute than `none` and lost the "overlap"
pipeline. Now the grouped MLP ("kept") and the exchanged MLP ("overlap": all-to-alls
pipelined by local expert) hand their weight-gradient GEMMs to the runtime, and the exchange's
backward opens the dW windows of its two gradient all-to-alls. One spawn of 2 ranks (EP2),
the 4-block model of test_lancet_runtime (capacity 0.5: tokens drop): per path, dW alone is
bitwise equal to the plain run on that path (same GEMM calls), every assigned dW ran in a
window and none at the end, and the experts' dW ran once each; with partitioning too ("both",
whose parts now compute kept rows only) it is equal up to float rounding, and each weight the
parts use several times gets one dW GEMM over all parts' rows.
"""

from test_lancet_runtime import MICRO, compare, config, one_run, ranges_for, synthetic_costs

from megatron_moe.lancet.planner import LancetPlan, make_plan
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.testing import spawn

PATHS = ("kept", "overlap")


def _run(rank: int, world: int) -> dict:
    costs, comm = synthetic_costs()
    ps = initialize_model_parallel(1, 2, 1)
    out: dict = {}
    try:
        for path in PATHS:
            cfg = config(1, "position")
            cfg.moe.moe_kept_only, cfg.moe.moe_expert_path = True, path
            ref = one_run(cfg, ps, None)
            wg = make_plan(
                GPT2MoE(cfg, ps), ps, cfg.opts, MICRO, 8, wgrad=True, partition=False, costs=costs, comm=comm
            )
            for mode, plan in (
                ("wgrad", LancetPlan.manual([], wg.assignment)),
                ("both", LancetPlan.manual(ranges_for(1, "position"), wg.assignment)),
            ):
                res = one_run(cfg, ps, plan)
                out[(path, mode)] = dict(compare(ref, res), stats=res["stats"], assigned=wg.assignment)
    finally:
        destroy_model_parallel()
    return out


def test_deferred_dw_on_kept_row_paths_matches_the_plain_run():
    per_rank = spawn(_run, 2, timeout=300)
    for rank, cases in enumerate(per_rank):
        for path in PATHS:
            w, b = cases[(path, "wgrad")], cases[(path, "both")]
            tag = f"rank {rank} {path}"
            assert w["dropped"] > 0, f"{tag}: the config must drop tokens"
            assert w["grad"] == 0.0 and w["hidden"] == 0.0 and w["loss"] == 0.0, f"{tag} wgrad: {w}"
            assert b["loss"] < 1e-5 and b["hidden"] < 1e-5 and b["grad"] < 1e-5, f"{tag} both: {b}"
            assert w["slots_equal"] and w["drops_equal"] and b["slots_equal"] and b["drops_equal"], tag
            s = w["stats"]
            experts_assigned = sum(".moe.expert." in n for ws in w["assigned"].values() for n in ws)
            assert experts_assigned > 0, f"{tag}: the plan must assign expert dW to an all-to-all"
            assert s["dw_flushed"] == 0 and s["dw_in_window"] > 0, f"{tag}: {s}"
            assert s["dw_in_window"] + s["dw_immediate"] == sum(s["dw_runs"].values()), f"{tag}: {s}"
            expert_runs = {n: c for n, c in s["dw_runs"].items() if ".moe.expert." in n}
            assert expert_runs == {f"L{l}.moe.expert.fc{i}.dW": 1 for l in (1, 3) for i in (1, 2)}, f"{tag}: {s}"
            assert b["stats"]["dw_flushed"] == 0, f"{tag} both: {b['stats']}"
            # every weight the parts use more than once: one dW GEMM over all parts' rows
            multi = sum(n > 1 for n in b["stats"]["dw_runs"].values())
            assert multi > 0 and b["stats"]["dw_merged"] == multi, f"{tag} both: {b['stats']}"
