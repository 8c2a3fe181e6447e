"""`mmoe-plan profile`: a one-process profile times every layout the plan considers and the plan
uses it ("measured" compute); two gloo ranks on two nodes fit an inter-node link; bad input
exits 2 with `error:` and leaves no file."""

import os

import pytest
import torch.distributed as dist

from megatron_moe.cli import plan
from megatron_moe.planner import cluster as cl
from megatron_moe.planner.predict import Predictor, enumerate_candidates
from megatron_moe.planner.profile import main, parse
from megatron_moe.testing import free_port, spawn

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "128", "--num-experts", "2", "--micro-batch-size", "2", "--global-batch-size", "8",
]  # fmt: skip


def test_one_process_profile_times_every_layout_and_the_plan_uses_it(tmp_path, capsys):
    out = str(tmp_path / "prof.json")
    cluster_flags = ["--nodes", "1", "--gpus-per-node", "4"]
    assert main(["--out", out, *cluster_flags, "--reps", "1", "--device", "cpu", *TINY]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out} (" in printed and "links: none" in printed and "nominal" in printed
    prof = cl.Profile.read(out)
    assert prof.device == "cpu" and prof.flops > 0 and prof.links == {}
    assert prof.model["model"]["hidden_size"] == 32 and prof.model["moe"]["num_experts"] == 2
    assert all(t["forward"] > 0 and t["backward"] > 0 for t in prof.compute.values())
    assert sorted(os.listdir(tmp_path)) == ["prof.json"]

    _, cfg = parse(["--out", out, *cluster_flags, *TINY])
    measured = prof.apply(cl.nominal(1, 4))
    ok, _ = enumerate_candidates(cfg, 4, None)
    assert {(c.mp, c.ep, c.esp) for c in ok} >= {(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)}
    pred = Predictor(cfg, measured)
    for c in ok:
        assert pred.predict(c).breakdown["compute_source"] == "measured", c.name
    assert len(prof.compute) == len({(c.mp, c.ep, c.esp) for c in ok})

    assert plan.main(["--profile", out, *cluster_flags, *TINY]) == 0
    assert "compute from measured" in capsys.readouterr().out


def _profile_as_node(rank: int, world_size: int, argv: list, port: int) -> int:
    """Rank `rank` alone on node `rank`, as torchrun would start it (the profile makes its own group)."""
    dist.destroy_process_group()
    os.environ.update(MASTER_PORT=str(port), GROUP_RANK=str(rank), LOCAL_WORLD_SIZE="1")
    return main(argv)


def test_two_ranks_on_two_nodes_fit_an_inter_node_link(tmp_path):
    out = str(tmp_path / "prof.json")
    argv = ["--out", out, "--nodes", "2", "--gpus-per-node", "1", "--reps", "1", "--device", "cpu"]
    argv += ["--comm-max-mb", "0.25", "--moe-schedule", "baseline", *TINY]
    assert spawn(_profile_as_node, 2, argv, free_port(), timeout=120) == [0, 0]
    prof = cl.Profile.read(out)
    assert set(prof.links) == {"inter"}
    inter = prof.links["inter"]
    assert inter["bandwidth"] > 0 and inter["latency"] >= 0
    assert set(inter["fits"]) == {"all_reduce", "all_gather", "all_to_all"}
    assert all(f["group_size"] == 2 and f["bandwidth"] > 0 for f in inter["fits"].values())
    for op, f in inter["fits"].items():  # each op's figures reproduce its fitted line through the cluster model
        one = cl.Cluster(2, 1, cl.Link(3e-6, 1e12), cl.Link(f["latency"], f["bandwidth"]), 2**30, 1e12)
        nbytes = f["bytes"][-1]
        assert one.collective(op, [0, 1], nbytes) == pytest.approx(f["alpha"] + f["beta_per_byte"] * nbytes)
    applied = prof.apply(cl.nominal(2, 1))
    assert applied.inter.bandwidth == inter["bandwidth"] and "measured: inter, compute" in applied.source


@pytest.mark.parametrize(
    "change, message",
    [
        (["--out", "{tmp}/missing/prof.json"], "does not exist"),
        (["--reps", "0"], "--reps must be >= 1"),
    ],
)
def test_bad_input_exits_2_with_error_and_leaves_no_file(tmp_path, capsys, change, message):
    argv = ["profile", "--out", f"{tmp_path}/prof.json", "--nodes", "1", "--gpus-per-node", "2", "--device", "cpu"]
    argv += [x.format(tmp=tmp_path) for x in change] + TINY
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert os.listdir(tmp_path) == []
