"""tools/bench_quality.py: our GPT-2 trains exactly like transformers' GPT2LMHeadModel, and the
moe-vs-dense comparison runs end to end with equal tokens and equal active parameters."""

import json
import math
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "bench_quality.py")
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _run(*args, timeout=600):
    return subprocess.run(
        [sys.executable, TOOL, *args], check=False, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_reference_curve_matches_transformers_within_1e4_per_step(tmp_path):
    out = tmp_path / "ref.json"
    res = _run("reference", "--steps", "20", "--work-dir", str(tmp_path / "work"), "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r) == {"steps", "max_abs_diff", "ours", "transformers"}
    assert r["steps"] == 20 and len(r["ours"]) == 20 and len(r["transformers"]) == 20
    diffs = [abs(a - b) for a, b in zip(r["ours"], r["transformers"])]
    for step, d in enumerate(diffs, 1):
        assert d < 1e-4, f"step {step}: ours {r['ours'][step - 1]} vs transformers {r['transformers'][step - 1]}"
    assert r["max_abs_diff"] == max(diffs)
    assert r["ours"][-1] < r["ours"][0] - 0.5, "both models must really train (the loss falls)"
    assert f"max |diff| over 20 steps: {max(diffs):.3e}" in res.stdout


def test_moe_vs_dense_end_to_end_on_a_tiny_budget(tmp_path):
    # the project's own sample corpus stands in for WikiText-2 (same file names and format)
    wt = tmp_path / "wt"
    wt.mkdir()
    for f in ("wiki.valid.tokens", "wiki.test.tokens"):
        shutil.copy(os.path.join(ROOT, "data", "wikitext-sample", f), wt / f)
    out = tmp_path / "mvd.json"
    L, M = 2, 32
    res = _run(
        "moe-vs-dense",
        "--wikitext-dir",
        str(wt),
        "--work-dir",
        str(tmp_path / "work"),
        "--seeds",
        "3",
        "--vocab-size",
        "300",
        "--num-layers",
        str(L),
        "--hidden-size",
        str(M),
        "--num-attention-heads",
        "2",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "4",
        "--train-iters",
        "3",
        "--eval-iters",
        "1",
        "--log-interval",
        "1",
        "--json",
        str(out),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == ["dense", "top1-e4", "top1-e8", "top2-e8-half"]
    keys = {"model", "seed", "tokens", "valid_ppl", "tokens_per_s", "dropped_fraction", "load_imbalance_final"}
    for r in rows:
        assert keys <= set(r), r
        assert r["seed"] == 3
        assert r["tokens"] == 3 * 4 * 32
        for k in ("valid_ppl", "tokens_per_s", "dropped_fraction", "load_imbalance_final"):
            assert isinstance(r[k], float) and math.isfinite(r[k]), (r["model"], k, r[k])
        assert r["valid_ppl"] > 1.0 and 0.0 <= r["dropped_fraction"] < 1.0
        assert r["load_imbalance_final"] >= 1.0
    dense = rows[0]
    assert dense["dropped_fraction"] == 0.0 and dense["load_imbalance_final"] == 1.0
    # equal active parameters: an MoE block adds only its gate (E x M) and, for top-2 over
    # half-width experts, one more output bias (M) per block
    for r, (E, k) in zip(rows[1:], [(4, 1), (8, 1), (8, 2)]):
        assert r["params_active"] - dense["params_active"] == L * (E * M + (k - 1) * M), r["model"]
    logs = [os.path.join(ROOT, r["log_json"]) for r in rows]
    assert all(os.path.isfile(p) for p in logs)
    assert "valid ppl" in res.stdout


def test_moe_vs_dense_without_wikitext_says_what_is_missing(tmp_path):
    out = tmp_path / "mvd.json"
    res = _run(
        "moe-vs-dense",
        "--wikitext-dir",
        str(tmp_path / "absent"),
        "--work-dir",
        str(tmp_path / "work"),
        "--json",
        str(out),
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: --wikitext-dir {tmp_path / 'absent'}: wiki.test.tokens, wiki.valid.tokens not found (the real "
        f"WikiText-2 validation and test files; skipping moe-vs-dense)"
    )
    assert not out.exists()
