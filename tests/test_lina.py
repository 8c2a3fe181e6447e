"""Lina (--lina): micro-op gradient all-reduce that yields to all-to-all.

One 4-process spawn (EP2: dense DP 4, expert-DP 2; a module fixture) runs
  * a 20-iteration SGD-momentum training of the tiny model with plain
    GradSync, with Lina (micro-ops of 4 KiB, so most gradients are split) and
    with Lina's coalesced micro-ops (equal 4 KiB slices spanning tensors): the
    loss curves, the first gradients and the final weights must agree, and
    the micro-ops' sizes and order are the same on every rank and iteration;
  * a heavy scenario (~10 MB of dense gradients, 1 MB buckets, every
    all-to-all slowed by 20 ms) with plain GradSync, with Lina, and with
    Lina's queue but no priority: from the event log, Lina launches nothing
    while an all-to-all is in flight and at most `max_in_flight`
    micro-ops overlap any all-to-all, while the plain run and the
    no-priority run do overlap;
  * Parm's S1 and S2 under MP2 x EP2, with and without Lina;
  * a stalled peer: the last rank joins an all-reduce late and the others
    get the --comm-timeout error;
  * 16 micro-ops queued at once and drained: more than one is in flight.
The tests below check the results of that spawn, one behaviour each.
"""

import time

import pytest
import torch
import torch.distributed as dist

from equivalence import MICRO_BATCH, tiny_config
from megatron_moe.distributed import observer as events
from megatron_moe.distributed.grad_sync import LINA_GROUPS, GradSync, grad_group_kind
from megatron_moe.distributed.lina import CommTimeoutError, LinaScheduler
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.testing import spawn

ITERS = 20
SMALL_MB = 4096 / 2**20  # 4 KiB micro-ops: 1024 fp32 elements
HEAVY_MB = 0.25
A2A_DELAY_S = 0.02
MAX_IN_FLIGHT = 4  # LinaScheduler's default


def heavy_config():
    """Blocks: dense, MoE (2 experts), dense; M=256, H=2048: ~10 MB of dense gradients."""
    cfg = tiny_config(k=1, cf=1.0, num_experts=2)
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 3, 256, 2048
    return cfg


def batch(it: int, ps, seq: int = 16, vocab: int = 100):
    """This data-parallel rank's micro-batch of iteration `it` (ids, labels) [MICRO_BATCH, seq]."""
    g = torch.Generator().manual_seed(1000 + it)
    ids = torch.randint(0, vocab, (ps.size("dp") * MICRO_BATCH, seq + 1), generator=g)
    r = ps.rank("dp")
    ids = ids[r * MICRO_BATCH : (r + 1) * MICRO_BATCH]
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def train(cfg, ps, scheduler, iters: int, bucket_mb: float = 0.01, log=None):
    """SGD-momentum loop with GradSync over two alternating batches. Returns losses, first
    gradients, final params, each iteration's events of `log` (lists) and the model."""
    model = GPT2MoE(cfg, ps)
    sync = GradSync(model, ps, bucket_mb=bucket_mb, scheduler=scheduler)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses, first_grads, per_iter_events = [], None, []
    for it in range(iters):
        ids, labels = batch(it % 2, ps)
        opt.zero_grad(set_to_none=True)
        lm, aux = model(ids, labels)
        (lm + aux).backward()
        sync.finish()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append((lm + aux).item())
        if log is not None:
            per_iter_events.append(log.snapshot())
            log.clear()
    sync.remove()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, first_grads, params, per_iter_events, model


def expected_micro_ops(model, ps, partition_mb: float) -> list[tuple[str, int, int, int]]:
    """(group, bytes, part, parts) of every micro-op of one iteration, in the order Lina launches:
    parameters in reverse registration order, each split into chunks of partition_mb."""
    per = int(partition_mb * 2**20) // 4
    out = []
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        kind = grad_group_kind(p)
        if ps.size(kind) == 1:
            continue
        n = p.numel()
        parts = -(-n // per)
        out += [(LINA_GROUPS[kind], 4 * (min(n, (j + 1) * per) - j * per), j, parts) for j in range(parts)]
    return out


def expected_coalesced(model, ps, partition_mb: float) -> list[tuple[str, int]]:
    """(group, bytes) of every coalesced micro-op of one iteration: equal slices of the gradients
    in reverse registration order, a new run whenever the group changes."""
    per = int(partition_mb * 2**20) // 4
    out, kind_open, fill = [], None, 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        kind = grad_group_kind(p)
        if ps.size(kind) == 1:
            continue
        if kind != kind_open and fill:
            out.append((LINA_GROUPS[kind_open], 4 * fill))
            fill = 0
        kind_open, n = kind, p.numel()
        while n:
            take = min(per - fill, n)
            fill, n = fill + take, n - take
            if fill == per:
                out.append((LINA_GROUPS[kind], 4 * per))
                fill = 0
    if fill:
        out.append((LINA_GROUPS[kind_open], 4 * fill))
    return out


def slow_all_to_all(delay: float):
    """Make every all-to-all of this process take `delay` seconds longer (returns an undo)."""
    real = dist.all_to_all_single

    def slow(*args, **kwargs):
        time.sleep(delay)
        return real(*args, **kwargs)

    dist.all_to_all_single = slow
    return lambda: setattr(dist, "all_to_all_single", real)


def overlap_facts(evs: list) -> dict:
    """From one iteration's events: gradient all-reduces launched during an all-to-all, the largest
    number / bytes of them overlapping one all-to-all, and micro-ops held back during one."""
    a2a = sorted([e for e in evs if e.op == "all_to_all" and e.phase == "bwd"], key=lambda e: e.seq)
    grads = sorted([e for e in evs if e.op == "all_reduce" and e.tag in events.GRAD_TAGS], key=lambda e: e.seq)
    per_a2a = [events.overlapping(grads, a) for a in a2a]
    held = [e for e in grads if e.queued is not None and any(e.queued < a.launch and e.launch > a.finish for a in a2a)]
    return {
        "n_a2a": len(a2a),
        "launched_during": len(events.launched_during(grads, a2a)),
        "max_overlap_ops": max((len(o) for o in per_a2a), default=0),
        "max_overlap_bytes": max((sum(e.nbytes for e in o) for o in per_a2a), default=0),
        "held_back": len(held),
    }


class Recorder(LinaScheduler):
    """A LinaScheduler that records the notifications it gets, in order."""

    def __init__(self):
        super().__init__(1.0, 60.0)
        self.calls = []

    def a2a_imminent(self):
        self.calls.append("imminent")
        super().a2a_imminent()

    def moe_backward_done(self):
        self.calls.append("done")
        super().moe_backward_done()

    def a2a_start(self, group):
        self.calls.append(f"start:{group}")
        super().a2a_start(group)

    def a2a_end(self, group, event=None):
        self.calls.append(f"end:{group}")
        super().a2a_end(group, event)


def notifications(cfg, ps) -> dict:
    """The scheduler notifications of one forward and one backward of a model with 2 MoE layers."""
    model = GPT2MoE(cfg, ps)
    rec = Recorder()
    rec.attach(model)
    ids, labels = batch(0, ps)
    lm, aux = model(ids, labels)
    fwd = list(rec.calls)
    rec.calls.clear()
    (lm + aux).backward()
    bwd = list(rec.calls)
    rec.close()
    return {"fwd": fwd, "bwd": bwd}


def _four_ranks(rank, world):
    ps = initialize_model_parallel(1, 2, 1)
    try:
        out = {}
        cfg = tiny_config(k=1)
        cfg4 = tiny_config(k=1)
        cfg4.model.num_layers = 4  # MoE blocks 1 and 3
        out["notifications"] = notifications(cfg4, ps)
        out["plain"] = train(cfg, ps, None, ITERS)[:3]
        lina = LinaScheduler(SMALL_MB, 60.0)
        losses, grads, params, evs, model = train(cfg, ps, lina, ITERS, log=lina.log)
        out["lina"] = (losses, grads, params)
        out["lina_summary"] = lina.summary()
        out["micro_ops"] = [
            [
                (e.group, e.nbytes, e.info["part"], e.info["parts"])
                for e in sorted(it_evs, key=lambda e: e.seq)
                if e.tag == "lina"
            ]
            for it_evs in evs
        ]
        out["expected_micro_ops"] = expected_micro_ops(model, ps, SMALL_MB)
        lina = LinaScheduler(SMALL_MB, 60.0, coalesce=True)
        losses, grads, params, evs, model = train(cfg, ps, lina, ITERS, log=lina.log)
        out["coalesced"] = (losses, grads, params)
        out["coalesced_ops"] = [
            [(e.group, e.nbytes) for e in sorted(it_evs, key=lambda e: e.seq) if e.tag == "lina"] for it_evs in evs
        ]
        out["expected_coalesced"] = expected_coalesced(model, ps, SMALL_MB)
        undo = slow_all_to_all(A2A_DELAY_S)
        try:
            heavy = heavy_config()
            for mode in ("plain", "lina", "no_priority"):
                sched = None if mode == "plain" else LinaScheduler(HEAVY_MB, 60.0, prioritize=mode == "lina")
                log = sched.log if sched is not None else events.CommLog().start()
                *_, evs, _ = train(heavy, ps, sched, 2, bucket_mb=1.0, log=log)
                log.stop()
                out[f"heavy_{mode}"] = [overlap_facts(e) for e in evs]
        finally:
            undo()
        # Parm's schedules under MP2 x EP2 (their all-to-all runs over EP x ESP)
        destroy_model_parallel()
        ps = initialize_model_parallel(2, 2, 1)
        for sched_name in ("s1", "s2"):
            cfg = tiny_config(k=2, schedule=sched_name)
            plain = train(cfg, ps, None, 3)
            lina = LinaScheduler(SMALL_MB, 60.0)
            got = train(cfg, ps, lina, 3, log=lina.log)
            out[f"parm_{sched_name}"] = (plain[:2], got[:2], [overlap_facts(e) for e in got[3]])
        out["stall"] = stalled_peer(rank, world, timeout_s=0.5, stall_s=2.0)
        out["concurrent"] = concurrent_micro_ops()
        return out
    finally:
        destroy_model_parallel()


def stalled_peer(rank: int, world: int, timeout_s: float, stall_s: float):
    """The last rank joins a world all-reduce `stall_s` late; the others' drain() must raise
    CommTimeoutError after `timeout_s`. Returns (error text or None, reduced value)."""
    sched = LinaScheduler(1.0, timeout_s)
    t = torch.full((1000,), float(rank + 1))
    if rank == world - 1:
        time.sleep(stall_s)
    sched.submit("dp", t, dist.group.WORLD)
    err = None
    try:
        sched.drain()
    except CommTimeoutError as e:
        err = str(e)
    sched.close()
    dist.barrier()  # the late peer has joined: no process exits with the all-reduce pending
    return err, t[0].item()


def concurrent_micro_ops(parts: int = 16) -> tuple:
    """Queue `parts` micro-ops behind an imminent all-to-all, then drain (nothing more is coming):
    returns (the most micro-ops in flight at once, launch order of the chunks, the reduced tensor)."""
    sched = LinaScheduler(1024 * 4 / 2**20, 60.0)  # 1024-element micro-ops
    t = torch.full((parts * 1024,), float(dist.get_rank() + 1))
    sched.a2a_imminent()
    sched.submit("dp", t, dist.group.WORLD)
    sched.drain()
    order = [e.info["part"] for e in sorted(sched.log.snapshot(), key=lambda e: e.seq) if e.tag == "lina"]
    sched.close()
    return sched.max_concurrent, order, t


@pytest.fixture(scope="module")
def ranks():
    """Per-rank results of one 4-process spawn (EP2: dense DP 4, expert-DP 2)."""
    return spawn(_four_ranks, 4, timeout=300)


def test_lina_training_curve_and_gradients_match_plain(ranks):
    # fp32 round-off only: gloo may add the ranks' values in another order per chunk
    for rank, r in enumerate(ranks):
        pl, gl, wl = r["plain"]
        ll, gg, ww = r["lina"]
        assert len(ll) == ITERS
        assert pl[-1] < pl[0] - 0.2, f"the curve must actually move: {pl}"
        for i, (a, b) in enumerate(zip(pl, ll)):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), f"rank {rank} iteration {i}: loss {a} vs lina {b}"
        for name in gl:
            torch.testing.assert_close(gg[name], gl[name], rtol=1e-5, atol=1e-7, msg=f"grad {name}")
            torch.testing.assert_close(ww[name], wl[name], rtol=1e-5, atol=1e-6, msg=f"param {name}")


def test_micro_op_sizes_and_order_same_on_every_rank(ranks):
    expected = ranks[0]["expected_micro_ops"]
    assert any(parts > 1 for *_, parts in expected), "the partition must split some tensors"
    assert {g for g, *_ in expected} == {"lina_dp", "lina_expert_dp"}  # Lina's own communicators
    for rank, r in enumerate(ranks):
        assert r["expected_micro_ops"] == expected
        assert len(r["micro_ops"]) == ITERS
        for it, ops in enumerate(r["micro_ops"]):
            assert ops == expected, f"rank {rank} iteration {it}: micro-op sizes or order differ"


def test_end_of_run_summary_counts_every_collective(ranks):
    expected = ranks[0]["expected_micro_ops"]
    for r in ranks:
        s = r["lina_summary"]
        assert s["iterations"] == ITERS and s["partition_mb"] == SMALL_MB
        assert s["n_grad_allreduce"] == ITERS * len(expected)
        assert s["grad_allreduce_bytes"] == ITERS * sum(nbytes for _, nbytes, *_ in expected)
        assert s["n_a2a"] == ITERS * 4  # one MoE layer: 2 forward + 2 backward
        assert s["launched_during_a2a"] == 0
        assert s["a2a_bwd_ms"] > 0 and s["grad_allreduce_ms"] > 0


def test_lina_launches_nothing_while_all_to_all_in_flight(ranks):
    for rank, r in enumerate(ranks):
        for facts in r["heavy_lina"]:
            assert facts["n_a2a"] == 2, facts
            assert facts["launched_during"] == 0, f"rank {rank}: launched during an all-to-all: {facts}"
            # what overlaps an all-to-all is what was already on the wire when it started: at most
            # `max_in_flight` micro-ops (the launch budget keeps it lower when one is near)
            assert facts["max_overlap_ops"] <= MAX_IN_FLIGHT, f"rank {rank}: {facts}"
            assert facts["max_overlap_bytes"] <= MAX_IN_FLIGHT * int(HEAVY_MB * 2**20), f"rank {rank}: {facts}"
    # not vacuous: micro-ops were queued before an all-to-all and waited until it ended
    assert sum(f["held_back"] for r in ranks for f in r["heavy_lina"]) > 0


@pytest.mark.parametrize("schedule", ["s1", "s2"])
def test_lina_composes_with_parm_schedules(ranks, schedule):
    for rank, r in enumerate(ranks):
        (pl, pg), (ll, lg), facts = r[f"parm_{schedule}"]
        for a, b in zip(pl, ll):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), f"rank {rank}: loss {a} vs lina {b}"
        for name in pg:
            torch.testing.assert_close(lg[name], pg[name], rtol=1e-5, atol=1e-7, msg=f"grad {name}")
        for f in facts:
            assert f["n_a2a"] >= 2 and f["launched_during"] == 0, f


def test_same_scenario_overlaps_without_lina(ranks):
    plain = [f for r in ranks for f in r["heavy_plain"]]
    assert max(f["max_overlap_bytes"] for f in plain) > int(HEAVY_MB * 2**20), plain
    no_priority = [f for r in ranks for f in r["heavy_no_priority"]]
    assert sum(f["launched_during"] for f in no_priority) > 0, no_priority


def test_stalled_peer_raises_comm_timeout(ranks):
    for rank, r in enumerate(ranks[:-1]):
        err, _ = r["stall"]
        assert err is not None and "--comm-timeout 0.5 s" in err and "micro-op #0" in err, err
    err, value = ranks[-1]["stall"]
    assert err is None and value == 1 + 2 + 3 + 4  # the late peer still completes the all-reduce


def test_moe_backward_notifies_before_and_after_its_all_to_alls(ranks):
    layer = ["imminent", "start:ep", "end:ep", "start:ep", "end:ep", "done"]
    for r in ranks:
        assert r["notifications"]["fwd"] == ["start:ep", "end:ep"] * 4  # no notification in forward
        assert r["notifications"]["bwd"] == layer * 2  # one per MoE layer


def test_several_micro_ops_in_flight_when_no_all_to_all_is_coming(ranks):
    for rank, r in enumerate(ranks):
        most, order, t = r["concurrent"]
        assert order == list(range(16)), f"rank {rank}: launch order {order}"
        assert 1 < most <= MAX_IN_FLIGHT, f"rank {rank}: {most} micro-ops in flight at most"
        assert torch.equal(t, torch.full_like(t, 1.0 + 2 + 3 + 4))


def test_coalesced_micro_ops_keep_the_curve_and_are_equal_slices_in_the_same_order(ranks):
    expected = ranks[0]["expected_coalesced"]
    per = int(SMALL_MB * 2**20)
    assert len(expected) < len(ranks[0]["expected_micro_ops"]), "coalescing must merge some tensors"
    # every micro-op is full but the last of each run of one group
    for i, (g, b) in enumerate(expected):
        assert b == per or i == len(expected) - 1 or expected[i + 1][0] != g, expected
    for rank, r in enumerate(ranks):
        pl, gl, wl = r["plain"]
        cl, cg, cw = r["coalesced"]
        for i, (a, b) in enumerate(zip(pl, cl)):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), f"rank {rank} iteration {i}: loss {a} vs coalesced {b}"
        for name in gl:
            torch.testing.assert_close(cg[name], gl[name], rtol=1e-5, atol=1e-7, msg=f"grad {name}")
            torch.testing.assert_close(cw[name], wl[name], rtol=1e-5, atol=1e-6, msg=f"param {name}")
        assert r["expected_coalesced"] == expected
        for it, ops in enumerate(r["coalesced_ops"]):
            assert ops == expected, f"rank {rank} iteration {it}: coalesced micro-ops differ"
