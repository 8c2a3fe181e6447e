"""The GPU check's tools run on CPU with tiny shapes and write what `scripts/gpu_check.sh` reads:
the trainer's step (tokens/s, TFLOP/s, host syncs), generation against `transformers` on the same
weights (equal greedy tokens in fp32), the fake-world layout table, and the MoE layer against its
grouped-GEMM floor (bf16 autocast, dropless too)."""

import json
import os
import sys

from megatron_moe.testing import run_command
from tool_modules import TOOLS, load_tool

TINY = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def test_bench_train_step_reports_throughput_and_no_host_sync_on_one_rank(tmp_path):
    out = tmp_path / "step.json"
    args = [*TINY, "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2"]
    r = load_tool("bench_train_step").main(
        [*args, "--vocab-size", "512", "--iters", "2", "--warmup", "1", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == r
    assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["ms_median"] > 0
    assert r["host_syncs_per_step"] == 0 and r["moe_layer_syncs"] == 0  # one rank, capacity routing
    assert "MoE E=" in r["config"]


def test_bench_generate_matches_transformers_greedy_tokens(tmp_path):
    out = tmp_path / "gen.json"
    args = [*TINY, "--vocab-size", "512", "--seq-length", "64", "--batch-size", "2", "--prompt-len", "8"]
    r = load_tool("bench_generate").main([*args, "--max-new-tokens", "6", "--rounds", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == r
    assert [row["variant"] for row in r["rows"]] == ["ours", "transformers"]
    assert all(row["tokens_per_s"] > 0 for row in r["rows"])
    assert r["agree"] == 1.0  # fp32, the same weights: the same greedy tokens


def test_check_layouts_table_and_json(tmp_path, capsys):
    out = tmp_path / "layouts.json"
    assert load_tool("check_layouts").main(["--layouts", "one-process,EP8,infer-EP4", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["layout"] for r in rep["layouts"]] == ["one-process", "EP8", "infer-EP4"]
    assert "EP8" in capsys.readouterr().out


def test_bench_vs_deepspeed_one_process_bf16_against_the_floor(tmp_path):
    out = tmp_path / "layer.json"
    tiny = ["--micro-batch-size", "1", "--seq-length", "64", "--hidden-size", "64", "--ffn-hidden-size", "128"]
    for extra, variants in (([], "ours,floor"), (["--moe-dropless"], "ours,floor")):
        cmd = [
            sys.executable,
            os.path.join(TOOLS, "bench_vs_deepspeed.py"),
            "--device",
            "cpu",
            "--bf16",
            "--expert-model-parallel-size",
            "1",
            "--num-experts",
            "8",
            "--moe-router-topk",
            "2",
            *tiny,
            *extra,
            "--variants",
            variants,
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
        ]
        res = run_command(cmd, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-3000:]
        rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
        assert set(rows) == set(variants.split(","))
        assert rows["floor"]["ratio_vs_floor"] == 1.0 and rows["ours"]["ms_median"] > 0
