"""Small behaviour tests that catch the semantic mutations of `tools/mutation_check.py`.

Each test checks one behaviour against an independent reference (hand values,
a one-process run, the same computation done another way). Multi-process
cases run on two gloo ranks in one spawn shared by the module; heavier golden
curves live in the SAA, Lina-gate and random-routing tests.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from equivalence import MICRO_BATCH, global_batch, reference, tiny_config

from megatron_moe.checkpointing import load_checkpoint, save_checkpoint
from megatron_moe.config import Config
from megatron_moe.distributed.grad_sync import GradSync, sync_gradients
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.layers.sharding import assemble, local_pieces
from megatron_moe.optim import (
    build_optimizer,
    clip_gradients,
    global_grad_norm,
    lr_at,
    param_groups,
)
from megatron_moe.parallel_state import (
    destroy_model_parallel,
    initialize_model_parallel,
    local_state,
)
from megatron_moe.testing import spawn

# ----------------------------------------------------------------------------- one process


def _loss_and_grads(model, ids, labels, scale: float = 1.0) -> float:
    """Forward and backward of scale * (lm + aux); returns the unscaled loss."""
    lm, aux = model(ids, labels)
    (scale * (lm + aux)).backward()
    return (lm + aux).item()


def test_random_routing_draws_differ_across_routing_groups_and_calls():
    model = GPT2MoE(tiny_config(policy="random"), local_state(), routing_groups=2)
    layer = model.moe_layers()[0]

    def draws():
        return [torch.rand((64, 4), generator=layer.router.generator(g)) for g in range(2)]

    first = draws()
    assert all(torch.equal(a, b) for a, b in zip(first, draws())), "a group's draws must be reproducible"
    assert not torch.equal(first[0], first[1]), "two routing groups drew the same experts"
    model(*global_batch(2))
    second = draws()
    assert not any(torch.equal(a, b) for a, b in zip(first, second)), "the next call must draw new experts"
    assert not torch.equal(second[0], second[1])


def test_gate_logits_are_fp32_under_bf16_autocast():
    layer = GPT2MoE(tiny_config(), local_state()).moe_layers()[0]
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3), device=layer.router.gate_w.device)
    want = x.double() @ layer.router.gate_w.detach().double().t()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        got = layer.router.logits(x)
    assert got.dtype == torch.float32
    # fp32 round-off is ~1e-7 here; a bf16 matmul is off by ~1e-3
    assert (got.double() - want).abs().max().item() < 1e-5


def test_two_routing_groups_equal_two_separate_calls():
    """Routing groups side by side in one padded buffer (`padded_plan`, what several ranks send) give what each
    group gives on its own (the one-rank plan gathers each token straight into its expert's rows, whatever
    its slot: there the groups could not collide)."""
    cfg = tiny_config(k=2)
    ids, labels = global_batch(2)
    both = GPT2MoE(cfg, local_state(), routing_groups=2)
    for layer in both.moe_layers():
        layer.dispatcher.plan = layer.dispatcher.padded_plan
    loss2 = _loss_and_grads(both, ids, labels)
    dropped2 = both.moe_layers()[0].last_stats["dropped"]
    one = GPT2MoE(cfg, local_state(), routing_groups=1)
    halves, dropped1 = [], 0
    for g in range(2):
        sl = slice(g * MICRO_BATCH, (g + 1) * MICRO_BATCH)
        halves.append(_loss_and_grads(one, ids[sl], labels[sl], scale=0.5))  # grads accumulate the mean
        dropped1 += one.moe_layers()[0].last_stats["dropped"]
    assert dropped1 > 0 and dropped2 == dropped1
    assert abs(loss2 - sum(halves) / 2) < 1e-6
    for (name, a), b in zip(both.named_parameters(), one.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=f"grad of {name}")


def test_clipping_scales_the_gradients_to_max_norm():
    model = GPT2MoE(tiny_config(), local_state())
    _loss_and_grads(model, *global_batch(1))
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in before.values()))
    assert norm > 0.1
    assert clip_gradients(model, local_state(), 0.05) == pytest.approx(norm, rel=1e-9)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, before[n] * (0.05 / norm), rtol=1e-5, atol=0, msg=n)
    assert global_grad_norm(model, local_state()) == pytest.approx(0.05, rel=1e-5)
    clip_gradients(model, local_state(), 1.0)  # below the limit: untouched
    assert global_grad_norm(model, local_state()) == pytest.approx(0.05, rel=1e-5)


def test_weight_decay_skips_biases_layernorms_and_the_position_table():
    model = GPT2MoE(tiny_config(), local_state())
    decay, no_decay = param_groups(model, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    got_no = sorted(names[id(p)] for p in no_decay["params"])
    got_yes = sorted(names[id(p)] for p in decay["params"])
    want_no = sorted(
        n for n in names.values() if n == "wpe" or ".ln" in n or n.startswith("ln_") or n.endswith(("bias", "_b"))
    )
    assert got_no == want_no
    assert got_yes == sorted(set(names.values()) - set(want_no))
    assert "blocks.1.moe.experts.fc_w" in got_yes and "blocks.1.moe.experts.fc_b" in got_no


def test_lr_schedule_warmup_then_decay_to_min_lr():
    o = Config().optim
    o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_iters = 1.0, 0.1, 4, 14
    o.lr_decay_style = "cosine"
    cos = {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 6: 0.1 + 0.45 * (1 + math.cos(0.2 * math.pi)), 9: 0.55, 14: 0.1, 30: 0.1}
    for it, want in cos.items():
        assert lr_at(it, o) == pytest.approx(want, abs=1e-12), f"cosine, iteration {it}"
    o.lr_decay_style = "linear"
    for it, want in {0: 0.25, 4: 1.0, 6: 0.82, 9: 0.55, 14: 0.1, 30: 0.1}.items():
        assert lr_at(it, o) == pytest.approx(want, abs=1e-12), f"linear, iteration {it}"
    o.lr_decay_style = "constant"
    assert [lr_at(it, o) for it in (0, 3, 4, 100)] == pytest.approx([0.25, 1.0, 1.0, 1.0])


def test_checkpoint_restores_optimizer_state_rng_and_routing_draws(tmp_path):
    cfg = tiny_config(policy="random")
    ps = local_state()
    model = GPT2MoE(cfg, ps)
    opt, _ = build_optimizer(model, cfg.optim, torch.device("cpu"))
    for _ in range(2):
        opt.zero_grad()
        _loss_and_grads(model, *global_batch(1))
        opt.step()
    save_checkpoint(str(tmp_path), 2, 8, model, opt, cfg, ps)
    rng_next = torch.rand(8)  # what the saved RNG state draws next
    draws = torch.rand((64, 4), generator=model.moe_layers()[0].router.generator(0))

    torch.manual_seed(1234)
    fresh = GPT2MoE(cfg, ps)
    opt2, _ = build_optimizer(fresh, cfg.optim, torch.device("cpu"))
    meta = load_checkpoint(str(tmp_path), fresh, opt2, ps)
    assert meta["iteration"] == 2 and meta["consumed_samples"] == 8
    assert torch.equal(torch.rand(8), rng_next)
    assert torch.equal(torch.rand((64, 4), generator=fresh.moe_layers()[0].router.generator(0)), draws)
    names = dict(model.named_parameters())
    for n, p in fresh.named_parameters():
        assert torch.equal(p, names[n]), n
        want, got = opt.state[names[n]], opt2.state[p]
        assert set(got) == set(want) == {"step", "exp_avg", "exp_avg_sq"}, n
        for key in want:
            assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), f"{n}/{key}"


# ----------------------------------------------------------------------------- two processes

LAYOUTS = {  # id: (schedule, (mp, ep, esp), GradSync hooks)
    "baseline-MP2xEP2": ("baseline", (2, 2, 1), False),
    "s1-MP2xEP2": ("s1", (2, 2, 1), False),
    "s2-MP2xESP2": ("s2", (2, 1, 2), False),
    "hooks-DP2": ("baseline", (1, 1, 1), True),
    "baseline-EP2": ("baseline", (1, 2, 1), False),
}


def _layout_case(schedule: str, lay: tuple, hooks: bool) -> dict:
    cfg = tiny_config(k=2, schedule=schedule)
    ps = initialize_model_parallel(*lay)
    try:
        model = GPT2MoE(cfg, ps)
        sync = GradSync(model, ps, bucket_mb=0.01) if hooks else None
        ids, labels = global_batch(ps.size("dp"))
        sl = slice(ps.rank("dp") * MICRO_BATCH, (ps.rank("dp") + 1) * MICRO_BATCH)
        lm, aux = model(ids[sl], labels[sl])
        (lm + aux).backward()
        if sync is not None:
            sync.finish()
            sync.remove()
        else:
            sync_gradients(model, ps)
        return {
            "loss": (lm + aux).item(),
            "dp_rank": ps.rank("dp"),
            "grads": local_pieces(model, ps, "grad"),
            "specs": {n: p._shard for n, p in model.named_parameters()},
            "drops": model.moe_layers()[0].last_stats["dropped"],
            "norm": global_grad_norm(model, ps),
        }
    finally:
        destroy_model_parallel()


def _saa_order(rank: int) -> dict:
    from megatron_moe.distributed.saa import a2a_combine_gather
    from megatron_moe.distributed.observer import CommLog

    ps = initialize_model_parallel(2, 2, 1)
    try:
        send = torch.arange(2 * 1 * 6 * 3, dtype=torch.float32).view(2, 1, 6, 3) + 100 * rank  # [D, E_l, N, M]
        with CommLog() as tr:
            saa = a2a_combine_gather(send, ps.group("ep_esp"), ps.group("mp"), 1, overlap=True, chunks=3)
        aas = a2a_combine_gather(send, ps.group("ep_esp"), ps.group("mp"), 1, overlap=False)
        return {"ops": [r.op for r in tr.records], "equal": torch.equal(saa, aas)}
    finally:
        destroy_model_parallel()


def _lina_imminent(rank: int) -> dict:
    from megatron_moe.distributed.observer import CommLog
    from megatron_moe.distributed.lina import LinaScheduler

    log = CommLog()
    sched = LinaScheduler(1.0, 60.0, log_events=log)
    try:
        sched.a2a_imminent()  # backward reached a combine step: an all-to-all is next
        t = torch.full((1000,), float(rank + 1))
        handle = sched.submit("dp", t, None)
        time.sleep(0.5)  # room for a launcher that ignores the gate
        early = [e for e in log.snapshot() if e.tag == "lina"]
        sched.a2a_start("ep")
        sched.a2a_end("ep")  # the all-to-all ran: the gate opens
        handle.wait()
        sched.drain()
        return {"early": len(early), "sum": t[0].item(), "n": len([e for e in log.snapshot() if e.tag == "lina"])}
    finally:
        sched.close()


def _lina_order(rank: int) -> dict:
    from megatron_moe.distributed.observer import CommLog
    from megatron_moe.distributed.lina import LinaScheduler

    ps = initialize_model_parallel(1, 1, 1)
    log = CommLog()
    sched = LinaScheduler(0.002, 60.0, log_events=log)  # 2097-byte micro-ops
    try:
        model = GPT2MoE(tiny_config(), ps)
        sync = GradSync(model, ps, scheduler=sched)
        sched.a2a_imminent()  # hold every micro-op back until drain: the whole queue is there at once
        ids, labels = global_batch(2)
        sl = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
        lm, aux = model(ids[sl], labels[sl])
        (lm + aux).backward()
        sync.finish()
        sync.remove()
        ops = sorted((e for e in log.snapshot() if e.tag == "lina"), key=lambda e: e.seq)
        sizes = [p.numel() * 4 for p in model.parameters()]
        return {"launched": [(e.info["index"], e.nbytes) for e in ops], "sizes": sizes}
    finally:
        destroy_model_parallel()


def _all_cases(rank: int, world: int) -> dict:
    out: dict = {}
    jobs = {f"layout:{k}": (lambda v=v: _layout_case(*v)) for k, v in LAYOUTS.items()}
    jobs.update(
        {
            "saa": lambda: _saa_order(rank),
            "lina_imminent": lambda: _lina_imminent(rank),
            "lina_order": lambda: _lina_order(rank),
        }
    )
    for name, job in jobs.items():
        try:
            out[name] = job()
        except Exception as e:  # noqa: BLE001  (reported by the test of that case)
            import traceback

            out[name] = {"error": f"{e!r}\n{traceback.format_exc()}"}
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_all_cases, 2, timeout=300)


def _case(ranks: list[dict], name: str) -> list[dict]:
    res = [r[name] for r in ranks]
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
    return res


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_process_layout_matches_one_process(two_ranks, layout):
    mp = LAYOUTS[layout][1][0]
    res = _case(two_ranks, f"layout:{layout}")
    dp = 2 // mp
    ref_loss, ref_grads, ref_drops = reference(tiny_config(k=2, schedule="baseline"), dp)
    assert ref_drops[0] > 0, "tokens must drop so that slots matter"
    per_dp = {r["dp_rank"]: r for r in res}
    assert sum(r["drops"] for r in per_dp.values()) == ref_drops[0]
    assert abs(sum(r["loss"] for r in per_dp.values()) / dp - ref_loss) < 1e-5
    for rank, r in enumerate(res):  # every replica, not the first of each
        full = assemble([r["grads"]] + [o["grads"] for o in res if o is not r], r["specs"])
        for name, g in ref_grads.items():
            err = (full[name] - g).abs().max().item()
            assert err < 1e-5, f"{layout} rank {rank}: grad of {name} differs by {err:.3g}"


def test_global_grad_norm_counts_every_element_once(two_ranks):
    for layout in ("baseline-MP2xEP2", "hooks-DP2", "s2-MP2xESP2"):
        mp = LAYOUTS[layout][1][0]
        _, ref_grads, _ = reference(tiny_config(k=2), 2 // mp)
        want = math.sqrt(sum(g.double().pow(2).sum().item() for g in ref_grads.values()))
        for r in _case(two_ranks, f"layout:{layout}"):
            assert r["norm"] == pytest.approx(want, rel=1e-5), layout


def test_saa_sends_the_next_chunk_before_gathering_the_previous_one(two_ranks):
    """Chunk i+1's all-to-all is on the wire before chunk i goes to the MP all-gather (overlap)."""
    for r in _case(two_ranks, "saa"):
        assert r["equal"]
        assert r["ops"] == ["all_to_all", "all_to_all", "all_gather", "all_to_all", "all_gather", "all_gather"]


def test_lina_launches_nothing_once_an_all_to_all_is_imminent(two_ranks):
    for r in _case(two_ranks, "lina_imminent"):
        assert r["early"] == 0, "a micro-op launched while an all-to-all was imminent"
        assert r["n"] == 1 and r["sum"] == 3.0  # then it ran, once, and summed both ranks


def test_lina_micro_ops_follow_reverse_parameter_order(two_ranks):
    for r in _case(two_ranks, "lina_order"):
        per = 2097 // 4 * 4  # bytes of a full micro-op of fp32
        want = [min(per, n - off) for n in reversed(r["sizes"]) for off in range(0, n, per)]
        assert [nbytes for _, nbytes in r["launched"]] == want
        assert [i for i, _ in r["launched"]] == list(range(len(want)))
