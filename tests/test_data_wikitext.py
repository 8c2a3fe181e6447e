"""`--data-path` naming raw WikiText: a directory of wiki.{train,valid,test}.tokens, or a dataset
name (`wikitext-2`, `wikitext-103`, full names) through its unzipped files or the hub.

The corpora here are small fake WikiText-format files written by the tests (never WikiText's own
text); the hub is never reached (HF_HUB_OFFLINE=1 and an empty HF_HOME).
"""

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest

from megatron_moe.arguments import parse_args
from megatron_moe.data.indexed_dataset import MMapIndexedDataset
from megatron_moe.data.paths import (
    DATA_DIR_ENV,
    split_ranges,
    wikitext_cache_prefix,
    wikitext_local_dir,
    wikitext_source,
)
from megatron_moe.data.preprocess import output_prefix_for
from megatron_moe.data.tokenizer import load_tokenizer
from megatron_moe.parallel_state import local_state
from megatron_moe.training import prepare_data
from tiny_run import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = (
    "river town north old the of a in was built by and ship album species people known "
    "region first 1 @,@ 200 @-@ year song island bridge <unk>"
).split()


def fake_article(rng: random.Random, k: int) -> str:
    """One WikiText-format article: ` = Title = ` heading, a section, blank lines around headings,
    one paragraph per line with a space at both ends."""

    def para() -> str:
        return " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40))) + " . \n"

    return f" = Article {k} = \n \n{para()}{para()} \n = = History = = \n \n{para()} \n"


def write_wikitext(d, splits=("train", "valid", "test"), articles=(12, 3, 3), seed=0) -> dict:
    """Fake wiki.{split}.tokens in `d`; returns {split: [article text, ...]}."""
    rng = random.Random(seed)
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in zip(("train", "valid", "test"), articles):
        docs = [fake_article(rng, 100 * len(out) + k) for k in range(n)]
        if split in splits:
            (d / f"wiki.{split}.tokens").write_text("".join(docs), encoding="utf-8")
            out[split] = docs
    return out


def run_trainer(args, tmp_path, **env_extra):
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        **env_extra,
    )
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt_moe.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _files(d) -> dict:
    return {
        os.path.relpath(os.path.join(p, f), d): os.stat(os.path.join(p, f)).st_mtime_ns
        for p, _, fs in os.walk(d)
        for f in fs
    }


def test_wikitext_directory_trains_and_a_second_run_reuses_the_cache(tmp_path):
    corpus = tmp_path / "my-wikitext"
    docs = write_wikitext(corpus)
    cache = tmp_path / "cache"
    runs = []
    for n in (1, 2):
        log = tmp_path / f"log{n}.jsonl"
        out = run_trainer(
            [*tiny_args(str(corpus), 2, "--vocab-size", "300"), "--log-json", str(log)],
            tmp_path,
            **{DATA_DIR_ENV: str(cache)},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        train = [json.loads(x) for x in log.read_text().splitlines()]
        assert [r["iteration"] for r in train if "split" not in r] == [2]
        runs.append((out.stdout, _files(cache)))
    (first, files1), (second, files2) = runs
    assert f"> data: preprocessed {corpus} ({corpus})" in first and "reusing" not in first
    assert f"> data: reusing {corpus} ({corpus})" in second and "preprocessed" not in second
    assert files2 == files1  # nothing rewritten: same files, same mtimes
    # the cache holds the documents of each split exactly: decode them back (EOD removed)
    [prefix] = {os.path.join(cache, f.split("_train_text_document")[0]) for f in files1 if "_train_" in f}
    assert os.path.basename(prefix).startswith("wikitext-my-wikitext-") and prefix.endswith("-bpe300")
    tok = load_tokenizer(prefix + "_tokenizer")
    assert tok.vocab_size <= 300
    for split, texts in docs.items():
        ds = MMapIndexedDataset(output_prefix_for(prefix, split))
        assert len(ds) == len(texts)
        for i, text in enumerate(texts):
            ids = np.asarray(ds[i]).tolist()
            assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
            assert tok.decode(ids[:-1]) == text
    assert os.listdir(tmp_path / "cache") and not [f for f in os.listdir(tmp_path) if f.startswith("wikitext")]


@pytest.mark.parametrize(
    "word,name,folder",
    [
        ("wikitext-2", "wikitext-2-raw-v1", "wikitext-2-raw"),
        ("wikitext-103", "wikitext-103-raw-v1", "wikitext-103-raw"),
    ],
)
def test_dataset_name_offline_says_what_to_download_and_writes_nothing(tmp_path, word, name, folder):
    cache = tmp_path / "cache"
    out = run_trainer(tiny_args(word, 2), tmp_path, **{DATA_DIR_ENV: str(cache)})
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(
        f"pretrain_gpt_moe.py: error: --data-path {word}: cannot load {name} from the Hugging Face hub ("
    )
    assert (
        f"download WikiText-{word.split('-')[1]} (https://wikitext.smerity.com/{name}.zip) and unzip it "
        f"into {cache} so that {cache}/{folder}/ holds wiki.train.raw, wiki.valid.raw and wiki.test.raw "
        f"(then this --data-path finds it), or pass --data-path DIR naming any directory that holds those "
        f"three files (wiki.*.tokens work too)"
    ) in lines[0]
    assert not cache.exists() and set(os.listdir(tmp_path)) <= {"hf"}  # nothing written but HF's cache


def no_wikitext_message(d) -> str:
    return (
        f"--data-path {d}: {d} has none of wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens "
        f"(or .raw): a WikiText directory needs them (the three splits, or any of them as one corpus "
        f"that --split cuts)"
    )


def test_a_directory_without_wikitext_files_names_them(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "cache"))
    corpus = tmp_path / "no-wikitext"
    corpus.mkdir()
    (corpus / "README.md").write_text("not a split\n")
    with pytest.raises(FileNotFoundError) as e:
        prepare_data(parse_args(tiny_args(str(corpus), 2)), local_state())
    assert str(e.value) == no_wikitext_message(corpus)
    assert not (tmp_path / "cache").exists()


def test_the_shared_real_wikitext2_valid_and_test_are_one_corpus_cut_by_split(tmp_path, monkeypatch):
    real = os.path.join(ROOT, "..", "shared", "wikitext-2")
    if not os.path.isfile(os.path.join(real, "wiki.valid.tokens")):
        pytest.skip(f"{real} (real WikiText-2 valid/test) is absent")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "cache"))
    cfg = parse_args(tiny_args(real, 2, "--split", "90,5,5", "--vocab-size", "512"))
    prepare_data(cfg, local_state())
    prefix = cfg.data.data_path
    assert prefix.startswith(str(tmp_path / "cache" / "wikitext-wikitext-2-")) and prefix.endswith("-bpe512")
    assert len(MMapIndexedDataset(prefix)) == 60 + 62  # the articles of valid, then of test
    assert split_ranges(122, "90,5,5") == {"train": (0, 110), "valid": (110, 116), "test": (116, 122)}


def test_names_resolve_to_unzipped_files_before_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    for word, name in (
        ("wikitext-2", "wikitext-2-raw-v1"),
        ("WikiText-103", "wikitext-103-raw-v1"),
        ("wikitext-2-raw-v1", "wikitext-2-raw-v1"),
        ("wikitext-103-v1", "wikitext-103-v1"),
    ):
        src = wikitext_source(word)
        assert (src.dataset, src.directory, src.word) == (name, None, word)
    assert wikitext_source("wikitext-3") is None and wikitext_source("data/processed/wt103") is None
    local = wikitext_local_dir("wikitext-2-raw-v1")
    assert local == tmp_path / "cache" / "wikitext-2-raw"
    write_wikitext(local)
    src = wikitext_source("wikitext-2")
    assert (src.dataset, src.directory) == (None, local)
    # a directory in the current directory wins over the name; an existing prefix wins over both
    write_wikitext(tmp_path / "wikitext-103")
    assert wikitext_source("wikitext-103").directory == tmp_path / "wikitext-103"
    (tmp_path / "wikitext-103.idx").write_bytes(b"")
    (tmp_path / "wikitext-103.bin").write_bytes(b"")
    assert wikitext_source("wikitext-103") is None


def test_cache_key_follows_the_source_and_the_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "cache"))
    d = tmp_path / "wt"
    write_wikitext(d)
    src = wikitext_source(str(d))
    base = wikitext_cache_prefix(src, None, 300)
    assert os.path.dirname(base) == str(tmp_path / "cache")
    assert wikitext_cache_prefix(src, None, 300) == base
    assert wikitext_cache_prefix(src, None, 512) != base
    assert "-tok-gpt2-" in wikitext_cache_prefix(src, "gpt2", 0)
    (tmp_path / "link").symlink_to(d)  # the key is the files' content, not where they are
    shutil.copytree(d, tmp_path / "copy" / "wt")
    for same in (tmp_path / "link", tmp_path / "copy" / "wt"):
        assert wikitext_cache_prefix(wikitext_source(str(same)), None, 300).endswith(base[-len("-0123456789-bpe300") :])
    os.utime(d / "wiki.train.tokens", ns=(1, 1))  # a touched file is the same content
    assert wikitext_cache_prefix(wikitext_source(str(d)), None, 300) == base
    with open(d / "wiki.train.tokens", "a", encoding="utf-8") as f:
        f.write(" one more line . \n")  # an edited file is preprocessed again
    assert wikitext_cache_prefix(wikitext_source(str(d)), None, 300) != base
    assert wikitext_cache_prefix(wikitext_source("wikitext-2"), None, 300) == str(
        tmp_path / "cache" / "wikitext-2-raw-v1-bpe300"
    )


def test_raw_wikitext_inside_a_blend_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "cache"))
    with pytest.raises(
        ValueError, match="--data-path: wikitext-2 is raw WikiText, which only a one-word --data-path preprocesses"
    ):
        prepare_data(
            parse_args(tiny_args("x", 2)[2:] + ["--data-path", "0.5", "wikitext-2", "0.5", "/d/x"]), local_state()
        )


def _prepare_on_rank(rank, world_size, cache, good, bad):
    """prepare_data on every rank of a 2-rank world: a good directory, then one without WikiText files."""
    from megatron_moe.parallel_state import initialize_model_parallel

    os.environ[DATA_DIR_ENV] = cache
    ps = initialize_model_parallel(1, 1, 1, "gloo")
    cfg = parse_args(tiny_args(good, 2))
    prepare_data(cfg, ps)
    try:
        prepare_data(parse_args(tiny_args(bad, 2)), ps)
        error = None
    except (ValueError, FileNotFoundError) as e:
        error = (type(e).__name__, str(e))
    return cfg.data.data_path, cfg.model.vocab_size, error


def test_two_ranks_share_rank_zeros_preprocessing_and_its_error(tmp_path):
    from megatron_moe.testing import spawn

    write_wikitext(tmp_path / "good")
    (tmp_path / "bad").mkdir()
    out = spawn(
        _prepare_on_rank, 2, str(tmp_path / "cache"), str(tmp_path / "good"), str(tmp_path / "bad"), timeout=120
    )
    assert out[0] == out[1]
    prefix, vocab, error = out[0]
    assert prefix.startswith(str(tmp_path / "cache" / "wikitext-good-")) and prefix.endswith("-bpe8192")
    assert vocab == load_tokenizer(prefix + "_tokenizer").vocab_size
    assert error == ("FileNotFoundError", no_wikitext_message(tmp_path / "bad"))


def test_a_given_tokenizer_is_used_instead_of_training_one(tmp_path, monkeypatch):
    from megatron_moe.data.tokenizer import save_tokenizer, train_tokenizer

    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "cache"))
    docs = write_wikitext(tmp_path / "wt")
    tok_dir = tmp_path / "my-tok"
    save_tokenizer(train_tokenizer(["unrelated words for another vocabulary . \n"] * 20, 270), tok_dir)
    tok = load_tokenizer(str(tok_dir))
    cfg = parse_args(tiny_args(str(tmp_path / "wt"), 2, "--tokenizer-name-or-path", str(tok_dir)))
    prepare_data(cfg, local_state())
    assert "-tok-my-tok-" in os.path.basename(cfg.data.data_path)
    assert cfg.model.vocab_size == tok.vocab_size
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(
        f"{os.path.basename(cfg.data.data_path)}_{s}_text_document.{e}" for s in docs for e in ("bin", "idx")
    )
    ds = MMapIndexedDataset(output_prefix_for(cfg.data.data_path, "valid"))
    assert [np.asarray(ds[i]).tolist() for i in range(len(ds))] == [
        ids + [tok.eod] for ids in tok.encode_batch(docs["valid"])
    ]
