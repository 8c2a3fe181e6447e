"""What the trainer's console says: the start-up summary, a line per checkpoint save, the end summary,
the default main job's checkpoint directory, and --eval-interval 0 (no evaluation at all)."""

import json
import os
import re
import shutil

from tiny_run import tiny_args

from megatron_moe.arguments import parse_args
from megatron_moe.cli import generate
from megatron_moe.cli.pretrain import main as pretrain_main
from megatron_moe.data.paths import DATA_DIR_ENV
from megatron_moe.training import Trainer


def summary(out: str, name: str) -> str:
    """The text of the `> name: ...` line (exactly one)."""
    found = re.findall(rf"^\[[\d\- :]+\] > {name}: (.*)$", out, re.M)
    assert len(found) == 1, (name, out)
    return found[0]


def test_start_up_save_and_end_lines(sample_data, tmp_path, capsys):
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    flags = ("--save", ckpt, "--save-interval", "2", "--log-json", log, "--moe-schedule", "auto")
    trainer = Trainer(parse_args(tiny_args(sample_data, 4, *flags)))
    trainer.stop.restore()  # no SIGUSR1 handler left behind when an assertion fails
    out = capsys.readouterr().out
    assert summary(out, "model") == (
        "GPT-2, 2 layers, hidden 32, 4 heads, FFN 128, sequence 32; 4 experts in 1 MoE layers, top-2, "
        "capacity factor 0.75"
    )
    # by hand: embeddings (32 + 512) x 32, final layer norm 64, per block attention 4 x 32 x 32 + 8 x 32 (biases,
    # layer norms); an MLP or an expert 2 x 32 x 128 + 128 + 32 = 8352: one dense MLP, one MoE layer of a router
    # (4 x 32) and 4 experts, of which a token uses 2
    total = 544 * 32 + 64 + 2 * (4 * 32 * 32 + 8 * 32) + 8352 + 4 * 32 + 4 * 8352
    assert total == sum(p.numel() for p in trainer.model.parameters()) == 68064
    active = total - 2 * 8352
    assert summary(out, "parameters") == f"{total:,} (0.07M), {active:,} (0.05M) active per token (top-2 of 4 experts)"
    assert summary(out, "layout") == "world 1 MP1 EP1 ESP1 DP1 expert-DP1"
    assert summary(out, "data") == f"{sample_data} (--data-path)"
    assert summary(out, "tokenizer") == f"{sample_data}_tokenizer, vocab 512"
    assert summary(out, "device").startswith("cpu, fp32; optimizer ")
    assert summary(out, "training") == (
        "4 iterations of 8 samples x 32 tokens; valid every 4 iterations and test at the end, 1 batches each"
    )
    assert summary(out, "checkpoint") == f"saving to {ckpt} every 2 iterations and at the end"
    assert "parm" not in out  # auto at one MP rank decides nothing and says nothing

    hist = trainer.train()
    out = capsys.readouterr().out
    assert re.findall(r"> saved checkpoint to (.*) \(iteration (\d+)\)", out) == [(ckpt, "2"), (ckpt, "4")]
    evals = {r["split"]: r for r in map(json.loads, open(log)) if "split" in r}
    done = summary(out, "done")
    assert re.fullmatch(r"iterations 1-4 of 4 in [\d.]+ s \(wall\), \d+ tokens/s mean; final lm loss: .*", done)
    assert done.endswith(
        f"final lm loss: train {hist[-1]['loss']:.4f}, valid {evals['valid']['loss']:.4f} "
        f"(ppl {evals['valid']['ppl']:.2f}), test {evals['test']['loss']:.4f} (ppl {evals['test']['ppl']:.2f})"
    )
    assert summary(out, "outputs") == (
        f"checkpoint {ckpt} (iteration 4; mmoe-generate --load {ckpt} samples from it); logs: {log}"
    )


def test_a_signal_stop_says_where_it_saved(sample_data, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    trainer = Trainer(parse_args(tiny_args(sample_data, 4, "--save", ckpt)))
    trainer.stop.received = True  # as SIGUSR1 does: stop and save after the next iteration
    trainer.train()
    out = capsys.readouterr().out
    assert re.findall(r"> saved checkpoint to (.*) \(iteration (\d+)\)", out) == [(ckpt, "1")]
    assert "> done: iterations 1-1 of 4 in " in out and "final lm loss: train " in out
    assert "valid" not in summary(out, "done")  # stopped early: no final evaluation


def test_eval_interval_0_evaluates_nothing(sample_data, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    trainer = Trainer(parse_args(tiny_args(sample_data, 2, "--eval-interval", "0", "--log-json", str(log))))
    assert trainer.valid_loader is None and trainer.test_loader is None
    trainer.train()
    out = capsys.readouterr().out
    assert "no evaluation (--eval-interval 0 or --eval-iters 0)" in summary(out, "training")
    assert " at iteration " not in out and "valid" not in summary(out, "done")
    assert [r["iteration"] for r in map(json.loads, log.read_text().splitlines())] == [2]  # train records only
    assert summary(out, "outputs") == f"no checkpoint (no --save); logs: {log}"


def test_the_default_main_job_saves_under_the_current_directory_and_a_rerun_resumes(
    sample_data, tmp_path, monkeypatch, capsys
):
    data, cwd = tmp_path / "data", tmp_path / "cwd"
    data.mkdir()
    cwd.mkdir()
    for src in [f for f in os.listdir(os.path.dirname(sample_data)) if f.startswith("sample_")]:
        path, dest = os.path.join(os.path.dirname(sample_data), src), data / src.replace("sample_", "wikitext-sample_")
        (shutil.copytree if os.path.isdir(path) else shutil.copy)(path, dest)
    monkeypatch.setenv(DATA_DIR_ENV, str(data))  # the default data, already preprocessed
    monkeypatch.chdir(cwd)
    short = ["--train-iters", "2", "--eval-iters", "1", "--log-interval", "1"]
    assert pretrain_main(short) == 0
    out = capsys.readouterr().out
    assert summary(out, "checkpoint") == (
        "saving to checkpoints/gpt2-moe-tiny at the end (the default main job's --save; --save DIR for another)"
    )
    assert "> saved checkpoint to checkpoints/gpt2-moe-tiny (iteration 2)" in out
    assert summary(out, "data").startswith("reusing the bundled sample corpus (")
    assert sorted(os.listdir(cwd / "checkpoints" / "gpt2-moe-tiny")) == ["iter_0000002", "latest"]

    assert pretrain_main(short) == 0  # the same job again: resumes, nothing left to train, no error
    out = capsys.readouterr().out
    assert summary(out, "checkpoint") == (
        "resuming checkpoints/gpt2-moe-tiny at iteration 2; saving to checkpoints/gpt2-moe-tiny at the end "
        "(the default main job's --save and --load; --save DIR for another); nothing to train: it is at "
        "--train-iters 2 (a larger one continues)"
    )
    assert summary(out, "done").startswith("no iteration trained (at 2 of 2)")
    assert pretrain_main([*short[2:], "--train-iters", "3"]) == 0  # a longer run continues it
    assert summary(capsys.readouterr().out, "done").startswith("iterations 3-3 of 3 ")

    assert pretrain_main([*short, "--seq-length", "64"]) == 0  # not the default job: saves nothing
    assert summary(capsys.readouterr().out, "checkpoint") == "none saved (no --save)"
    assert sorted(os.listdir(cwd / "checkpoints" / "gpt2-moe-tiny")) == ["iter_0000002", "iter_0000003", "latest"]

    assert generate.main(["--prompt", "The", "--max-new-tokens", "3", "--greedy"]) == 0  # its default --load
    assert capsys.readouterr().out.startswith("The")
