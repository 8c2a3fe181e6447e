"""Lina's expert packing (--lina-packing, `megatron_moe.moe.packing`).

One 4-process spawn (a module fixture) runs the tiny trainer model (4 experts, top-2 with drops, Adam) for 20
iterations with EP4 (one expert per rank), then the same run with all of Lina (4 KiB micro-ops,
all-to-alls in 2 pipelined chunks) and packing (--lina-max-experts-per-rank 2, so EP4 -> EP2 x expert-DP2 once
and no further), --measure-iters 1. Lina's own trial runs first (2 warm-up rounds and 1 timed round of plain and
Lina: iterations 1-6); packing is due at iteration 10, where Lina's rule is forced to pack ("lina-packing-rule");
the pack is then measured: iteration 11 at EP4, iteration 12 at EP2, and the decision ("lina-packing") is forced
to keep it (saving after iteration 15, in the packed layout; that checkpoint is resharded to EP4 with the
conversion tool and a third run continues from it in the original layout) or, in a fourth run, to move back:
EP4 again from iteration 13 and no pack tried again.
Checks: the packed and the reverted curves equal the unpacked one within 1e-5 (parameters *and* Adam state were
moved, both ways: a wrong move shows in the next iterations), the layout of every iteration, every rank decided
on the same measured times and logged the same lines, and the resumed run continues the same curve.

The same spawn then packs EP2 x ESP2 to EP1 x ESP2 x expert-DP2 directly (`ExpertPacking.relayout`)
and checks every rank's expert slices and Adam moments against the slices of the full tensors
assembled before the move, the new groups' ranks, and the loss of the next steps.
"""

import os

import pytest
import torch
import torch.distributed as dist

from megatron_moe import choose, optimizations
from megatron_moe.arguments import parse_args, validate
from megatron_moe.checkpointing import read_metadata
from megatron_moe.cli.convert import main as convert_main
from equivalence import MICRO_BATCH, global_batch, tiny_config
from megatron_moe.distributed.grad_sync import GradSync
from megatron_moe.layers.sharding import assemble, coords_key, local_pieces, rank_coords, shard_spec, shard_tensor
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.packing import RULE, TRIAL, ExpertPacking, next_ep, packing_due, should_pack
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel, local_state
from megatron_moe.testing import spawn
from megatron_moe.training import Trainer
from tiny_run import tiny_args

ITERS = 20
EP4 = ("--expert-model-parallel-size", "4")  # AdamW (the default)
PACK = ("--lina-packing", "--lina-max-experts-per-rank", "2", "--measure-iters", "1")
LINA = ("--lina", "--lina-partition-mb", "0.004", "--lina-pipeline-chunks", "2")


def _train(args, pick=None) -> tuple[list, list, int, int, bool]:
    """(history, packing decisions, EP and expert-DP at the end, whether Lina's trial decided) of one trainer
    run; `pick`: the packing trial's forced pick, after a rule forced to pack."""
    with choose.override(RULE, pick="pack" if pick else None), choose.override(TRIAL, pick=pick):
        trainer = Trainer(parse_args(args))
        try:
            hist = trainer.train()
        finally:
            trainer.stop.restore()
    decisions = trainer.packing.decisions if trainer.packing is not None else []
    lina = trainer.lina_trial is not None and trainer.lina_trial.decided
    return hist, decisions, trainer.ps.size("ep"), trainer.ps.size("expert_dp"), lina


def _runs(rank, world, data, ckpt, converted):
    out = {"plain": _train(tiny_args(data, ITERS, *EP4))}
    out["packed"] = _train(
        tiny_args(data, ITERS, *EP4, *PACK, *LINA, "--save", ckpt, "--save-interval", "15"), "packed"
    )
    out["reverted"] = _train(tiny_args(data, ITERS, *EP4, *PACK, *LINA), "unpacked")
    if rank == 0:
        out["layout_saved"] = read_metadata(os.path.join(ckpt, "iter_0000015"))["layout"]
        code = convert_main(
            ["reshard", "--load", ckpt, "--iteration", "15", "--save", converted, "--no-progress"]
            + ["--target-expert-model-parallel-size", "4", "--target-world-size", "4"]
        )
        assert code == 0
    dist.barrier()
    out["resumed"] = _train(tiny_args(data, ITERS, *EP4, "--load", converted))
    out["esp"] = _relayout_esp(rank, world)
    return out


@pytest.fixture(scope="module")
def per_rank(sample_data, tmp_path_factory) -> list:
    """The results of the one 4-process spawn of this module (its docstring)."""
    tmp = tmp_path_factory.mktemp("packing")
    return spawn(_runs, 4, sample_data, str(tmp / "ckpt"), str(tmp / "ckpt_ep4"), timeout=600)


def _same_curve(plain: list, hist: list, rank: int) -> None:
    for i, (a, b) in enumerate(zip(plain, hist)):
        assert abs(a["loss"] - b["loss"]) < 1e-5, f"rank {rank} iteration {i + 1}: {b['loss']} vs {a['loss']}"
        assert a["dropped_frac"] == b["dropped_frac"]


def test_a_kept_pack_keeps_the_curve_and_its_checkpoint_resumes_in_the_original_layout(per_rank):
    plain = per_rank[0]["plain"][0]
    assert len(plain) == ITERS and any(h["dropped_frac"] > 0 for h in plain), "tokens must be dropped"
    assert per_rank[0]["layout_saved"]["expert_model_parallel_size"] == 2  # saved after packing
    for rank, runs in enumerate(per_rank):
        assert runs["plain"][2:] == (4, 1, False)
        hist, decisions, ep, edp, lina_decided = runs["packed"]
        assert (ep, edp) == (2, 2) and lina_decided, f"rank {rank}: EP {ep} x expert-DP {edp} after packing"
        assert [h["experts_per_rank"] for h in hist] == [1] * 11 + [2] * 9
        assert [(d["kind"], d["iteration"], d["pick"]) for d in decisions] == [
            ("rule", 10, "pack"),
            ("trial", 12, "packed"),
        ]
        assert decisions[0]["ffn_ms"] > 0 and decisions[0]["a2a_ms"] > 0  # both were measured
        assert "lina-packing: median of 1 passes" in decisions[1]["line"] and "kept EP 2" in decisions[1]["line"]
        _same_curve(plain, hist, rank)
        resumed = runs["resumed"][0]
        assert [h["iteration"] for h in resumed] == list(range(16, ITERS + 1))
        for a, b in zip(plain[15:], resumed):
            assert abs(a["loss"] - b["loss"]) < 1e-5, f"rank {rank} resumed iteration {b['iteration']}"
    # the decisions were taken on the same (MAX-reduced) numbers on every rank, with the same log lines
    for run in ("packed", "reverted"):
        assert all(r[run][1] == per_rank[0][run][1] for r in per_rank), [r[run][1] for r in per_rank]


def test_the_packing_decision_is_applied_unpacked_goes_back_to_ep4_on_the_same_curve(per_rank):
    plain = per_rank[0]["plain"][0]
    for rank, runs in enumerate(per_rank):
        hist, decisions, ep, edp, _ = runs["reverted"]
        assert (ep, edp) == (4, 1), f"rank {rank}: EP {ep} x expert-DP {edp} after the trial"
        assert [h["experts_per_rank"] for h in hist] == [1] * 11 + [2] + [1] * 8
        # and no pack at 14 or 18: packing stopped
        assert [(d["kind"], d["iteration"], d["pick"]) for d in decisions] == [
            ("rule", 10, "pack"),
            ("trial", 12, "unpacked"),
        ]
        assert decisions[1]["line"].endswith("back to EP 4, expert-DP 1; no more packing in this run")
        _same_curve(plain, hist, rank)


def test_packing_schedule_and_rule():
    assert [i for i in range(30) if packing_due(i)] == [10, 14, 18, 22, 26]
    assert next_ep(8, 16, 0) == 4 and next_ep(4, 16, 4) is None and next_ep(4, 16, 8) == 2
    assert next_ep(3, 6, 0) is None and next_ep(1, 4, 0) is None
    assert should_pack(1.0, 2.0) and not should_pack(2.0, 2.0) and not should_pack(3.0, 2.0)


def test_packing_flag_errors_name_the_flags():
    with pytest.raises(ValueError, match="--lina-max-experts-per-rank must be >= 0"):
        parse_args(["--lina-max-experts-per-rank", "-1"])
    cfg = parse_args(["--num-experts", "8", "--expert-model-parallel-size", "2", "--lina-packing"])
    cfg.opts.lina_max_experts_per_rank = 2
    with pytest.raises(ValueError, match="--lina-max-experts-per-rank 2 is below the 4 experts per rank"):
        validate(cfg, 2)
    for flag in ("--lancet-partition", "--lancet-wgrad"):
        with pytest.raises(ValueError, match=f"--lina-packing cannot be combined with {flag}"):
            optimizations.check_combination(parse_args(["--lina-packing", flag]))


def _state_pieces(model, opt, ps) -> dict:
    """{name/state: (coords key, tensor)} of this rank's Adam moments (as `local_pieces` does for params)."""
    coords, out = rank_coords(ps), {}
    for name, p in model.named_parameters():
        for k, v in opt.state[p].items():
            if torch.is_tensor(v) and v.shape == p.shape:
                out[f"{name}/{k}"] = (coords_key(coords, shard_spec(p)), v.detach().clone())
    return out


def _step(model, opt, sync, ps, seed: int) -> float:
    """One AdamW step on this data-parallel rank's share of a seeded global batch; its loss."""
    ids, labels = global_batch(ps.size("dp"), seed=seed)
    rows = slice(ps.rank("dp") * MICRO_BATCH, (ps.rank("dp") + 1) * MICRO_BATCH)
    opt.zero_grad(set_to_none=True)
    lm, aux = model(ids[rows], labels[rows])
    (lm + aux).backward()
    sync.finish()
    opt.step()
    return float((lm + aux).detach())


def _relayout_esp(rank, world):
    """4 steps at EP2 x ESP2; then 2 steps, packing to EP1 (x ESP2 x expert-DP2), 2 more steps."""
    ps = initialize_model_parallel(1, 2, 2)
    try:
        cfg = tiny_config(k=2, num_experts=4)
        out = {}
        for packed in (False, True):
            model = GPT2MoE(cfg, ps)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            sync = GradSync(model, ps, bucket_mb=0.01)
            losses = [_step(model, opt, sync, ps, s) for s in range(2 if packed else 4)]
            if packed:
                out["before"] = (local_pieces(model, ps), _state_pieces(model, opt, ps))
                ExpertPacking(model, opt, ps, cfg.moe.num_experts).relayout(1)
                out["after"] = (local_pieces(model, ps), _state_pieces(model, opt, ps))
                out["coords"] = rank_coords(ps)
                out["groups"] = {k: ps.ranks(k) for k in ("ep", "esp", "ep_esp", "expert_dp")}
                losses += [_step(model, opt, sync, ps, s) for s in range(2, 4)]
            out["packed" if packed else "plain"] = losses
            sync.remove()
        return out
    finally:
        destroy_model_parallel()


def test_relayout_moves_expert_slices_and_adam_state_under_esp(per_rank):
    esp = [r["esp"] for r in per_rank]
    specs = {n: shard_spec(p) for n, p in GPT2MoE(tiny_config(k=2, num_experts=4), local_state()).named_parameters()}
    full = assemble([r["before"][0] for r in esp], specs)  # also: replicas agree
    state_specs = {k: specs[k.split("/")[0]] for k in esp[0]["before"][1]}
    full_state = assemble([r["before"][1] for r in esp], state_specs)
    assert any("exp_avg_sq" in k for k in full_state) and any(".experts." in k for k in full_state)
    for rank, r in enumerate(esp):
        pair = [rank - rank % 2, rank - rank % 2 + 1]  # ESP stays the fastest coordinate
        want = {"ep": [rank], "esp": pair, "ep_esp": pair, "expert_dp": [rank % 2, rank % 2 + 2]}
        assert r["groups"] == want, (rank, r["groups"])
        assert r["coords"]["ep"] == (0, 1) and r["coords"]["esp"] == (rank % 2, 2)
        params, states = r["after"]
        for name, (_, t) in params.items():
            expect = shard_tensor(full[name], specs[name], r["coords"])
            assert torch.equal(t, expect), f"rank {rank}: {name} after packing is not its slice"
        for key, (_, t) in states.items():
            expect = shard_tensor(full_state[key], state_specs[key], r["coords"])
            assert torch.equal(t, expect), f"rank {rank}: optimizer state {key} after packing is not its slice"
        assert len(states) == len(r["before"][1])
        for i, (a, b) in enumerate(zip(r["plain"], r["packed"])):
            assert abs(a - b) < 1e-5, f"rank {rank} step {i + 1}: {b} packed vs {a}"
