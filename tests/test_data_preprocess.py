"""Preprocessing end to end: the bundled corpus through `python tools/preprocess_data.py` with a
trained tokenizer, a local GPT-2-format tokenizer through AutoTokenizer, jsonl input, workers,
and clear errors that leave no output behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from megatron_moe.data.indexed_dataset import MMapIndexedDataset
from megatron_moe.data.preprocess import SAMPLE_CORPUS_DIR, prepare_sample_data, preprocess, split_wikitext_documents
from megatron_moe.data.tokenizer import load_tokenizer

from megatron_moe.cli import preprocess as preprocess_data  # the CLI, called in-process for the error cases

ROOT = Path(__file__).resolve().parents[1]


def corpus_docs(split: str) -> list[str]:
    with open(SAMPLE_CORPUS_DIR / f"wiki.{split}.tokens", encoding="utf-8") as f:
        return list(split_wikitext_documents(f))


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """The bundled corpus preprocessed by the script, run the way a user runs it."""
    out = tmp_path_factory.mktemp("pre") / "sample"
    proc = subprocess.run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            "data/wikitext-sample",
            "--output-prefix",
            str(out),
            "--train-tokenizer",
            "--vocab-size",
            "512",
            "--append-eod",
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
    )
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_documents_round_trip_with_trained_tokenizer(sample, split):
    tok = tokenizers.Tokenizer.from_file(f"{sample}_tokenizer/tokenizer.json")  # independent
    eod = tok.token_to_id("<|endoftext|>")
    ds = MMapIndexedDataset(f"{sample}_{split}_text_document")
    docs = corpus_docs(split)
    assert ds.dtype == np.uint16 and tok.get_vocab_size() == 512
    assert len(ds) == len(docs) == sum(1 for d in docs if d.startswith(" = "))
    for i, doc in enumerate(docs):
        ids = ds[i].tolist()
        assert ids == tok.encode(doc, add_special_tokens=False).ids + [eod]
        assert tok.decode(ids[:-1], skip_special_tokens=False) == doc  # byte-level: lossless


def test_workers_give_identical_files(sample, tmp_path):
    out = tmp_path / "w2"
    preprocess(
        str(out),
        input_path=str(SAMPLE_CORPUS_DIR),
        tokenizer_name_or_path=f"{sample}_tokenizer",
        append_eod=True,
        workers=2,
        progress=False,
    )
    for split in ("train", "valid", "test"):
        for ext in (".bin", ".idx"):
            a = Path(f"{sample}_{split}_text_document{ext}").read_bytes()
            assert Path(f"{out}_{split}_text_document{ext}").read_bytes() == a
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"w2_{s}_text_document.{e}" for s in ("train", "valid", "test") for e in ("bin", "idx")
    )


def test_jsonl_single_file_with_split(sample, tmp_path):
    docs = corpus_docs("valid")[:10]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    res = preprocess(
        str(tmp_path / "j"),
        input_path=str(src),
        tokenizer_name_or_path=f"{sample}_tokenizer",
        split=(60, 40, 0),
        progress=False,
    )
    assert set(res.prefixes) == {"train/text", "valid/text"}
    assert not (tmp_path / "j_test_text_document.idx").exists()
    tok = load_tokenizer(f"{sample}_tokenizer")
    got = [
        ds[i].tolist()
        for ds in (MMapIndexedDataset(res.prefixes["train/text"]), MMapIndexedDataset(res.prefixes["valid/text"]))
        for i in range(len(ds))
    ]
    assert got == [tok.encode(d) for d in docs]  # no --append-eod: no EOD at the end
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no text field \['text'\] \(--json-keys\)"):
        preprocess(
            str(tmp_path / "k"),
            input_path=str(tmp_path / "bad.jsonl"),
            tokenizer_name_or_path=f"{sample}_tokenizer",
            progress=False,
        )


def test_prepare_sample_data_runs_once(tmp_path):
    first = prepare_sample_data(str(tmp_path / "s"), vocab_size=300)
    stamp = os.stat(tmp_path / "s_train_text_document.bin").st_mtime_ns
    again = prepare_sample_data(str(tmp_path / "s"), vocab_size=300)
    assert os.stat(tmp_path / "s_train_text_document.bin").st_mtime_ns == stamp
    assert (
        (again.vocab_size, again.eod, again.tokens, again.documents)
        == (first.vocab_size, first.eod, first.tokens, first.documents)
        == (300, 0, first.tokens, {f"{s}/text": len(corpus_docs(s)) for s in ("train", "valid", "test")})
    )


def _run_cli(args, capsys) -> tuple[int, str]:
    rc = preprocess_data.main([str(a) for a in args] + ["--no-progress"])
    return rc, capsys.readouterr().err


def test_missing_input_is_named_and_writes_nothing(tmp_path, capsys):
    rc, err = _run_cli(
        [
            "--input",
            tmp_path / "nope",
            "--output-prefix",
            tmp_path / "out" / "x",
            "--train-tokenizer",
            "--vocab-size",
            300,
        ],
        capsys,
    )
    assert rc == 2 and "--input" in err and "nope does not exist" in err
    assert os.listdir(tmp_path) == []


def test_empty_input_file_is_named_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    rc, err = _run_cli(
        [
            "--input",
            tmp_path / "empty.txt",
            "--output-prefix",
            tmp_path / "x",
            "--train-tokenizer",
            "--vocab-size",
            300,
        ],
        capsys,
    )
    assert rc == 2 and "--input" in err and "empty.txt is empty" in err
    assert os.listdir(tmp_path) == ["empty.txt"]


def test_empty_split_found_late_leaves_no_partial_output(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    docs = corpus_docs("test")
    (src / "wiki.train.tokens").write_text("".join(docs[:5]))
    (src / "wiki.valid.tokens").write_text(" \n \n")  # no document in it
    (src / "wiki.test.tokens").write_text("".join(docs[5:7]))
    (tmp_path / "out").mkdir()
    rc, err = _run_cli(
        [
            "--input",
            src,
            "--output-prefix",
            tmp_path / "out" / "x",
            "--train-tokenizer",
            "--vocab-size",
            300,
            "--append-eod",
        ],
        capsys,
    )
    assert rc == 2 and "wiki.valid.tokens: no documents found" in err
    assert os.listdir(tmp_path / "out") == []  # train was done, but not kept
    os.remove(src / "wiki.test.tokens")
    rc, err = _run_cli(
        ["--input", src, "--output-prefix", tmp_path / "out" / "x", "--train-tokenizer", "--vocab-size", 300], capsys
    )
    assert rc == 2 and "wiki.test.raw, wiki.test.tokens, test.jsonl" in err


def test_flag_combinations_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        preprocess_data.parse_args(["--input", "x", "--output-prefix", "y", "--train-tokenizer"])
    assert "--train-tokenizer needs --vocab-size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--vocab-size 100 is too small"):
        preprocess(
            str(tmp_path / "x"), input_path=str(SAMPLE_CORPUS_DIR), train_tokenizer=True, vocab_size=100, progress=False
        )
    assert os.listdir(tmp_path) == []


# ---- GPT-2 BPE through transformers.AutoTokenizer, from a tiny local directory ----


def make_tiny_gpt2_dir(path: Path) -> Path:
    """A GPT-2-format tokenizer directory (vocab.json, merges.txt, tokenizer_config.json) like
    the hub's `gpt2`, with a small byte-level BPE and <|endoftext|> as the last id."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        corpus_docs("valid"),
        tokenizers.trainers.BpeTrainer(
            vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        ),
    )
    path.mkdir()
    bpe.model.save(str(path))
    vocab = json.loads((path / "vocab.json").read_text())
    vocab["<|endoftext|>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024})
    )
    return path


def test_local_gpt2_tokenizer_through_autotokenizer(sample, tmp_path):
    transformers = pytest.importorskip("transformers")
    gpt2_dir = make_tiny_gpt2_dir(tmp_path / "gpt2-tiny")
    hf = transformers.AutoTokenizer.from_pretrained(str(gpt2_dir))
    assert hf.eos_token_id == 400
    res = preprocess(
        str(tmp_path / "g"),
        input_path=str(SAMPLE_CORPUS_DIR / "wiki.test.tokens"),
        tokenizer_name_or_path=str(gpt2_dir),
        append_eod=True,
        split=(80, 10, 10),
        progress=False,
    )
    assert (res.eod, res.vocab_size, res.dtype) == (400, 401, "uint16")
    docs = corpus_docs("test")
    got = [
        ds[i].tolist()
        for s in ("train", "valid", "test")
        for ds in [MMapIndexedDataset(res.prefixes[f"{s}/text"])]
        for i in range(len(ds))
    ]
    assert got == [hf(d)["input_ids"] + [400] for d in docs]
    # the trained tokenizer directory is an AutoTokenizer directory too, with the same ids
    ours = transformers.AutoTokenizer.from_pretrained(f"{sample}_tokenizer")
    assert ours.eos_token_id == 0
    assert ours(docs[0])["input_ids"] == load_tokenizer(f"{sample}_tokenizer").encode(docs[0])


def test_unloadable_tokenizer_names_the_flag(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="--tokenizer-name-or-path no-such/tokenizer-here"):
        preprocess(
            str(tmp_path / "x"),
            input_path=str(SAMPLE_CORPUS_DIR),
            tokenizer_name_or_path="no-such/tokenizer-here",
            progress=False,
        )
    assert os.listdir(tmp_path) == []


def test_hub_route_gives_the_same_documents_as_the_files(sample, tmp_path, monkeypatch):
    """`--dataset` with `datasets.load_dataset` replaced by rows laid out like the hub's
    WikiText (one row per line, newline kept, blank lines as ""): no network needed."""
    datasets = pytest.importorskip("datasets")

    def rows(split):
        with open(SAMPLE_CORPUS_DIR / f"wiki.{split}.tokens", encoding="utf-8") as f:
            return datasets.Dataset.from_dict({"text": ["" if ln == " \n" else ln for ln in f]})

    calls = []

    def fake_load_dataset(path, name):
        calls.append((path, name))
        return datasets.DatasetDict(train=rows("train"), validation=rows("valid"), test=rows("test"))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    preprocess(
        str(tmp_path / "hub"),
        dataset="wikitext-2-raw-v1",
        tokenizer_name_or_path=f"{sample}_tokenizer",
        append_eod=True,
        progress=False,
    )
    assert calls == [("wikitext", "wikitext-2-raw-v1")]
    for split in ("train", "valid", "test"):
        for ext in (".bin", ".idx"):
            assert (
                Path(f"{tmp_path / 'hub'}_{split}_text_document{ext}").read_bytes()
                == Path(f"{sample}_{split}_text_document{ext}").read_bytes()
            )
