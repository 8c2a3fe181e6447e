"""Dropless MoE (--moe-dropless): nothing dropped, only real tokens travel, every layout equals
the one-process dropless reference, refused combinations name both flags.

One spawn per world size runs its layouts (top-1 and top-2, baseline and S1) plus the
byte count of the EP2 x ESP2 run; the parent computes the references and compares.
"""

import pytest
import torch

from equivalence import MICRO_BATCH, compare, global_batch, reference, run_layout, tiny_config
from megatron_moe import optimizations
from megatron_moe.arguments import parse_args
from megatron_moe.config import MoEConfig
from megatron_moe.distributed.observer import CommLog
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.dispatcher import UnevenDispatcher
from megatron_moe.moe.router import route
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel, local_state
from megatron_moe.testing import spawn
from megatron_moe.training import Trainer
from tiny_run import tiny_args

# (mp, ep, esp, schedule): MP2, EP2, ESP2, DP2 (+ MP2 under S1); MP2xEP2, EP2xESP2
LAYOUTS = {
    2: [(2, 1, 1, "baseline"), (1, 2, 1, "baseline"), (1, 1, 2, "baseline"), (1, 1, 1, "baseline"), (2, 1, 1, "s1")],
    4: [(2, 2, 1, "baseline"), (1, 2, 2, "baseline")],
}
BYTES_LAYOUT = (1, 2, 2)  # EP2 x ESP2: every token travels once per ESP shard


def dropless_config(k: int, schedule: str = "baseline"):
    return tiny_config(k, schedule=schedule, moe_dropless=True)


# ----------------------------------------------------------------------------- (a) router and plan


@pytest.mark.parametrize("k", [1, 2])
def test_skewed_gate_drops_nothing_and_plans_every_choice_once(k):
    S, E = 12, 4
    logits = torch.zeros(S, E)
    logits[:, 0], logits[:, 1] = 6.0, 3.0 + torch.arange(S) / S  # every token: expert 0 first, 1 second
    capped = route(logits, k, 1.0, 1)
    assert capped.num_dropped == k * (S - capped.capacity)  # the capacity router drops...
    r = route(logits, k, 1.0, 1, dropless=True)
    assert r.num_dropped == 0 and r.capacity == S  # ...the dropless one keeps all
    assert r.counts.tolist() == ([S, 0, 0, 0] if k == 1 else [S, S, 0, 0])
    gates = torch.softmax(logits, -1)
    chosen = gates[:, :k]
    expect_w = chosen if k == 1 else chosen / chosen.sum(dim=1, keepdim=True)
    assert torch.allclose(r.weight, expect_w)
    assert torch.allclose(r.aux_loss, capped.aux_loss)  # aux loss unchanged
    plan = UnevenDispatcher(local_state(), E, 0).plan([r])
    assert sorted(plan.token.tolist()) == sorted(list(range(S)) * k)  # every choice exactly once
    assert plan.expert_rows == r.counts.tolist()  # ragged: no padding rows
    # dispatch then combine: each token's weighted sum of its rows (identity for top-2)
    x = torch.randn(S, 8)
    d = UnevenDispatcher(local_state(), E, 0)
    x_in = d.dispatch(x, plan)
    assert x_in.shape == (k * S, 8)
    y = d.combine(x_in, plan)
    assert torch.allclose(y, x * r.weight.sum(dim=1, keepdim=True), atol=1e-6)


# ----------------------------------------------------------------------------- (b) + (c) layouts, bytes


def _bytes_run(k: int) -> dict:
    """EP2 x ESP2 forward + backward under a CommLog: this rank's EP / DP rank and all-to-all bytes."""
    mp, ep, esp = BYTES_LAYOUT
    ps = initialize_model_parallel(mp, ep, esp)
    try:
        model = GPT2MoE(dropless_config(k), ps)
        ids, labels = global_batch(ps.size("dp"))
        r = ps.rank("dp")
        with CommLog() as log:
            lm, aux = model(
                ids[r * MICRO_BATCH : (r + 1) * MICRO_BATCH], labels[r * MICRO_BATCH : (r + 1) * MICRO_BATCH]
            )
            (lm + aux).backward()
        a2a = [(e.phase, e.sent, e.recv) for e in log.records if e.op == "all_to_all"]
        return {"ep": ps.rank("ep"), "dp": r, "a2a": a2a}
    finally:
        destroy_model_parallel()


def _run_all(rank, world, cases):
    out = [run_layout(dropless_config(k, schedule), mp, ep, esp) for (mp, ep, esp, schedule), k in cases]
    if world == 4:
        out.append({k: _bytes_run(k) for k in (1, 2)})
    return out


def _check_bytes(per_rank: list, k: int) -> None:
    """Token all-to-alls move exactly the routed choices: sent k * T rows per ESP shard, received the
    tokens routed to this rank's experts (from the one-process reference's routes), M fp32 each."""
    cfg = dropless_config(k)
    mp, ep, esp = BYTES_LAYOUT
    dp, E, M = 4 // mp, cfg.moe.num_experts, cfg.model.hidden_size
    model = GPT2MoE(cfg, local_state(), routing_groups=dp)
    ids, labels = global_batch(dp)
    model(ids, labels)
    routes = model.moe_layers()[0].router.last_routes  # one per DP rank's micro-batch
    assert len(model.moe_layers()) == 1
    E_l, T, row = E // ep, MICRO_BATCH * cfg.model.seq_length, M * 4
    counts_bytes = ep * esp * E_l * 8  # the count exchange, int64 [D, E_l]
    for res in per_rank:
        mine = sum(
            int(torch.isin(r.expert, torch.arange(res["ep"] * E_l, (res["ep"] + 1) * E_l)).sum()) for r in routes
        )  # every source's tokens to my experts
        sent = k * T * esp  # all my choices, once per ESP shard
        fwd = sorted((s, rv) for ph, s, rv in res["a2a"] if ph == "fwd")
        bwd = sorted((s, rv) for ph, s, rv in res["a2a"] if ph == "bwd")
        expect = sorted([(counts_bytes, counts_bytes), (sent * row, mine * row), (mine * row, sent * row)])
        assert fwd == expect, f"top-{k} EP{res['ep']} DP{res['dp']}: forward all-to-alls {fwd} != {expect}"
        assert bwd == sorted([(sent * row, mine * row), (mine * row, sent * row)]), f"top-{k}: backward {bwd}"


@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_matches_one_process_dropless_reference(world):
    cases = [(layout, k) for layout in LAYOUTS[world] for k in (1, 2)]
    per_rank = spawn(_run_all, world, cases, timeout=600)
    refs = {}
    for i, ((mp, ep, esp, schedule), k) in enumerate(cases):
        dp = world // mp
        if (dp, k) not in refs:
            refs[(dp, k)] = reference(dropless_config(k), dp)
            assert refs[(dp, k)][2] == [0], "dropless drops nothing"
            assert reference(tiny_config(k), dp)[2][0] > 0, "the capacity router must drop in this config"
        compare(
            [per_rank[r][i] for r in range(world)],
            refs[(dp, k)],
            f"dropless P={world} MP{mp} EP{ep} ESP{esp} {schedule} top-{k}",
        )
    if world == 4:
        for k in (1, 2):
            _check_bytes([per_rank[r][-1][k] for r in range(world)], k)


# ----------------------------------------------------------------------------- (d) refusals


def test_refused_combinations_name_both_flags():
    with pytest.raises(ValueError, match="--moe-dropless.*--moe-schedule s2"):
        MoEConfig(moe_dropless=True, moe_schedule="s2")
    with pytest.raises(ValueError, match="--moe-dropless.*--moe-schedule s2"):
        GPT2MoE(tiny_config(1, schedule="s2", moe_dropless=True), local_state())
    for flag in ("lancet_partition", "lancet_wgrad"):
        cfg = dropless_config(1)
        setattr(cfg.opts, flag, True)
        with pytest.raises(ValueError, match=f"--moe-dropless cannot be combined with --{flag.replace('_', '-')}"):
            optimizations.check_combination(cfg)
    optimizations.check_combination(dropless_config(2, "s1"))  # allowed: no error
    cfg = tiny_config(1)
    cfg.opts.lancet_partition = True
    optimizations.check_combination(cfg)  # Lancet without dropless: fine


# ----------------------------------------------------------------------------- (e) the trainer


def _train(rank, world, argv):
    trainer = Trainer(parse_args(argv))
    hist = trainer.train()
    return [(h["loss"], h["dropped_frac"]) for h in hist], trainer.applied.changes


def test_trainer_dropless_ep2_with_lina_matches_one_process(sample_data):
    ref, _ = _train(0, 1, tiny_args(sample_data, 3, "--moe-dropless"))
    per_rank = spawn(
        _train,
        2,
        tiny_args(
            sample_data, 3, "--moe-dropless", "--expert-model-parallel-size", "2", "--moe-schedule", "auto", "--lina"
        ),
        timeout=300,
    )
    assert [d for _, d in ref] == [0.0] * 3
    for curve, changes in per_rank:
        assert any("--moe-dropless: auto -> the dropless baseline" in c for c in changes), changes
        assert any(c.startswith("lina:") and "of 1 MoE layers" in c for c in changes), changes
        assert len(curve) == 3
        for i, ((l_ref, _), (loss, dropped)) in enumerate(zip(ref, curve)):
            assert abs(loss - l_ref) < 1e-5, f"iteration {i + 1}: loss {loss} vs {l_ref}"
            assert dropped == 0.0
