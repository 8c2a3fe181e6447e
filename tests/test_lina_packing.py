"""Lina's expert packing (--lina-packing, `megatron_moe.moe.packing`).

One 4-process spawn runs the tiny trainer model (4 experts, top-2 with drops, Adam) for 20
iterations with EP4 (one expert per rank), then the same run with packing forced at iteration
10 (--lina-packing-force; --lina-max-experts-per-rank 2, so EP4 -> EP2 x expert-DP2 once and no
further), saving after packing (iteration 15, in the packed layout). That checkpoint is resharded
to EP4 with the conversion tool and a third run continues from it in the original layout.
Checks: the packed curve equals the unpacked one within 1e-5 (parameters *and* Adam state were
moved: a wrong move shows in the next iterations), the layout changed exactly at iteration 10,
every rank decided on the same measured times, and the resumed run continues the same curve.
"""

import os

import pytest
import torch.distributed as dist

from megatron_moe import optimizations
from megatron_moe.arguments import parse_args, validate
from megatron_moe.checkpointing import read_metadata
from megatron_moe.cli.convert import main as convert_main
from megatron_moe.moe.packing import next_ep, packing_due, should_pack
from megatron_moe.testing import spawn
from megatron_moe.training import Trainer
from tiny_run import tiny_args

ITERS = 20
EP4 = ("--expert-model-parallel-size", "4")  # AdamW (the default)
PACK = ("--lina-packing", "--lina-packing-force", "--lina-max-experts-per-rank", "2")


def _train(args) -> tuple[list, list, int, int]:
    """(history, packing decisions, EP and expert-DP at the end) of one trainer run."""
    trainer = Trainer(parse_args(args))
    try:
        hist = trainer.train()
    finally:
        trainer.stop.restore()
    decisions = trainer.packing.decisions if trainer.packing is not None else []
    return hist, decisions, trainer.ps.size("ep"), trainer.ps.size("expert_dp")


def _runs(rank, world, data, ckpt, converted):
    out = {"plain": _train(tiny_args(data, ITERS, *EP4))}
    out["packed"] = _train(tiny_args(data, ITERS, *EP4, *PACK, "--save", ckpt, "--save-interval", "15"))
    if rank == 0:
        out["layout_saved"] = read_metadata(os.path.join(ckpt, "iter_0000015"))["layout"]
        code = convert_main(
            ["reshard", "--load", ckpt, "--iteration", "15", "--save", converted, "--no-progress"]
            + ["--target-expert-model-parallel-size", "4", "--target-world-size", "4"]
        )
        assert code == 0
    dist.barrier()
    out["resumed"] = _train(tiny_args(data, ITERS, *EP4, "--load", converted))
    return out


def test_packing_at_step_10_keeps_the_curve_and_its_checkpoint_resumes_in_the_original_layout(sample_data, tmp_path):
    per_rank = spawn(_runs, 4, sample_data, str(tmp_path / "ckpt"), str(tmp_path / "ckpt_ep4"), timeout=300)
    plain = per_rank[0]["plain"][0]
    assert len(plain) == ITERS and any(h["dropped_frac"] > 0 for h in plain), "tokens must be dropped"
    assert per_rank[0]["layout_saved"]["expert_model_parallel_size"] == 2  # saved after packing
    for rank, runs in enumerate(per_rank):
        assert runs["plain"][2:] == (4, 1)
        hist, decisions, ep, edp = runs["packed"]
        assert (ep, edp) == (2, 2), f"rank {rank}: EP {ep} x expert-DP {edp} after packing"
        assert [h["experts_per_rank"] for h in hist] == [1] * 9 + [2] * 11
        assert [(d["iteration"], d["ep_before"], d["ep"]) for d in decisions] == [(10, 4, 2)]
        assert decisions[0]["ffn_ms"] > 0 and decisions[0]["a2a_ms"] > 0  # both were measured
        for i, (a, b) in enumerate(zip(plain, hist)):
            assert abs(a["loss"] - b["loss"]) < 1e-5, f"rank {rank} iteration {i + 1}: {b['loss']} vs {a['loss']}"
            assert a["dropped_frac"] == b["dropped_frac"]
        resumed = runs["resumed"][0]
        assert [h["iteration"] for h in resumed] == list(range(16, ITERS + 1))
        for a, b in zip(plain[15:], resumed):
            assert abs(a["loss"] - b["loss"]) < 1e-5, f"rank {rank} resumed iteration {b['iteration']}"
    # the decision was taken on the same (MAX-reduced) numbers on every rank
    times = [(r["packed"][1][0]["ffn_ms"], r["packed"][1][0]["a2a_ms"]) for r in per_rank]
    assert len(set(times)) == 1, times


def test_packing_schedule_and_rule():
    assert [i for i in range(30) if packing_due(i)] == [10, 14, 18, 22, 26]
    assert next_ep(8, 16, 0) == 4 and next_ep(4, 16, 4) is None and next_ep(4, 16, 8) == 2
    assert next_ep(3, 6, 0) is None and next_ep(1, 4, 0) is None
    assert should_pack(1.0, 2.0) and not should_pack(2.0, 2.0) and not should_pack(3.0, 2.0)


def test_packing_flag_errors_name_the_flags():
    with pytest.raises(ValueError, match="--lina-packing-force needs --lina-packing"):
        parse_args(["--lina-packing-force"])
    with pytest.raises(ValueError, match="--lina-max-experts-per-rank must be >= 0"):
        parse_args(["--lina-max-experts-per-rank", "-1"])
    cfg = parse_args(["--num-experts", "8", "--expert-model-parallel-size", "2", "--lina-packing"])
    cfg.opts.lina_max_experts_per_rank = 2
    with pytest.raises(ValueError, match="--lina-max-experts-per-rank 2 is below the 4 experts per rank"):
        validate(cfg, 2)
    for flag in ("--lancet-partition", "--lancet-wgrad"):
        with pytest.raises(ValueError, match=f"--lina-packing cannot be combined with {flag}"):
            optimizations.check_combination(parse_args(["--lina-packing", flag]))
