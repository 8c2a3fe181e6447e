"""Lancet's runtime equals the plain run: dW scheduling, partition pipelining, both.

One spawn of 4 ranks runs every (layout, gating) case four times on the
same rank: plain (baseline schedule, GradSync hooks), dW scheduling,
partitioning, and both. Each rank compares its own runs: loss, the model's
final hidden states (ln_f output), every synchronized gradient and the slots
of every MoE layer (which tokens were dropped, and where kept ones went).
The 4-block model has MoE blocks 1 and 3; capacity factor 0.5 drops tokens;
micro-batch 3 makes a 2-way split uneven. Under MP2xEP2 the plain run also
uses Parm's S1 and S2 schedules (dW windows then hook their all-to-alls; a
partitioned layer runs Lancet's own data movement). The irregular
all-to-all's recorded bytes must equal the plain run's real (kept) tokens.
"""

import torch

from megatron_moe.config import Config
from megatron_moe.distributed.grad_sync import GradSync
from megatron_moe.distributed.observer import CommLog as CommTracer
from megatron_moe.lancet.controller import setup
from megatron_moe.lancet.cost import CommCostModel
from megatron_moe.lancet.model_ir import Costs, DENSE_OPS, MOE_OPS
from megatron_moe.lancet.partitioned_moe import RangeSpec
from megatron_moe.lancet.planner import LancetPlan, make_plan
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.testing import spawn

MICRO = 3
GATINGS = [(1, "position"), (2, "position"), (1, "batch_prioritized"), (1, "random"), (2, "random")]
LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 2, 1)]  # on 4 ranks: EP2 (x expert-DP 2), EP4, MP2xEP2


def config(k: int, policy: str) -> Config:
    """4 blocks (MoE 1 and 3), M = 32, 4 experts, capacity factor 0.5 (tokens drop), T = 8."""
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.num_layers, m.hidden_size, m.num_attention_heads = 100, 4, 32, 4
    m.ffn_hidden_size, m.seq_length, m.max_position_embeddings = 64, 8, 8
    moe = cfg.moe
    moe.num_experts, moe.moe_router_topk, moe.moe_router_policy = 4, k, policy
    moe.moe_expert_capacity_factor, moe.moe_min_capacity, moe.moe_schedule = 0.5, 1, "baseline"
    moe.moe_z_loss_coeff = 1e-3
    cfg.train.seed, cfg.train.micro_batch_size = 11, MICRO
    return cfg


def synthetic_costs() -> tuple[Costs, CommCostModel]:
    """1 ms per forward op and per dW GEMM; an all-to-all of the test model costs about 3 ms."""
    fwd = {"dense": {op: 1.0 for op in DENSE_OPS}, "moe": {op: 1.0 for op in MOE_OPS}}
    dw = {
        k: 1.0
        for k in (
            "attn.qkv.dW",
            "attn.proj.dW",
            "mlp.fc1.dW",
            "mlp.fc2.dW",
            "moe.gate.dW",
            "head.dW",
            "moe.expert.fc1.dW",
            "moe.expert.fc2.dW",
        )
    }
    return Costs(fwd, dw, 1.0, 1.0, 0.05), CommCostModel([(1.0, 0.5), (4096.0, 3.0)])


def ranges_for(k: int, policy: str) -> list[RangeSpec]:
    """The widest ranges the gate allows: from the attention when the gate can run per part; block 1's
    range spans everything up to block 3's gate (dense block 2 with its FFN, block 3's attention);
    with a per-part gate, block 1's starts at dense block 0 and block 3's runs on through the loss head."""
    if k == 2 or policy == "batch_prioritized":
        return [RangeSpec(1, "gate", "dense_next_attn", 2), RangeSpec(3, "gate", "block", 3)]
    return [RangeSpec(1, "dense", "dense_next_attn", 2), RangeSpec(3, "ln2", "head", 3)]


def one_run(cfg: Config, ps, plan) -> dict:
    """Forward + backward + GradSync of one micro-batch; what the comparisons need."""
    model = GPT2MoE(cfg, ps)
    sync = GradSync(model, ps, bucket_mb=0.01)
    hidden = []
    model.ln_f.register_forward_hook(lambda m, a, o: hidden.append(o.detach().clone()))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 100, (ps.size("dp") * MICRO, 9), generator=g)
    sl = slice(ps.rank("dp") * MICRO, (ps.rank("dp") + 1) * MICRO)
    ctl = setup(model, ps, cfg.opts, plan=plan) if plan is not None else None
    with CommTracer() as tracer:
        lm, aux = model(ids[sl, :-1], ids[sl, 1:])
    loss = lm + aux
    ctl.backward(loss) if ctl is not None else loss.backward()
    sync.finish()
    slots, experts = {}, {}
    for l, b in enumerate(model.blocks):
        if b.is_moe:  # the routes of the whole group (S1's are this rank's slices: not compared)
            routes = b.moe.router.last_routes
            whole = cfg.moe.moe_schedule != "s1"
            slots[l] = torch.cat([r.slot for r in routes]) if whole else None
            experts[l] = torch.cat([r.expert for r in routes]) if whole else None
    drops = {l: b.moe.last_stats["dropped"] for l, b in enumerate(model.blocks) if b.is_moe}
    return {
        "loss": loss.item(),
        "hidden": torch.cat(hidden),  # a range through the loss head runs ln_f part by part
        "slots": slots,
        "experts": experts,
        "drops": drops,
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "stats": ctl.stats() if ctl is not None else None,
        "records": tracer.records,
        "timings": dict(ctl.timings) if ctl is not None else {},
    }


def compare(ref: dict, out: dict) -> dict:
    """Largest differences of a run against the plain run (0 / True when equal)."""
    return {
        "loss": abs(ref["loss"] - out["loss"]),
        "hidden": (ref["hidden"] - out["hidden"]).abs().max().item(),
        "grad": max((ref["grads"][n] - g).abs().max().item() for n, g in out["grads"].items()),
        "slots_equal": all(
            torch.equal(ref["slots"][l], out["slots"][l]) for l in ref["slots"] if ref["slots"][l] is not None
        ),
        "drops_equal": ref["drops"] == out["drops"],
        "dropped": sum(ref["drops"].values()),
    }


def a2a_bytes(ps, ref: dict, out: dict, plan: LancetPlan) -> dict:
    """Forward token all-to-all bytes Lancet recorded vs the real tokens of the plain run's routing."""
    M, E_l, n_esp = 32, 4 // ps.size("ep"), ps.size("esp")
    token_group = "ep" if n_esp == 1 else "ep_esp"
    recs = [r for r in out["records"] if r.op == "all_to_all" and r.group == token_group]
    counts = [r for r in out["records"] if r.op == "all_to_all" and r.group == "ep_counts"]
    got, want, i = [], [], 0
    for r in sorted(plan.ranges, key=lambda r: r.layer):
        k = min(r.k, MICRO)
        disp = recs[i : i + k]  # dispatch messages of the parts, then the returns
        i += 2 * k
        expert, slot = ref["experts"][r.layer], ref["slots"][r.layer]
        kept_ep = expert[slot >= 0] // E_l
        mine = int((kept_ep == ps.rank("ep")).sum())
        remote_rows = (kept_ep.numel() - mine) * n_esp + mine * (n_esp - 1)
        got.append((sum(d.sent for d in disp), sum(d.remote_sent for d in disp)))
        want.append((kept_ep.numel() * n_esp * M * 4, remote_rows * M * 4))
    return {
        "got": got,
        "want": want,
        "n_token_msgs": len(recs),
        "count_bytes": [c.sent for c in counts],
        "count_bytes_per_part": ps.size("ep") * n_esp * E_l * 8,
        "parts": [min(r.k, MICRO) for r in sorted(plan.ranges, key=lambda r: r.layer)],
    }


def _cases(layout) -> list[tuple]:
    """(k, policy, MoE schedule of the plain run) per layout; Parm's S1 / S2 where MP > 1."""
    cases = [(k, policy, "baseline") for k, policy in GATINGS]
    return cases + ([(2, "position", "s1"), (2, "position", "s2")] if layout[0] > 1 else [])


def _run_case(ps, k: int, policy: str, schedule: str, costs, comm) -> dict:
    cfg = config(k, policy)
    cfg.moe.moe_schedule = schedule
    ref = one_run(cfg, ps, None)
    wg = make_plan(GPT2MoE(cfg, ps), ps, cfg.opts, MICRO, 8, wgrad=True, partition=False, costs=costs, comm=comm)
    plans = {
        "wgrad": LancetPlan.manual([], wg.assignment),
        "partition": LancetPlan.manual(ranges_for(k, policy)),
        "both": LancetPlan.manual(ranges_for(k, policy), wg.assignment),
    }
    case = {"k": k, "policy": policy, "schedule": schedule, "assignment": wg.assignment}
    for mode, plan in plans.items():
        res = one_run(cfg, ps, plan)
        case[mode] = compare(ref, res)
        case[mode]["stats"] = res["stats"]
        case[mode]["timed_ranges"] = sorted(res["timings"])
        if mode == "partition" and schedule == "baseline":
            case["bytes"] = a2a_bytes(ps, ref, res, plan)
    return case


def _run_all(rank: int, world: int) -> list:
    out = []
    costs, comm = synthetic_costs()
    for layout in LAYOUTS:
        ps = initialize_model_parallel(*layout)
        try:
            for k, policy, schedule in _cases(layout):
                out.append(dict(_run_case(ps, k, policy, schedule, costs, comm), layout=layout))
            if layout == LAYOUTS[0]:  # a profiled plan through the real planner
                cfg = config(1, "position")
                cfg.opts.lancet_wgrad = cfg.opts.lancet_partition = True
                cfg.opts.lancet_group_ms = 1e-3
                ref = one_run(cfg, ps, None)
                plan = make_plan(GPT2MoE(cfg, ps), ps, cfg.opts, MICRO, 8)
                case = {"layout": layout, "auto": True, "plan": plan.to_json()}
                case["both"] = compare(ref, one_run(cfg, ps, plan))
                out.append(case)
        finally:
            destroy_model_parallel()
    return out


def expected_runs(name: str, per_part_gate: bool) -> int:
    """How often dW `name` runs in mode "both" with `ranges_for`: once per part inside a range."""
    layer = int(name.split(".")[0][1:])
    if layer == 0:  # dense block 0 opens block 1's range when the gate runs per part
        return 2 if per_part_gate else 1
    if layer == 1 and ".moe." in name:
        return 2
    if layer == 1 and ".attn." in name:
        return 2 if per_part_gate else 1
    if layer == 2:  # dense block 2 (attention and FFN) inside block 1's range
        return 2
    if layer == 3 and ".attn." in name:  # block 3's attention closes block 1's range
        return 2
    if layer == 3 and ".moe." in name:
        return 3
    return 1


def _check(per_rank: list) -> None:
    for rank_cases in per_rank:
        for case in rank_cases:
            tag = f"{case['layout']} " + (
                "auto plan" if case.get("auto") else f"top-{case['k']} {case['policy']} {case['schedule']}"
            )
            for mode in ("wgrad", "partition", "both"):
                if mode not in case:
                    continue
                c = case[mode]
                assert c["dropped"] > 0, f"{tag}: the config must drop tokens"
                assert c["slots_equal"] and c["drops_equal"], f"{tag} {mode}: kept/dropped tokens or slots differ"
                assert c["loss"] < 1e-5 and c["hidden"] < 1e-5 and c["grad"] < 1e-5, f"{tag} {mode}: {c}"
            if case.get("auto"):
                continue
            # dW scheduling alone changes no arithmetic: bitwise equal
            assert case["wgrad"]["grad"] == 0.0 and case["wgrad"]["hidden"] == 0.0, tag
            for mode in ("wgrad", "both"):  # assigned dW ran under their all-to-alls, none at the end
                s = case[mode]["stats"]
                assert s["dw_in_window"] + s["dw_immediate"] == sum(s["dw_runs"].values()), f"{tag} {mode}: {s}"
                assert s["dw_in_window"] > 0 and s["dw_flushed"] == 0, f"{tag} {mode}: {s}"
            per_part = case["k"] == 1 and case["policy"] != "batch_prioritized"
            runs = case["both"]["stats"]["dw_runs"]
            assert len(runs) == 16, f"{tag}: dW names run {sorted(runs)}"
            for name, n in runs.items():
                assert n == expected_runs(name, per_part), f"{tag}: {name} ran {n} times"
            assert all(n == 1 for n in case["wgrad"]["stats"]["dw_runs"].values())
            assert case["partition"]["timed_ranges"] == [1, 3]
            if case["schedule"] != "baseline":  # S1 / S2 hold no slots to compare byte counts with
                continue
            b = case["bytes"]
            assert b["got"] == b["want"], f"{tag}: irregular all-to-all bytes {b['got']} != real tokens {b['want']}"
            # a dispatch and a return per part (k = 2 and 3); the counts of a range's parts travel together
            # (`UnevenDispatcher.plan_parts`), except that a per-part gate sends part 0's alone first
            assert b["n_token_msgs"] == 2 * (2 + 3), tag
            unit = b["count_bytes_per_part"]
            want = [m * unit for n in b["parts"] for m in ([1, n - 1] if per_part and n > 1 else [n])]
            assert b["count_bytes"] == want, f"{tag}: count messages {b['count_bytes']} != {want}"


def test_lancet_modes_match_plain_run():
    per_rank = spawn(_run_all, 4, timeout=600)
    _check(per_rank)
    for cases in zip(*per_rank):  # plans are the same on every rank
        key = "plan" if cases[0].get("auto") else "assignment"
        assert all(c[key] == cases[0][key] for c in cases)
