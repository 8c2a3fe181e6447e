"""Pro-Prophet's lightweight expert placement (moe.placement): with a fixed plan the loss, every
gradient (the owner's, after Agg), the optimizer step, the bytes of Trans / Agg and the trainer's
curve equal the run without placement.

One spawn per world size runs every case of that size (EP2; EP4, EP2 x DP2, EP2 x ESP2, MP2 x EP2), each with and
without placement in the same process, scheduled and blocking, top-1 and top-2.
"""

import os
import subprocess
import sys

import pytest
import torch

from equivalence import MICRO_BATCH, global_batch, tiny_config
from megatron_moe.arguments import parse_args, validate
from megatron_moe.distributed.grad_sync import sync_gradients
from megatron_moe.distributed.observer import CommLog
from megatron_moe.layers.sharding import local_pieces
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.placement import Placement, ProProphet, gather_counts, routed_counts
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.pro_prophet.planner import heaviest_to_all
from megatron_moe.testing import live_cpu_tensors, spawn
from megatron_moe.training import pretrain
from tiny_run import tiny_args
from tool_modules import load_tool

STEPS = 2  # forward + backward, an SGD step, forward + backward again
# world -> [(mp, ep, esp, num_experts, forced plan {expert: EP ranks})]
CASES = {
    2: [(1, 2, 1, 4, {0: [1], 3: [0]})],
    4: [
        (1, 4, 1, 4, {0: [1, 2, 3], 2: [0]}),
        (1, 2, 1, 4, {1: [1], 2: [0]}),
        (1, 2, 2, 4, {0: [1]}),
        (2, 2, 1, 4, {0: [1], 3: [0]}),
    ],
}


def placed_config(k: int, num_experts: int = 4):
    return tiny_config(k, num_experts=num_experts, moe_dropless=True)


# ----------------------------------------------------------------------------- the placement itself


def test_placement_columns_and_computed_tokens():
    p = Placement.of(4, 2, {0: [1], 3: [0]})
    assert p.moved == [0, 3] and p.held(0) == [3] and p.held(1) == [0]
    assert p.compute_experts(0) == [0, 1, 3] and p.compute_experts(1) == [0, 2, 3]
    col, X = p.columns(0, torch.device("cpu"))  # EP rank 0 keeps 0, 1, 3 and sends 2 to rank 1
    assert X == 3 and col.tolist() == [0, 1, 3 + 1, 2]
    col, X = p.columns(1, torch.device("cpu"))  # EP rank 1 keeps 0, 2, 3 and sends 1 to rank 0
    assert col.tolist() == [3 + 0, 1, 3 + 1, 3 + 2]
    counts = [[5, 1, 2, 7], [6, 3, 4, 1]]
    assert p.computed_tokens(counts) == [5 + 1 + 7 + 3, 2 + 6 + 4 + 1]
    assert Placement.of(4, 2, {}).computed_tokens(counts) == [5 + 1 + 6 + 3, 2 + 7 + 4 + 1]


# ----------------------------------------------------------------------------- equivalence (spawned)


def _steps(k: int, mp: int, ep: int, esp: int, E: int, plan: dict, schedule) -> dict:
    """STEPS iterations (SGD between them) on this rank; schedule None: no placement, True / False:
    the forced plan scheduled / blocking, "planned": the plan of step 2 made from step 1's counts
    (the paper's "heaviest expert to all" as the planner, scheduled)."""
    ps = initialize_model_parallel(mp, ep, esp)
    try:
        model = GPT2MoE(placed_config(k, E), ps)
        layers = model.moe_layers()
        runtime = None
        if schedule == "planned":
            runtime = ProProphet(layers, ps, planner=lambda counts: heaviest_to_all(counts, 1).replicas)
        elif schedule is not None:
            runtime = ProProphet(layers, ps, schedule=schedule)
            runtime.set_plans({layer.layer_idx: Placement.of(E, ep, plan) for layer in layers})
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        r = ps.rank("dp")
        sl = slice(r * MICRO_BATCH, (r + 1) * MICRO_BATCH)
        losses, used, counts = [], [], []
        with CommLog() as log:
            for step in range(STEPS):
                if step:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                ids, labels = global_batch(ps.size("dp"), seed=step)
                used.append(runtime.placement_of(layers[0].layer_idx).replicas if runtime else None)
                lm, aux = model(ids[sl].to(ps.device), labels[sl].to(ps.device))  # CUDA under NCCL (tests/gpu)
                (lm + aux).backward()
                sync_gradients(model, ps)
                losses.append((lm + aux).item())
                if schedule == "planned":
                    counts.append(gather_counts(ps, torch.stack([routed_counts(la) for la in layers])))
                    runtime.end_iteration(step + 1, counts[-1])
        opt.step()
        return {
            "losses": losses,
            "grads": local_pieces(model, ps, "grad"),
            "params": local_pieces(model, ps, "param"),
            "ep": ps.rank("ep"),
            "used": used,
            "counts": [c.tolist() for c in counts],
            "bytes": {op: [(e.sent, e.recv) for e in log.of(op)] for op in ("trans", "agg")},
            "a2a_remote": sum(e.remote_sent for e in log.of("all_to_all", phase="bwd")),  # tokens only
            "opt_state": sorted(id(p) for p in opt.state),
        }
    finally:
        destroy_model_parallel()


def _run_cases(rank, world):
    out = []
    for mp, ep, esp, E, plan in CASES[world]:
        for k in (1, 2):
            base = _steps(k, mp, ep, esp, E, plan, None)
            for schedule in (True, False, "planned"):
                out.append(((mp, ep, esp, k, schedule), base, _steps(k, mp, ep, esp, E, plan, schedule)))
    return out


def _expert_bytes(cfg, esp: int) -> int:
    """fp32 bytes of one expert's slice on one ESP shard: fc_w, fc_b, proj_w, proj_b."""
    M, H = cfg.model.hidden_size, cfg.model.ffn_hidden_size
    return 4 * (H // esp * M + H // esp + M * H // esp + M // esp)


def _check(per_rank: list, world: int) -> None:
    cases = {(mp, ep, esp): E for mp, ep, esp, E, _ in CASES[world]}
    for i in range(len(per_rank[0])):
        (mp, ep, esp, k, schedule), _, _ = per_rank[0][i]
        tag = f"MP{mp} EP{ep} ESP{esp} DP{world // mp} top-{k} {schedule}"
        E = cases[(mp, ep, esp)]
        one = _expert_bytes(placed_config(k, E), esp)
        if schedule == "planned":  # locality: step 2 uses the plan of step 1's counts
            group = ep * esp  # ranks of one EP x ESP group gather the same counts
            for r in range(world):
                counts = per_rank[r][i][2]["counts"][0][0]
                first = per_rank[r - r % group][i][2]["counts"][0][0]
                assert counts == first, f"{tag}: rank {r} gathered {counts}, its group's first rank {first}"
                expect_plan = heaviest_to_all(counts, 1).replicas
                assert per_rank[r][i][2]["used"] == [tuple(() for _ in range(E)), expect_plan], tag
        for rank in range(world):
            _, base, placed = per_rank[rank][i]
            for s, (a, b) in enumerate(zip(base["losses"], placed["losses"])):
                assert abs(a - b) < 1e-5, f"{tag} rank {rank} step {s + 1}: loss {b} vs {a} without placement"
            for what in ("grads", "params"):
                for name, (key, t) in base[what].items():
                    err = (placed[what][name][1] - t).abs().max().item()
                    assert err < 1e-5, f"{tag} rank {rank}: {what[:-1]} of {name} differs by {err:.3g}"
            assert len(placed["opt_state"]) == len(base["opt_state"]), f"{tag}: the optimizer saw replicas"
            # Trans: the owner sends each moved expert to each replica rank in two parts; Agg the reverse
            me, trans, agg = placed["ep"], [], []
            for reps in placed["used"]:
                p = Placement(E, ep, reps)
                sent = sum(len(p.replicas[e]) for e in p.moved if p.owner(e) == me) * one
                got = len(p.held(me)) * one
                trans += [(sent, got)] if sent or got else []
                agg += [(got, sent)] if sent or got else []
            pairs = zip(placed["bytes"]["trans"][0::2], placed["bytes"]["trans"][1::2])
            seen = [(a[0] + b[0], a[1] + b[1]) for a, b in pairs]
            assert seen == trans, f"{tag} rank {rank}: Trans bytes {placed['bytes']['trans']} != {trans}"
            assert placed["bytes"]["agg"] == agg, f"{tag} rank {rank}: Agg bytes {placed['bytes']['agg']} != {agg}"
        # the replicas' own tokens left the all-to-all: fewer token bytes crossed ranks
        remote = [sum(per_rank[r][i][j]["a2a_remote"] for r in range(world)) for j in (1, 2)]
        assert remote[1] < remote[0], f"{tag}: token all-to-all bytes {remote[1]} not below {remote[0]}"


@pytest.mark.parametrize("world", [2, 4])
def test_forced_plan_equals_no_placement(world):
    per_rank = spawn(_run_cases, world, timeout=600)
    _check(per_rank, world)


# ----------------------------------------------------------------------------- the trainer

EP2 = ("--moe-dropless", "--expert-model-parallel-size", "2")
FIXED = {0: [1], 3: [0]}  # the trainer's Pro-Prophet plan instead of planning (`optimizations.apply`)


def _live_after_steps(rank, world):
    """Live CPU tensors after each of 5 forced-plan iterations (every rank holds a replica), scheduled
    and blocking: each iteration's Trans buffers must die with its graph."""
    ps = initialize_model_parallel(1, 2, 1)
    out = {}
    try:
        for schedule in (True, False):
            model = GPT2MoE(placed_config(1), ps)
            layers = model.moe_layers()
            runtime = ProProphet(layers, ps, schedule=schedule)
            runtime.set_plans({la.layer_idx: Placement.of(4, 2, {0: [1], 3: [0]}) for la in layers})
            live = []
            for step in range(5):
                ids, labels = global_batch(1, seed=step)
                lm, aux = model(ids[:MICRO_BATCH], labels[:MICRO_BATCH])
                (lm + aux).backward()
                model.zero_grad(set_to_none=True)
                del lm, aux
                live.append(live_cpu_tensors())
            out[schedule] = live
        e = layers[0].experts
        out["replica_bytes"] = sum(t[0].numel() * t.element_size() for t in (e.fc_w, e.fc_b, e.proj_w, e.proj_b))
    finally:
        destroy_model_parallel()
    return out


def test_replica_buffers_are_freed_every_iteration():
    """Each iteration's Trans buffers (outputs of the replica autograd node) are freed with its graph:
    the replica ranks' live tensors stay flat. They once leaked through a cycle exchange -> buffers ->
    node -> exchange (+16 MB a step on the paper-sized benchmark's replica rank). A leak adds at least
    one replica (one expert of one layer) a step; what may come and go is a transient smaller than that
    (a 4 KB tensor in flight was seen at some iterations)."""
    per_rank = spawn(_live_after_steps, 2, timeout=300)
    for rank, out in enumerate(per_rank):
        one = out.pop("replica_bytes")
        for schedule, live in out.items():
            warm = [b for _, b in live[1:]]
            assert max(warm) - min(warm) < one, (rank, schedule, live, one)


def _curves(rank, world, data, ckpt):
    """Straight runs without and with a forced plan (scheduled, blocking), the planner's run, and a
    run saved with replicas active then resumed without --pro-prophet."""

    def run(iters, *extra, plan=None, blocking=False):
        cfg = parse_args(tiny_args(data, iters, *EP2, *extra))
        cfg.opts.pro_prophet_no_schedule = blocking  # the ablation (no flag)
        return pretrain(cfg, plan)

    out = {
        "plain": run(8),
        "forced": run(8, "--pro-prophet", plan=FIXED),
        "blocking": run(8, "--pro-prophet", plan=FIXED, blocking=True),
        "planned": run(8, "--pro-prophet", "--pro-prophet-alpha", "0"),
        "lina": run(8, "--pro-prophet", "--lina", plan=FIXED),
    }
    out["resumed"] = run(8, "--pro-prophet", "--save", ckpt, "--exit-interval", "4", plan=FIXED) + run(
        8, "--load", ckpt
    )
    return out


def test_trainer_curve_with_pro_prophet_equals_without_and_resumes_without_it(sample_data, tmp_path):
    per_rank = spawn(_curves, 2, sample_data, str(tmp_path / "ckpt"), timeout=600)
    for rank, runs in enumerate(per_rank):
        plain = runs["plain"]
        assert len(plain) == 8 and all("rank_tokens" in h for h in plain)
        for name in ("forced", "blocking", "planned", "lina", "resumed"):
            curve = runs[name]
            assert len(curve) == 8, name
            for i, (a, b) in enumerate(zip(plain, curve)):
                assert abs(a["loss"] - b["loss"]) < 1e-5, (
                    f"{name} rank {rank} iteration {i + 1}: {b['loss']} vs {a['loss']}"
                )
        # the log: tokens per expert and per EP rank, their imbalance; the forced plan moves tokens
        for h in runs["forced"]:
            assert h["pro_prophet_replicas"] == 2 and sum(h["rank_tokens"]) == sum(h["expert_tokens"])
            assert h["rank_imbalance"] == pytest.approx(max(h["rank_tokens"]) / (sum(h["rank_tokens"]) / 2))
        first, plain0 = runs["forced"][0], plain[0]  # iteration 1: the same weights, the same routes
        assert first["expert_tokens"] == plain0["expert_tokens"]
        assert plain0["rank_tokens"] == [sum(plain0["expert_tokens"][:2]), sum(plain0["expert_tokens"][2:])]
        assert first["rank_imbalance_no_placement"] == plain0["rank_imbalance"]
        assert first["rank_tokens"] != plain0["rank_tokens"]
    # every rank made the same plans (Algorithm 1 on the same gathered counts)
    assert [h["pro_prophet_plan"] for h in per_rank[0]["planned"]] == [
        h["pro_prophet_plan"] for h in per_rank[1]["planned"]
    ]
    assert per_rank[0]["forced"][0]["pro_prophet_plan"] == {"1": {"0": [1], "3": [0]}}


def test_flag_errors_name_the_flags():
    base = ["--num-experts", "4", "--expert-model-parallel-size", "2"]
    with pytest.raises(ValueError, match="--pro-prophet needs --moe-dropless"):
        validate(parse_args([*base, "--pro-prophet"]), 2)
    with pytest.raises(ValueError, match="--pro-prophet needs --expert-model-parallel-size >= 2"):
        validate(parse_args(["--num-experts", "4", "--moe-dropless", "--pro-prophet"]), 1)
    with pytest.raises(ValueError, match="--pro-prophet-n must be in \\[0, 0\\]"):
        validate(parse_args([*base, "--moe-dropless", "--pro-prophet", "--pro-prophet-n", "1"]), 2)
    with pytest.raises(ValueError, match="--pro-prophet-interval must be >= 1"):
        parse_args(["--pro-prophet-interval", "0"])


def test_bench_tool_refuses_bad_input_with_exit_2():
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench_pro_prophet.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, tool], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "error: run it under torchrun" in out.stderr, out.stderr
    out = subprocess.run(
        [sys.executable, tool, "--modes", "none,best"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 2 and "unknown mode(s) ['best']" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, tool, "--warmup", "6"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "--warmup (6) must exceed --calibrate-skip + --calibrate-iters (6)" in out.stderr


def test_bench_model_presets_and_overrides():
    bench = load_tool("bench_pro_prophet")
    a = bench.parse_args([])
    assert (a.model, a.hidden_size, a.ffn_hidden_size, a.tokens) == ("paper", 256, 2048, 4096)
    a = bench.parse_args(["--model", "small"])
    assert (a.hidden_size, a.ffn_hidden_size, a.tokens) == (256, 1024, 2048)
    a = bench.parse_args(["--model", "small", "--tokens", "512", "--ffn-hidden-size", "384"])
    assert (a.hidden_size, a.ffn_hidden_size, a.tokens) == (256, 384, 512)
