"""Reading and preprocessing corpora: the ranks that wait for rank 0's preprocessing wait with their
own bound and message (never a collective under --comm-timeout), a temporary directory left by an
interrupted preprocessing is removed at the next start, and a file that is not UTF-8 is named with
its line (exit 2, nothing written)."""

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from types import SimpleNamespace


from megatron_moe.cli import generate as generate_cli
from megatron_moe.cli import preprocess as preprocess_cli
from megatron_moe.data.paths import DATA_DIR_ENV
from test_data_wikitext import run_trainer, write_wikitext
from tiny_run import tiny_args

COMM_TIMEOUT_S = 2  # the --comm-timeout of the two-rank test; rank 0's preprocessing takes longer
SLOW_S = 6


def _prepare_with_slow_rank0(rank, world_size, cache, corpus, bound_s):
    """prepare_data on 2 ranks whose world group times out after COMM_TIMEOUT_S (--comm-timeout),
    while rank 0's preprocessing takes SLOW_S; `bound_s`: the wait bound of the other ranks
    (None: the trainer's own). Returns (data path, vocab size) or the error's (type, text)."""
    import torch.distributed as dist

    from megatron_moe import training
    from megatron_moe.arguments import parse_args
    from megatron_moe.parallel_state import initialize_model_parallel

    os.environ[DATA_DIR_ENV] = cache
    dist.group.WORLD.set_timeout(timedelta(seconds=COMM_TIMEOUT_S))  # what --comm-timeout gives the trainer
    ps = initialize_model_parallel(1, 1, 1, "gloo", timeout_s=COMM_TIMEOUT_S)
    if rank == 0:

        def slow(*args, **kwargs):
            time.sleep(SLOW_S)
            return SimpleNamespace(vocab_size=321), False

        training.prepare_wikitext_data = slow
    if bound_s is not None:
        training.preprocess_wait_s = lambda *a: bound_s
    cfg = parse_args(tiny_args(corpus, 2, "--comm-timeout", str(COMM_TIMEOUT_S)))
    try:
        training.prepare_data(cfg, ps)
    except Exception as e:  # noqa: BLE001  (what the rank would report)
        return type(e).__name__, str(e)
    return cfg.data.data_path, cfg.model.vocab_size


def test_ranks_wait_for_rank0s_preprocessing_past_the_comm_timeout(tmp_path):
    from megatron_moe.testing import spawn

    write_wikitext(tmp_path / "corpus")
    out = spawn(_prepare_with_slow_rank0, 2, str(tmp_path / "cache"), str(tmp_path / "corpus"), None, timeout=120)
    assert out[0] == out[1] and out[0][1] == 321, out
    assert out[0][0].startswith(str(tmp_path / "cache"))


def test_a_rank_that_waits_past_its_bound_says_what_it_waited_for(tmp_path):
    from megatron_moe.testing import spawn

    write_wikitext(tmp_path / "corpus")
    out = spawn(_prepare_with_slow_rank0, 2, str(tmp_path / "cache"), str(tmp_path / "corpus"), 1.0, timeout=120)
    assert out[0][1] == 321
    kind, text = out[1]
    assert text.startswith("waiting for rank 0 to preprocess ") and str(tmp_path / "corpus") in text, text
    assert "1 s" in text and "--comm-timeout" not in text.split("(")[0]


def test_preprocess_wait_bound_grows_with_the_corpus_and_is_never_below_the_comm_timeout(tmp_path):
    from megatron_moe.training import preprocess_wait_s

    write_wikitext(tmp_path / "small", articles=(2, 1, 1))
    write_wikitext(tmp_path / "big", articles=(400, 1, 1))
    small = preprocess_wait_s(tmp_path / "small", 5.0)
    assert preprocess_wait_s(tmp_path / "big", 5.0) > small >= 600
    assert preprocess_wait_s(tmp_path / "small", 1e6) == 1e6
    assert preprocess_wait_s(None, 5.0) > preprocess_wait_s(tmp_path / "big", 5.0)  # the hub: WikiText-103's size


# ----------------------------------------------------------------------------- leftovers of a killed run
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_preprocessings_temporary_directory_is_removed_at_the_next_start(tmp_path):
    write_wikitext(tmp_path / "corpus", articles=(4, 1, 1))
    out = tmp_path / "out"
    out.mkdir()
    host = socket.gethostname()
    dead = out / f".x.tmp-{host}-{_dead_pid()}"
    live = out / f".x.tmp-{host}-{os.getppid()}"  # a live process (pytest's parent) may be writing it
    other = out / f".x.tmp-elsewhere-{_dead_pid()}"  # another host's process: cannot tell, kept
    for d in (dead, live, other):
        d.mkdir()
        (d / "x_train_text_document.bin").write_bytes(b"half")
    rc = preprocess_cli.main(
        ["--input", str(tmp_path / "corpus"), "--output-prefix", str(out / "x")]
        + ["--train-tokenizer", "--vocab-size", "300", "--no-progress"]
    )
    assert rc == 0
    assert not dead.exists() and live.exists() and other.exists()
    assert (out / "x_train_text_document.idx").is_file()


# ----------------------------------------------------------------------------- not UTF-8
LATIN1 = "caf\xe9 au lait\n".encode("latin-1")  # byte 0xe9 alone is not UTF-8


def corpus_with_bad_line(d, line: int) -> str:
    """A WikiText directory whose wiki.train.tokens has a Latin-1 byte on `line` (1-based)."""
    write_wikitext(d)
    path = d / "wiki.train.tokens"
    lines = path.read_bytes().splitlines(keepends=True)
    lines.insert(line - 1, LATIN1)
    path.write_bytes(b"".join(lines))
    return str(path)


def test_preprocessing_a_non_utf8_corpus_names_the_file_and_line(tmp_path, capsys):
    path = corpus_with_bad_line(tmp_path / "corpus", 7)
    rc = preprocess_cli.main(
        ["--input", str(tmp_path / "corpus"), "--output-prefix", str(tmp_path / "out" / "x")]
        + ["--train-tokenizer", "--vocab-size", "300", "--no-progress"]
    )
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "" and not (tmp_path / "out").exists()
    assert cap.err == f"error: {path}: line 7 is not valid UTF-8 (byte 0xe9 at column 4); save it as UTF-8\n"


def test_a_non_utf8_jsonl_names_the_file_and_line(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "one"}\n{"text": "two"}\n{"text": "' + LATIN1.strip() + b'"}\n')
    rc = preprocess_cli.main(
        ["--input", str(path), "--output-prefix", str(tmp_path / "out" / "x")]
        + ["--train-tokenizer", "--vocab-size", "300", "--no-progress"]
    )
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "" and not (tmp_path / "out").exists()
    assert cap.err.startswith(f"error: {path}: line 3 is not valid UTF-8 (byte 0xe9 at column 14)")


def test_the_trainer_names_the_non_utf8_line_of_a_wikitext_directory(tmp_path):
    path = corpus_with_bad_line(tmp_path / "corpus", 3)
    out = run_trainer(tiny_args(str(tmp_path / "corpus"), 2), tmp_path, **{DATA_DIR_ENV: str(tmp_path / "cache")})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.endswith(f"error: {path}: line 3 is not valid UTF-8 (byte 0xe9 at column 4); save it as UTF-8")
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")  # nothing written


def test_a_non_utf8_prompts_file_names_the_file_and_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"The\nIn 1996\n" + LATIN1)
    rc = generate_cli.main(["--load", str(tmp_path / "none"), "--prompts-file", str(prompts)])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    assert f"error: {prompts}: line 3 is not valid UTF-8 (byte 0xe9 at column 4)" in cap.err, cap.err
