"""Lina's launch rule under Lancet's partitioned MoE (--lina with --lancet-partition).

Lina's rule: no gradient all-reduce micro-op is *launched* while an all-to-all of this rank is
queued (backward reached a combine step) or in flight. With Lancet's partitions the MoE block
runs in k parts, each with its own dispatch and combine all-to-alls (`lancet.partitioned_moe`),
so backward issues k times as many all-to-alls, and each must hold the micro-ops back.

One 2-process spawn (EP2) trains the heavy model of tests/test_lina.py (~10 MB of dense
gradients, every all-to-all slowed by 20 ms so that micro-ops are waiting when they come) for two
iterations with block 1's FFN half partitioned in 2 parts, once with Lina and once with Lina's
queue without the priority rule (the control: there micro-ops do launch during all-to-alls, so
the check can see a violation), plus an unpartitioned Lina run for the all-to-all count. The
facts come from the collective observer's events, as in tests/test_lina.py.
"""

import torch

from megatron_moe.distributed.grad_sync import GradSync
from megatron_moe.distributed.lina import LinaScheduler
from megatron_moe.lancet.controller import setup as lancet_setup
from megatron_moe.lancet.partitioned_moe import RangeSpec
from megatron_moe.lancet.planner import LancetPlan
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.testing import spawn
from test_lina import A2A_DELAY_S, HEAVY_MB, batch, heavy_config, overlap_facts, slow_all_to_all

PARTS = 2
ITERS = 2


def _run(cfg, ps, partitioned: bool, prioritize: bool) -> list[dict]:
    """Per iteration: `overlap_facts` of the backward events plus micro-op and queued counts."""
    model = GPT2MoE(cfg, ps)
    sched = LinaScheduler(HEAVY_MB, 60.0, prioritize=prioritize)
    sync = GradSync(model, ps, bucket_mb=1.0, scheduler=sched)
    plan = LancetPlan.manual([RangeSpec(1, "ln2", "block", PARTS)] if partitioned else [])
    ctl = lancet_setup(model, ps, cfg.opts, plan=plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    try:
        for it in range(ITERS):
            ids, labels = batch(it, ps)
            opt.zero_grad(set_to_none=True)
            sched.log.clear()
            lm, aux = model(ids, labels)
            ctl.backward(lm + aux)
            sync.finish()
            opt.step()
            evs = sched.log.snapshot()
            a2a = [e for e in evs if e.op == "all_to_all" and e.phase == "bwd"]
            facts = overlap_facts(evs)
            facts["n_micro"] = sum(e.op == "all_reduce" and e.tag == "lina" for e in evs)
            facts["n_queued"] = sum(e.queued is not None for e in a2a)
            facts["ranges"] = len(ctl.range_runners)
            out.append(facts)
    finally:
        ctl.remove()
        sync.remove()
    return out


def _on_rank(rank, world):
    ps = initialize_model_parallel(1, 2, 1)
    undo = slow_all_to_all(A2A_DELAY_S)
    try:
        cfg = heavy_config()
        return {
            "plain": _run(cfg, ps, partitioned=False, prioritize=True),
            "lina": _run(cfg, ps, partitioned=True, prioritize=True),
            "no_priority": _run(cfg, ps, partitioned=True, prioritize=False),
        }
    finally:
        undo()
        destroy_model_parallel()


def test_no_micro_op_launches_while_a_partitioned_all_to_all_is_queued_or_in_flight():
    per_rank = spawn(_on_rank, 2, timeout=300)
    for rank, runs in enumerate(per_rank):
        for it, (plain, lina) in enumerate(zip(runs["plain"], runs["lina"])):
            tag = f"rank {rank} iteration {it + 1}"
            assert lina["ranges"] == 1 and plain["ranges"] == 0, tag
            # the parts really ran: each issues its own backward all-to-alls
            assert plain["n_a2a"] > 0 and lina["n_a2a"] == PARTS * plain["n_a2a"], (tag, plain, lina)
            assert lina["n_micro"] > 0 and lina["n_queued"] > 0, (tag, lina)
            assert lina["launched_during"] == 0, (tag, lina)
    # the control: without the priority rule micro-ops do launch during the parts' all-to-alls
    assert sum(f["launched_during"] for r in per_rank for f in r["no_priority"]) > 0, [
        r["no_priority"] for r in per_rank
    ]
