"""Bad input is refused with one clear error: every numeric flag is checked
beside its dataclass field, the trainer prints one `error:` line and exits 2, and indexed datasets
are validated when opened (cached beside the index, rechecked when the files change)."""

import json
import os
import sys

import numpy as np
import pytest

from megatron_moe.arguments import parse_args
from megatron_moe.data.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset
from megatron_moe.testing import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "pretrain_gpt_moe.py")

BAD_FLAGS = [
    (["--min-lr", "-1"], "--min-lr must be >= 0, got -1.0"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr 0.01 must be <= --lr 0.001"),
    (["--lr", "-1", "--min-lr", "0"], "--lr must be >= 0, got -1.0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["--comm-timeout", "-5"], "--comm-timeout must be positive, got -5.0"),
    (["--save-interval", "-1"], "--save-interval must be >= 0, got -1"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be >= 0, got -1"),
    (["--eval-iters", "-1"], "--eval-iters must be >= 0, got -1"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0, got -1.0"),
    (["--expert-sharding-parallel-size", "0"], "--expert-sharding-parallel-size must be >= 1, got 0"),
    (["--keep-last", "-1"], "--keep-last must be >= 0, got -1"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout must be in [0, 1), got 1.5"),
    (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1), got 1.0"),
    (["--log-interval", "0"], "--log-interval must be >= 1, got 0"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
    (["--sgd-momentum", "5"], "--sgd-momentum must be in [0, 1), got 5.0"),
]


@pytest.mark.parametrize("argv,message", BAD_FLAGS, ids=[a[0] for a, _ in BAD_FLAGS])
def test_each_bad_flag_is_refused_naming_it(argv, message):
    with pytest.raises(ValueError) as e:
        parse_args(argv)
    assert str(e.value).startswith(message.split(" must")[0].split(" needs")[0])
    assert message in str(e.value)


def test_the_defaults_and_edge_values_pass():
    cfg = parse_args(["--lr", "0", "--min-lr", "0", "--clip-grad", "0", "--save-interval", "0", "--eval-iters", "0"])
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.train.keep_last, cfg.train.check_for_nan_in_loss_and_grad) == (
        0.0,
        0.0,
        0,
        True,
    )
    assert parse_args(["--no-check-for-nan-in-loss-and-grad"]).train.check_for_nan_in_loss_and_grad is False


def run_trainer(argv, cwd, nproc=1):
    launch = (
        [sys.executable, TRAINER]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            "0",
            TRAINER,
        ]
    )
    return run_command(
        launch + argv, cwd=str(cwd), timeout=300, env=dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    )


@pytest.mark.parametrize("argv,message", [BAD_FLAGS[0], BAD_FLAGS[10]], ids=["min-lr", "esp"])
def test_the_trainer_prints_one_error_line_and_exits_2(tmp_path, argv, message):
    out = run_trainer(argv, tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"pretrain_gpt_moe.py: error: {message}"]
    assert os.listdir(tmp_path) == []  # nothing written (no data preprocessed)


def test_two_ranks_report_a_bad_flag_once(tmp_path):
    out = run_trainer(["--micro-batch-size", "0"], tmp_path, nproc=2)
    assert out.returncode != 0
    assert [ln for ln in (out.stdout + out.stderr).splitlines() if "pretrain_gpt_moe.py: error:" in ln] == [
        "pretrain_gpt_moe.py: error: --micro-batch-size must be >= 1, got 0"
    ]


def test_a_rank_failing_after_the_reporter_exited_stays_silent(tmp_path):
    """The race behind a doubled error line: rank 0 reports and exits before rank 1 asks."""
    attempt = tmp_path / "attempt_0"
    code = "from megatron_moe.cli.pretrain import first_to_report; print(first_to_report())"
    answers = []
    for rank in (0, 1):  # one after the other: the first process is gone when the second asks
        (attempt / str(rank)).mkdir(parents=True)
        env = dict(
            os.environ,
            PYTHONPATH=ROOT,
            WORLD_SIZE="2",
            RANK=str(rank),
            MASTER_PORT="29999",
            TORCHELASTIC_ERROR_FILE=str(attempt / str(rank) / "error.json"),
        )
        out = run_command([sys.executable, "-c", code], env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        answers.append(out.stdout.strip())
    assert answers == ["True", "False"]


def test_the_trainer_names_a_garbage_latest_and_exits_2(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("not-a-number")
    out = run_trainer(
        [
            "--data-path",
            str(tmp_path / "none"),
            "--vocab-size",
            "512",
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--load",
            str(ckpt),
        ],
        tmp_path,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    err = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(err) == 1
    assert f"{ckpt / 'latest'} is unreadable: 'not-a-number' is not an iteration number" in err[0]
    assert "no complete iteration exists under --load" in err[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and os.listdir(ckpt) == ["latest"]


# ----------------------------------------------------------------------------- indexed datasets
DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def build(prefix, docs=DOCS) -> str:
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for d in docs:
            b.add_document(d)
    return str(prefix) + ".idx"


def patch_idx(idx: str, offset: int, values, dtype) -> None:
    """Overwrite the index at byte `offset` with `values`, keeping size (and, below, mtime)."""
    st = os.stat(idx)
    with open(idx, "r+b") as f:
        f.seek(offset)
        f.write(np.asarray(values, dtype=dtype).tobytes())
    os.utime(idx, ns=(st.st_atime_ns, st.st_mtime_ns))  # only the hash tells the change


HEADER, N = 34, len(DOCS)


@pytest.mark.parametrize(
    "offset,values,dtype,message",
    [
        (HEADER, [5, -2, 6], "<i4", "sequence 1 has negative size -2"),  # shifted, same total
        (
            HEADER + 4 * N + 8 * 2,
            [8],
            "<i8",
            "pointer of sequence 2 is 8, but the sizes before it and the token dtype uint16 put it at 10",
        ),
        (
            HEADER + 12 * N,
            [0, 2, 1, 3],
            "<i8",
            "the document index must start at 0, never decrease and end at the number of sequences 3",
        ),
    ],
    ids=["negative-size", "pointer", "doc-index"],
)
def test_a_bad_index_is_refused_naming_the_file_even_after_it_was_cached_valid(
    tmp_path, offset, values, dtype, message
):
    idx = build(tmp_path / "ds")
    assert MMapIndexedDataset(tmp_path / "ds").max_token_id == 9
    cache = json.loads(open(idx + ".valid").read())
    assert cache["max_token_id"] == 9 and cache["key"]["idx_size"] == os.path.getsize(idx)
    patch_idx(idx, offset, values, dtype)
    with pytest.raises(ValueError) as e:
        MMapIndexedDataset(tmp_path / "ds")
    assert str(e.value) == f"{idx}: {message}"


def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_bin(tmp_path):
    build(tmp_path / "ds")
    ds = MMapIndexedDataset(tmp_path / "ds")
    ds.check_vocab(10)
    with pytest.raises(ValueError, match=f"{tmp_path / 'ds'}.bin: token id 9 is outside the vocabulary of 9"):
        ds.check_vocab(9)


def test_the_trainer_refuses_data_tokenized_beyond_its_vocabulary(tmp_path):
    from megatron_moe.training import Trainer

    for split in ("train", "valid", "test"):
        build(tmp_path / f"d_{split}_text_document", [list(range(600))] * 4)
    argv = [
        "--data-path",
        str(tmp_path / "d"),
        "--vocab-size",
        "512",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "2",
        "--eval-iters",
        "1",
    ]
    with pytest.raises(
        ValueError,
        match=r"d_train_text_document.bin: token id 599 is outside the vocabulary "
        r"of 512",
    ):
        Trainer(parse_args(argv))


@pytest.mark.parametrize("words", [["inf", "a", "1", "b"], ["nan", "a", "1", "b"]])
def test_a_blend_weight_must_be_finite(words):
    from megatron_moe.data.paths import parse_data_path

    with pytest.raises(ValueError, match=f"--data-path: weight {words[0]} of a must be a finite number >= 0"):
        parse_data_path(words)


def test_a_split_weight_must_be_finite():
    from megatron_moe.data.paths import parse_split

    with pytest.raises(ValueError, match="--split must be three non-negative weights"):
        parse_split("inf,1,1")


# ----------------------------------------------------------------------------- a flag given twice
TWICE = [
    (["--lr", "1e-3", "--lr", "2e-3"], "--lr given twice"),
    (["--lr", "1e-3", "--lr", "1e-3"], "--lr given twice"),  # even with the same value
    (["--bf16", "--no-bf16"], "--no-bf16 given twice (as --bf16 and --no-bf16)"),
    (["--data-path", "a", "--data-path", "0.5", "b", "0.5", "c"], "--data-path given twice"),
]


@pytest.mark.parametrize("argv,message", TWICE, ids=["lr", "lr-same", "bool-pair", "nargs"])
def test_a_flag_given_twice_is_refused_naming_it(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


def test_a_flag_given_once_with_several_values_still_parses():
    cfg = parse_args(["--data-path", "0.3", "a", "0.7", "b", "--bf16"])
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"] and cfg.optim.bf16 is True
    assert {"data.data_path", "optim.bf16"} <= cfg.explicit_flags and "optim.lr" not in cfg.explicit_flags


def test_the_trainer_and_a_tool_refuse_a_flag_given_twice(tmp_path, capsys):
    from tool_modules import load_tool

    out = run_trainer(["--lr", "1e-3", "--lr", "2e-3"], tmp_path)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == "pretrain_gpt_moe.py: error: --lr given twice"
    with pytest.raises(SystemExit) as e:
        load_tool("bench_moe_layer").parse_args(["--num-experts", "4", "--num-experts", "8"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().endswith("error: --num-experts given twice")
