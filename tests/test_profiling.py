"""--profile writes a Chrome trace per chosen rank whose events carry the named MoE ranges."""

import json
import os
from collections import Counter

import pytest
import torch

from megatron_moe.arguments import parse_args
from megatron_moe.profiling import annotate, trace_path
from megatron_moe.testing import spawn
from megatron_moe.training import pretrain
from tiny_run import tiny_args

MOE_RANGES = ("moe/router", "moe/dispatch", "moe/experts", "moe/combine")


def _range_counts(path) -> Counter:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return Counter(e["name"] for e in events if e.get("ph") == "X" and "/" in e.get("name", ""))


def test_profile_run_writes_a_trace_with_the_moe_ranges(sample_data, tmp_path):
    prof = tmp_path / "prof"
    pretrain(
        parse_args(
            tiny_args(
                sample_data,
                4,
                "--profile",
                "--profile-step-start",
                "1",
                "--profile-step-end",
                "4",
                "--profile-dir",
                str(prof),
                "--eval-interval",
                "0",  # no evaluation inside the profiled window: only training steps are counted
            )
        )
    )
    assert sorted(os.listdir(prof)) == ["trace_rank00000_iter1-4.json"]
    counts = _range_counts(trace_path(str(prof), 0, 1, 4))
    # 3 profiled iterations x 4 micro-batches x 1 MoE layer (tiny_args: 2 layers, MoE every 2nd)
    assert counts["train/step"] == 3
    for name in MOE_RANGES:
        assert counts[name] == 12, (name, counts)
    assert counts["moe/all_to_all"] == 0  # one process: no all-to-all is issued


def _profile_on_rank(rank, world, argv):
    pretrain(parse_args(argv))


def test_two_ranks_each_write_their_trace_with_all_to_all(sample_data, tmp_path):
    prof = tmp_path / "prof"
    argv = tiny_args(
        sample_data,
        2,
        "--expert-model-parallel-size",
        "2",
        "--profile",
        "--profile-step-start",
        "0",
        "--profile-step-end",
        "1",
        "--profile-ranks",
        "0",
        "1",
        "--profile-dir",
        str(prof),
    )
    spawn(_profile_on_rank, 2, argv, timeout=300)
    assert sorted(os.listdir(prof)) == ["trace_rank00000_iter0-1.json", "trace_rank00001_iter0-1.json"]
    for rank in (0, 1):
        counts = _range_counts(trace_path(str(prof), rank, 0, 1))
        # 2 micro-batches per rank, one MoE layer: baseline runs 2 all-to-alls forward, 2 backward
        assert counts["moe/all_to_all"] == 8, counts
        assert all(counts[name] == 2 for name in MOE_RANGES), counts


def test_profile_without_a_directory_names_the_flags(sample_data):
    with pytest.raises(ValueError, match="--profile needs --profile-dir DIR or --save DIR"):
        pretrain(
            parse_args(tiny_args(sample_data, 2, "--profile", "--profile-step-start", "0", "--profile-step-end", "1"))
        )


def test_profile_window_must_not_be_empty():
    with pytest.raises(ValueError, match=r"--profile-step-end \(3\) must be greater than --profile-step-start \(3\)"):
        parse_args(["--profile", "--profile-step-start", "3", "--profile-step-end", "3"])


def test_annotate_as_decorator_and_context_nests_ranges():
    @annotate("outer/fn")
    def work(x):
        with annotate("inner/block"):
            return x @ x

    x = torch.ones(8, 8, device="cpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        work(x)
        work(x)
    names = Counter(e.name for e in p.events())
    assert names["outer/fn"] == 2 and names["inner/block"] == 2
    outer = [e for e in p.events() if e.name == "outer/fn"]
    inner = [e for e in p.events() if e.name == "inner/block"]
    for o, i in zip(outer, inner):  # each inner range lies inside its outer range
        assert o.time_range.start <= i.time_range.start and i.time_range.end <= o.time_range.end
