"""TensorBoard scalars and expert-load histograms, timestamped log lines, and the wandb run id
carried through a checkpoint (offline mode)."""

import json
import os
import re

import pytest

from megatron_moe.arguments import parse_args
from megatron_moe.training import pretrain
from tiny_run import tiny_args


def _accumulator(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_tensorboard_has_the_log_line_scalars_and_expert_load(sample_data, tmp_path):
    tb, log_json = tmp_path / "tb", tmp_path / "log.jsonl"
    hist = pretrain(
        parse_args(
            tiny_args(
                sample_data,
                4,
                "--log-interval",
                "2",
                "--eval-interval",
                "2",
                "--tensorboard-dir",
                str(tb),
                "--log-json",
                str(log_json),
            )
        )
    )
    acc = _accumulator(tb)
    tags = acc.Tags()
    for tag in (
        "train/loss",
        "train/aux_loss",
        "train/lr",
        "train/grad_norm",
        "train/dropped_frac",
        "train/load_imbalance",
        "train/tokens_per_s",
        "valid/loss",
        "valid/ppl",
        "test/loss",
    ):
        assert tag in tags["scalars"], (tag, tags["scalars"])
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(loss) == [2, 4]
    for it in (2, 4):
        assert loss[it] == pytest.approx(hist[it - 1]["loss"], rel=1e-6)  # stored as float32
    valid = [json.loads(x) for x in log_json.read_text().splitlines() if '"valid"' in x]
    assert [e.step for e in acc.Scalars("valid/loss")] == [r["iteration"] for r in valid] == [2, 4]
    # expert-load histogram: bucket e holds the tokens routed to expert e in the logged iteration
    assert "train/expert_load" in tags["histograms"]
    h = {e.step: e.histogram_value for e in acc.Histograms("train/expert_load")}
    assert sorted(h) == [2, 4]
    # 8 samples x 32 tokens x top-2 = 512 choices per iteration; the kept ones are counted
    for it in (2, 4):
        rec = hist[it - 1]
        assert h[it].num == pytest.approx(512 * (1 - rec["dropped_frac"]))
        assert len(h[it].bucket) == 4 and sum(h[it].bucket) == h[it].num
        assert max(h[it].bucket) / (h[it].num / 4) == pytest.approx(rec["load_imbalance"])


def test_log_lines_have_timestamps(sample_data, capsys):
    pretrain(parse_args(tiny_args(sample_data, 2, "--log-interval", "1")))
    out = capsys.readouterr().out.splitlines()
    stamp = r"^\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\] "
    train = [ln for ln in out if re.match(stamp + r" iteration      [12]/2 \| consumed samples ", ln)]
    evals = [ln for ln in out if re.match(stamp + r" (valid|test) at iteration      2 \| lm loss ", ln)]
    assert len(train) == 2 and len(evals) == 2, out
    assert all(re.match(stamp, ln) for ln in out if "lm loss" in ln or "> layout:" in ln), out


def _offline_run_ids(wandb_root) -> list[str]:
    """Run ids of the offline run directories, oldest first: `offline-run-<YYYYMMDD_HHMMSS>-<id>`, with
    a `-<n>` suffix when a directory of that second and id already exists (a resumed run)."""
    runs = sorted(d for d in os.listdir(os.path.join(wandb_root, "wandb")) if d.startswith("offline-run-"))
    names = [re.fullmatch(r"offline-run-\d{8}_\d{6}-([0-9a-z]+)(?:-\d+)?", d) for d in runs]
    assert all(names), f"unexpected wandb run directories {runs}"
    return [m.group(1) for m in names if m]


def test_wandb_run_id_is_stored_in_the_checkpoint_and_resumed(sample_data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    ckpt, wb = tmp_path / "ckpt", tmp_path / "wb"
    flags = ("--save", str(ckpt), "--wandb-project", "resume-test", "--wandb-save-dir", str(wb))
    pretrain(parse_args(tiny_args(sample_data, 4, *flags, "--exit-interval", "2")))
    with open(ckpt / "iter_0000002" / "metadata.json") as f:
        run_id = json.load(f)["wandb_run_id"]
    assert _offline_run_ids(wb) == [run_id]  # the id wandb used is the one stored
    pretrain(parse_args(tiny_args(sample_data, 4, *flags, "--load", str(ckpt))))
    assert _offline_run_ids(wb) == [run_id, run_id]  # the resumed job continued the same run
    with open(ckpt / "iter_0000004" / "metadata.json") as f:
        assert json.load(f)["wandb_run_id"] == run_id


def test_wandb_default_directory_is_never_the_cwd(tmp_path, monkeypatch):
    from megatron_moe.logging import wandb_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert wandb_dir(parse_args(["--save", str(tmp_path / "ck")])) == str(tmp_path / "ck")
    assert wandb_dir(parse_args([])) == str(tmp_path / "cache" / "megatron-moe")
    assert wandb_dir(parse_args(["--wandb-save-dir", "/x/y"])) == "/x/y"


def test_missing_tensorboard_gives_a_clear_error(tmp_path, monkeypatch):
    import sys
    from megatron_moe.logging import open_tensorboard

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if it were not installed
    with pytest.raises(
        ImportError,
        match=r"--tensorboard-dir .*tb needs the tensorboard package: "
        r"pip install tensorboard",
    ):
        open_tensorboard(str(tmp_path / "tb"))
    assert not (tmp_path / "tb").exists()
