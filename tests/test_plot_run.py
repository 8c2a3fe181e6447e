"""tools/plot_run.py on a short real run: a PNG with real content; a file that is not a run log
is refused with a clear error; the trainer's --log-json carries per-layer expert counts."""

import json
import os
import subprocess
import sys

import pytest

from megatron_moe.arguments import parse_args
from megatron_moe.training import pretrain
from tiny_run import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "plot_run.py")
ENV = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def run_log(tmp_path_factory):
    from megatron_moe.data.preprocess import prepare_sample_data

    d = tmp_path_factory.mktemp("plot")
    prefix = str(d / "sample")
    prepare_sample_data(prefix, vocab_size=512)
    log = d / "run.jsonl"
    pretrain(parse_args(tiny_args(prefix, 6, "--log-interval", "1", "--eval-interval", "3", "--log-json", str(log))))
    return log


def _plot(*args):
    return subprocess.run(
        [sys.executable, TOOL, *args], check=False, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )


def test_log_json_records_kept_tokens_per_expert_of_every_moe_layer(run_log):
    train = [r for r in map(json.loads, run_log.read_text().splitlines()) if "split" not in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 5, 6]
    choices = 8 * 32 * 2  # global batch x seq length x top-2
    for r in train:
        assert list(r["expert_counts"]) == ["1"]  # 2 blocks, every 2nd is MoE: block 1
        counts = r["expert_counts"]["1"]
        assert len(counts) == 4 and all(isinstance(c, int) for c in counts)
        assert sum(counts) == round(choices * (1 - r["dropped_frac"]))


def test_plot_run_writes_a_non_blank_png_of_overlaid_runs(run_log, tmp_path):
    import matplotlib.image as mpimg
    import numpy as np

    out = tmp_path / "fig.png"
    res = _plot(str(run_log), str(run_log), "--labels", "a,b", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert out.stat().st_size > 20_000
    img = mpimg.imread(str(out))[..., :3]
    assert img.shape[0] > 400 and img.shape[1] > 800
    non_white = (img < 0.95).any(axis=-1).mean()
    colours = len(np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert non_white > 0.05, non_white
    assert colours > 100, colours
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_plot_run_refuses_a_file_that_is_not_a_run_log(run_log, tmp_path):
    out = tmp_path / "fig.png"
    other = tmp_path / "results.json"
    other.write_text(json.dumps({"steps": 3, "max_abs_diff": 0.0}) + "\n")
    res = _plot(str(run_log), str(other), "--out", str(out))
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"error: {other} is not a run log (no training records with iteration, loss, "
        f"tokens_per_s, ms_per_iter; write one with pretrain_gpt_moe.py --log-json)"
    )
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    res = _plot(str(text), "--out", str(out))
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: {text} is not a run log (line 1 is not a JSON object)"
    assert not out.exists()
