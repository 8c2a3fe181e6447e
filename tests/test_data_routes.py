"""The data routes of a new user: WikiText's valid and test files alone, a resume with
--use-checkpoint-args reusing the preprocessed corpus, and a hub that cannot be reached failing
at once. The corpora are fake WikiText files written here (test_data_wikitext.write_wikitext)."""

import json
import os
import socket
import subprocess
import sys

from megatron_moe.data.indexed_dataset import MMapIndexedDataset
from megatron_moe.data.paths import DATA_DIR_ENV
from test_data_wikitext import ROOT, run_trainer, write_wikitext
from tiny_run import tiny_args


def _outputs(cache) -> list:
    """The preprocessed files and tokenizers in `cache` (not the sample-index caches)."""
    return sorted(f for f in os.listdir(cache) if not f.endswith(".npz"))


def test_valid_and_test_files_alone_train_as_one_corpus_cut_by_split(tmp_path):
    corpus = tmp_path / "wikitext-2"
    docs = write_wikitext(corpus, splits=("valid", "test"), articles=(0, 10, 10))
    cache = tmp_path / "cache"
    log = tmp_path / "log.jsonl"
    argv = tiny_args(str(corpus), 2, "--split", "80,10,10", "--vocab-size", "300", "--eval-interval", "2")
    out = run_trainer([*argv, "--log-json", str(log)], tmp_path, **{DATA_DIR_ENV: str(cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    [prefix] = {os.path.join(cache, f[: -len(".idx")]) for f in os.listdir(cache) if f.endswith(".idx")}
    assert (
        f"> data: preprocessed {corpus} ({corpus}) at {prefix}.{{bin,idx}} (wiki.valid.tokens + "
        f"wiki.test.tokens as one corpus, cut into train/valid/test by --split 80,10,10)"
    ) in out.stdout
    assert _outputs(cache) == [os.path.basename(prefix) + s for s in (".bin", ".idx", ".idx.valid", "_tokenizer")]
    assert len(MMapIndexedDataset(prefix)) == len(docs["valid"]) + len(docs["test"])
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert {r.get("split") for r in records} >= {"valid", "test"}  # 16 / 2 / 2 documents


def test_a_resume_with_use_checkpoint_args_reuses_the_preprocessed_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    write_wikitext(corpus)
    cache, ckpt = tmp_path / "cache", str(tmp_path / "ckpt")
    env = {DATA_DIR_ENV: str(cache)}
    first = run_trainer([*tiny_args(str(corpus), 2, "--vocab-size", "300"), "--save", ckpt], tmp_path, **env)
    assert first.returncode == 0, first.stderr[-3000:]
    files = _outputs(cache)
    argv = ["--data-path", str(corpus), "--load", ckpt, "--use-checkpoint-args", "--save", ckpt]
    second = run_trainer(
        [*argv, "--train-iters", "3", "--global-batch-size", "8", "--eval-interval", "0"], tmp_path, **env
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "> data: preprocessed" in first.stdout and "> data: reusing" in second.stdout, second.stdout
    assert f"> tokenizer: {ckpt}/iter_0000002/tokenizer" in second.stdout  # the checkpoint's copy ...
    assert _outputs(cache) == files  # ... named the same cache: nothing preprocessed again
    assert [f.endswith(("_tokenizer", ".idx")) for f in files].count(True) == 4, files  # one BPE, three splits


def _time_the_hub_error(tmp_path, **env) -> tuple:
    """(seconds, message) of preprocessing `wikitext-2` from the hub in a fresh process whose
    environment is `env` (datasets imported before the clock starts)."""
    code = (
        "import json, sys, time, datasets\n"
        "from megatron_moe.data.paths import wikitext_source\n"
        "from megatron_moe.data.preprocess import prepare_wikitext_data\n"
        "t = time.perf_counter()\n"
        "try:\n"
        "    prepare_wikitext_data(wikitext_source('wikitext-2'), sys.argv[1], vocab_size=300)\n"
        "except ValueError as e:\n"
        "    print(json.dumps([time.perf_counter() - t, str(e)]))\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    base.update(PYTHONPATH=ROOT, HF_HOME=str(tmp_path / "hf"), **{DATA_DIR_ENV: str(tmp_path / "cache")}, **env)
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "cache" / "wt2")],
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout, out.stderr[-3000:]
    return tuple(json.loads(out.stdout.splitlines()[-1]))


def test_an_unreachable_hub_fails_at_once_naming_data_path(tmp_path):
    with socket.socket() as closed:  # bound, never listening: a connection is refused at once
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        cases = {
            "HF_HUB_OFFLINE=1": _time_the_hub_error(tmp_path, HF_HUB_OFFLINE="1"),
            "no network": _time_the_hub_error(tmp_path, HF_ENDPOINT=endpoint),  # HF_HUB_OFFLINE unset
        }
    for case, (seconds, message) in cases.items():
        assert seconds < 2.0, (case, seconds, message)  # huggingface_hub's retries took 25 s
        assert message.startswith("--data-path wikitext-2: cannot load wikitext-2-raw-v1 from the Hugging Face hub")
        assert "or pass --data-path DIR naming any directory that holds those three files" in message, message
    assert f"{endpoint} is unreachable" in cases["no network"][1] and "HF_HUB_OFFLINE=1" in cases["no network"][1]
    assert not (tmp_path / "cache").exists()
