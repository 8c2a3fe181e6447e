"""--data-path as Megatron spells it: a PREFIX of .bin/.idx cut by --split, weighted blends,
the per-split files preprocess_data.py writes; and the default data found from any directory."""

import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_moe.arguments import parse_args
from megatron_moe.data.blended import BlendedDataset, DocumentRange, blend_index, build_split_dataset
from megatron_moe.data.gpt_dataset import GPTDataset
from megatron_moe.data.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset
from megatron_moe.data.paths import (
    DATA_DIR_ENV,
    default_data_prefix,
    parse_data_path,
    split_prefix,
    split_ranges,
    tokenizer_dir_for,
)
from megatron_moe.data.sampler import build_train_valid_test_data_loaders
from tiny_run import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L = 8


def _write(prefix: str, docs: range, base: int = 0) -> str:
    """Document d holds 3 + d % 5 copies of token base + d: every token names its document."""
    with IndexedDatasetBuilder(prefix) as b:
        for d in docs:
            b.add_document(np.full(3 + d % 5, base + d, dtype=np.uint16))
    return prefix


def _docs_of(ds, base: int = 0) -> set:
    return {int(t) - base for i in range(len(ds)) for t in ds[i]["tokens"].tolist()}


def test_megatron_prefix_loads_and_split_cuts_disjoint_document_ranges(tmp_path):
    prefix = _write(str(tmp_path / "corpus_text_document"), range(1000))
    assert split_ranges(1000, "969,30,1") == {"train": (0, 969), "valid": (969, 999), "test": (999, 1000)}
    train, valid, test = build_train_valid_test_data_loaders(
        prefix,
        L,
        3,
        micro_batch_size=2,
        global_batch_size=4,
        dp_rank=0,
        dp_size=1,
        train_samples=40,
        valid_samples=8,
        test_samples=4,
        split="969,30,1",
    )
    seen = {name: _docs_of(loader.dataset) for name, loader in (("train", train), ("valid", valid), ("test", test))}
    assert seen["train"] <= set(range(0, 969)) and len(seen["train"]) > 20
    assert seen["valid"] <= set(range(969, 999)) and seen["valid"]
    assert seen["test"] == {999}
    # train equals a GPTDataset over a file holding only documents [0, 969) (independent reference)
    ref = GPTDataset(_write(str(tmp_path / "first969"), range(969)), 40, L, 3)
    for i in range(40):
        assert train.dataset[i]["tokens"].tolist() == ref[i]["tokens"].tolist()


def test_split_with_an_empty_needed_split_names_the_flag(tmp_path):
    prefix = _write(str(tmp_path / "c_text_document"), range(50))
    with pytest.raises(ValueError, match="--split 100,0,0 leaves the valid split of --data-path .* no documents"):
        build_train_valid_test_data_loaders(prefix, L, 3, 2, 4, 0, 1, train_samples=8, valid_samples=4, split="100,0,0")


def test_blend_index_follows_the_largest_deficit_rule():
    ds, sample = blend_index([0.3, 0.7], 10)
    # worked by hand: deficits w_k * (i + 1) - n_k, ties to the lower index
    assert ds.tolist() == [1, 0, 1, 1, 0, 1, 1, 1, 0, 1]
    assert sample.tolist() == [0, 0, 1, 2, 1, 3, 4, 5, 2, 6]
    w = np.array([0.2, 0.5, 0.3])
    ds, _ = blend_index(w.tolist(), 1000)
    counts = np.stack([np.cumsum(ds == k) for k in range(3)], axis=1)  # [n, K] after n + 1 items
    ideal = np.arange(1, 1001)[:, None] * w[None, :]
    assert np.abs(counts - ideal).max() < 1.0
    assert counts[-1].tolist() == [200, 500, 300]
    assert blend_index(w.tolist(), 600)[0].tolist() == ds[:600].tolist()  # a prefix of the longer blend


def test_two_dataset_blend_has_the_exact_sample_proportions(tmp_path):
    a = _write(str(tmp_path / "a_text_document"), range(300))
    b = _write(str(tmp_path / "b_text_document"), range(300), base=1000)
    ds = build_split_dataset(["0.3", a, "0.7", b], "train", 50, L, seed=5, split_weights="100,0,0")
    assert isinstance(ds, BlendedDataset) and len(ds) == 50
    from_a = [i for i in range(50) if ds[i]["tokens"].max() < 1000]
    from_b = [i for i in range(50) if ds[i]["tokens"].min() >= 1000]
    assert len(from_a) == 15 and len(from_b) == 35
    # the j-th item taken from A is sample j of A's own train dataset
    ref_a = GPTDataset(DocumentRange(MMapIndexedDataset(a), 0, 300), 15, L, 5)
    for j, i in enumerate(from_a):
        assert ds[i]["tokens"].tolist() == ref_a[j]["tokens"].tolist()


def test_a_blend_mixes_per_split_files_and_megatron_prefixes(tmp_path):
    per_split = str(tmp_path / "wt")
    for k, s in enumerate(("train", "valid", "test")):
        _write(split_prefix(per_split, s), range(40), base=100 * k)
    single = _write(str(tmp_path / "m_text_document"), range(100), base=2000)
    train, valid, _ = build_train_valid_test_data_loaders(
        ["1", per_split, "1", single], L, 3, 2, 4, 0, 1, train_samples=16, valid_samples=8, split="90,10,0"
    )
    docs = _docs_of(valid.dataset)
    assert docs & set(range(100, 140)) and docs & {2000 + d for d in range(90, 100)}
    assert docs <= set(range(100, 140)) | {2000 + d for d in range(90, 100)}


def test_data_path_flag_takes_megatron_blend_syntax():
    cfg = parse_args(["--data-path", "0.3", "A", "0.7", "B", "--split", "98,2,0"])
    assert cfg.data.data_path == ["0.3", "A", "0.7", "B"] and cfg.data.split == "98,2,0"
    assert parse_data_path(cfg.data.data_path) == [(0.3, "A"), (0.7, "B")]
    assert parse_args(["--data-path", "/d/x_text_document"]).data.data_path == "/d/x_text_document"
    with pytest.raises(ValueError, match="must alternate WEIGHT PREFIX, got 3 words"):
        parse_data_path(["0.3", "A", "B"])
    with pytest.raises(ValueError, match="'A' is not a weight"):
        parse_data_path(["A", "B"])
    with pytest.raises(ValueError, match="--split must be three non-negative weights"):
        parse_args(["--split", "90,10"])


def test_missing_prefix_names_both_forms(tmp_path):
    with pytest.raises(
        FileNotFoundError,
        match=r"neither .*nope\.idx \(a Megatron prefix\) nor "
        r".*nope_train_text_document\.idx \(per-split files\)",
    ):
        build_split_dataset(str(tmp_path / "nope"), "train", 4, L, 1)


def test_tokenizer_is_looked_for_beside_the_corpus():
    assert tokenizer_dir_for("/d/wt103") == "/d/wt103_tokenizer"
    assert tokenizer_dir_for("/d/wt103_train_text_document") == "/d/wt103_tokenizer"
    assert tokenizer_dir_for(["0.5", "/d/a_text_document", "0.5", "/d/b"]) == "/d/a_tokenizer"


def test_default_data_location_ignores_the_cwd(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "mine"))
    assert default_data_prefix() == str(tmp_path / "mine" / "wikitext-sample")
    monkeypatch.delenv(DATA_DIR_ENV)
    monkeypatch.chdir(tmp_path)
    prefix = default_data_prefix()
    assert os.path.isabs(prefix) and not prefix.startswith(str(tmp_path))


def test_trainer_from_another_directory_writes_nothing_there(tmp_path):
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != DATA_DIR_ENV}
    env.update(
        PYTHONPATH=ROOT,
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        XDG_CACHE_HOME=str(tmp_path / "cache"),
    )
    args = tiny_args("unused", 2)[2:]  # the tiny model, without --data-path
    assert "--data-path" not in args
    code = (
        "import sys; from megatron_moe.arguments import parse_args; from megatron_moe.training import "
        "pretrain; h = pretrain(parse_args(sys.argv[1:])); print('iterations run', len(h))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "iterations run 2" in out.stdout
    assert os.listdir(cwd) == []
