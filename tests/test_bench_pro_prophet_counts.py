"""tools/bench_pro_prophet.py --counts-from: expert popularity taken from a trained model's logged
counts (the trainer's --log-json lines), realized by the benchmark's gate on its own inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tool_modules import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
bench = load_tool("bench_pro_prophet")

# two MoE layers of 8 experts, as the trainer logs them: one record per logged iteration
LAYER1 = [30, 90, 10, 40, 60, 70, 90, 110]
LAYER3 = [40, 30, 80, 20, 110, 100, 90, 30]


def _log(path, records: int = 3, extra: int = 0) -> str:
    """A --log-json file: `records` training records (iteration i adds `extra` tokens to expert 0 of
    layer 1) between a validation line and the run's last test line, as the trainer writes them."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"split": "valid", "iteration": 0, "loss": 6.0}) + "\n")
        for i in range(records):
            counts = {"1": [LAYER1[0] + i * extra] + LAYER1[1:], "3": LAYER3}
            f.write(json.dumps({"iteration": 10 * (i + 1), "loss": 5.0, "expert_counts": counts}) + "\n")
        f.write(json.dumps({"split": "test", "iteration": 30, "loss": 4.0}) + "\n")
    return str(path)


def _shares(counts):
    return [c / sum(counts) for c in counts]


def test_popularity_is_the_last_records_shares_per_layer(tmp_path):
    path = _log(tmp_path / "run.jsonl", records=3, extra=100)
    # the last record only: expert 0 of layer 1 has 30 + 200 tokens
    last = bench.load_popularity(path, layers=2, records=1)
    assert last[0] == pytest.approx(_shares([230] + LAYER1[1:]))
    assert last[1] == pytest.approx(_shares(LAYER3))
    # summed over the last two records: 130 + 230 for expert 0, twice every other count
    two = bench.load_popularity(path, layers=2, records=2)
    assert two[0] == pytest.approx(_shares([360] + [2 * c for c in LAYER1[1:]]))
    # more records asked than logged: all of them; fewer layers asked: the first ones
    assert bench.load_popularity(path, layers=1, records=50)[0] == pytest.approx(
        _shares([30 + 130 + 230] + [3 * c for c in LAYER1[1:]])
    )
    a = bench.parse_args(["--counts-from", path, "--counts-records", "1"])
    assert a.popularity == last


@pytest.mark.parametrize(
    "content, blocks, message",
    [
        (None, 2, "cannot read it"),
        ('{"iteration": 1}\nnot json\n', 2, "line 2 is not JSON"),
        ('{"iteration": 1, "loss": 3.0}\n', 2, "no line carries expert_counts"),
        ('{"expert_counts": {"1": [1, 2]}}\n', 2, "the run has 1 MoE layer(s), --blocks asks for 2"),
        (
            '{"expert_counts": {"1": [1, 2], "3": [1, 2]}}\n{"expert_counts": {"1": [1, 2, 3], "3": [1, 2]}}\n',
            2,
            "MoE layer 1 is not logged with the same experts",
        ),
        ('{"expert_counts": {"1": [0, 0], "3": [1, 2]}}\n', 2, "MoE layer 1 routed no tokens"),
    ],
)
def test_bad_counts_file_exits_2_naming_the_flag_and_file(tmp_path, capsys, content, blocks, message):
    path = tmp_path / "run.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--counts-from", str(path), "--blocks", str(blocks)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--counts-from {path}" in err and message in err, err


def test_counts_records_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--counts-records", "0"])
    assert exit_info.value.code == 2 and "--counts-records must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("topk", [1, 2])
def test_gate_bias_realizes_the_shares_on_an_independent_sample(topk):
    target = torch.tensor(_shares(LAYER1))
    b = bench.gate_bias(target.tolist(), topk, u_scale=0.1)
    gen = torch.Generator(device="cpu").manual_seed(11)  # not gate_bias's sample
    g = torch.randn(200_000, 8, generator=gen, device="cpu") * bench.GATE_NOISE
    eps = torch.randn(200_000, 1, generator=gen, device="cpu") * 0.1
    err = float((bench.routed_shares(b, g, eps, topk) - target).abs().max())
    assert err < 0.004
    # the plain log-share bias (what the Zipf path uses) is off for the same target (the gate's noise
    # is not Gumbel noise, and top-2 picks twice); the fixed point removes most of that
    plain = float((bench.routed_shares(target.log(), g, eps, topk) - target).abs().max())
    assert err < 0.5 * plain, (err, plain)


def test_benchmark_runs_with_trained_counts(tmp_path):
    """End to end on 2 ranks: rows carry skew null and the popularity, and the routed shares the
    benchmark measured follow the file's (the gate fitted on the benchmark's own inputs)."""
    path = _log(tmp_path / "run.jsonl")
    out_json = tmp_path / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        os.path.join(ROOT, "tools", "bench_pro_prophet.py"), "--counts-from", path, "--modes", "none,heaviest_to_all",
        "--tokens", "2048", "--hidden-size", "32", "--ffn-hidden-size", "64", "--iters", "2", "--warmup", "1",
        "--calibrate-iters", "0", "--json", str(out_json),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out_json.read_text(encoding="utf-8"))
    assert [r["mode"] for r in rows] == ["none", "heaviest_to_all"]
    for r in rows:
        assert r["skew"] is None and r["popularity"] == "counts run.jsonl"
        for measured, counts in zip(r["expert_shares"], (LAYER1, LAYER3)):
            # 2 iterations x 2 ranks x 2048 tokens: sampling noise about 0.006 per share
            assert max(abs(m - t) for m, t in zip(measured, _shares(counts))) < 0.03, (measured, counts)
    assert " real none " in run.stdout
    # heaviest-to-all moved the 2 heaviest experts of each layer; "none" nothing
    assert rows[0]["trans_bytes"] == 0 and rows[1]["trans_bytes"] > 0
    # paired speedups: none over itself is 1 in every iteration; heaviest-to-all's median lies in its interval
    assert rows[0]["speedup_vs_none_paired"] == [1.0, 1.0, 1.0]
    med, lo, hi = rows[1]["speedup_vs_none_paired"]
    assert lo <= med <= hi and rows[1]["speedup_vs_heaviest_to_all_paired"] == [1.0, 1.0, 1.0]
    assert "counts heaviest_to_all: " in run.stdout and ") over none" in run.stdout


def test_expert_count_mismatch_exits_2(tmp_path):
    path = _log(tmp_path / "run.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        os.path.join(ROOT, "tools", "bench_pro_prophet.py"), "--counts-from", path, "--experts-per-rank", "2",
        "--tokens", "64", "--hidden-size", "16", "--ffn-hidden-size", "16", "--iters", "1",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert run.returncode != 0
    assert f"error: --counts-from {path}: the run has 8 experts per MoE layer, this benchmark 4" in run.stderr


def test_modes_warm_up_alone_then_run_round_robin(monkeypatch):
    """The measured iterations interleave the modes (rotated order), after each mode's own warm-up
    (a trial's arms follow each other); --breakdown's profiled iteration comes last."""
    import argparse

    order = []

    class Recorder:
        def __init__(self, a, cfg, ps, mode, skew, perf, log, gates=None):
            self.mode, self.it = mode, 0
            self.warmup = {"none": 1, "heaviest_to_all": 2, "pro_prophet": 3}[mode]

        def step(self, profiled=False):
            order.append((self.mode, self.it, profiled))
            self.it += 1

        def result(self):
            return {"iterations": self.it}

    monkeypatch.setattr(bench, "ModeRun", Recorder)
    a = argparse.Namespace(modes=["none", "heaviest_to_all", "pro_prophet"], iters=2, breakdown=True)
    out = bench.run_modes(a, None, None, 0.0, {})
    warm = [("none", 0), ("heaviest_to_all", 0), ("heaviest_to_all", 1)] + [("pro_prophet", i) for i in range(3)]
    measured = [("none", 1), ("heaviest_to_all", 2), ("pro_prophet", 3)]  # i = 0
    measured += [("heaviest_to_all", 3), ("pro_prophet", 4), ("none", 2)]  # i = 1: rotated
    profiled = [("none", 3), ("heaviest_to_all", 4), ("pro_prophet", 5)]
    assert order == [(m, i, False) for m, i in warm + measured] + [(m, i, True) for m, i in profiled]
    assert out == {"none": {"iterations": 4}, "heaviest_to_all": {"iterations": 5}, "pro_prophet": {"iterations": 6}}
