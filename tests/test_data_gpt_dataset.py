"""GPT dataset: samples are windows of the shuffled stream; the shuffle is seeded, per epoch,
and cached on disk."""

import os

import numpy as np
import pytest
import torch

from megatron_moe.data import gpt_dataset
from megatron_moe.data.gpt_dataset import GPTDataset, build_sample_index, sample_index_path
from megatron_moe.data.indexed_dataset import IndexedDatasetBuilder


def make_dataset(path, sizes) -> tuple[str, list[np.ndarray]]:
    """Documents whose tokens say where they come from: doc d holds d*100 + 0, 1, 2, ..."""
    docs = [d * 100 + np.arange(n) for d, n in enumerate(sizes)]
    prefix = str(path / "ds")
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for doc in docs:
            b.add_document(doc)
    return prefix, docs


def stream_from(doc_idx, docs) -> np.ndarray:
    """The concatenated token stream, rebuilt independently from the document order."""
    return np.concatenate([docs[d] for d in doc_idx])


@pytest.mark.parametrize(
    "sizes,seq_length,num_samples",
    [
        ([13, 7, 0, 21, 5, 9, 30, 2, 11, 4], 8, 40),  # several epochs, an empty document
        ([3, 2, 4], 16, 5),  # a window longer than the whole data
        ([50], 10, 12),
    ],
)
def test_samples_are_windows_of_the_stream(tmp_path, sizes, seq_length, num_samples):
    prefix, docs = make_dataset(tmp_path, sizes)
    ds = GPTDataset(prefix, num_samples, seq_length, seed=5)
    stream = stream_from(ds.doc_idx, docs)
    total = sum(sizes)
    for e in range(len(ds.doc_idx) // len(sizes)):  # every epoch lists every document once
        assert sorted(ds.doc_idx[e * len(sizes) : (e + 1) * len(sizes)]) == list(range(len(sizes)))
    assert len(ds) == num_samples
    seen = []
    for i in range(num_samples):
        k = int(ds.shuffle_idx[i])
        tokens = ds[i]["tokens"]
        assert tokens.dtype == torch.int64 and tokens.shape == (seq_length + 1,)
        window = stream[k * seq_length : (k + 1) * seq_length + 1]
        np.testing.assert_array_equal(tokens.numpy(), window)
        seen.append(k)
    # epoch-aware: each epoch's samples come out before any sample of the next epoch
    epochs = [k * seq_length // total for k in seen]
    assert epochs == sorted(epochs)
    assert len(set(seen)) == num_samples


def test_full_epochs_visit_every_sample_once(tmp_path):
    sizes = [10, 10, 10, 10]  # 40 tokens, seq_length 8: 5 samples start in each epoch
    prefix, _ = make_dataset(tmp_path, sizes)
    ds = GPTDataset(prefix, 15, 8, seed=1)
    for e in range(3):
        assert sorted(ds.shuffle_idx[5 * e : 5 * e + 5].tolist()) == list(range(5 * e, 5 * e + 5))


def test_shuffle_is_seeded_and_grows_by_prefix():
    sizes = np.arange(1, 60) % 17 + 3
    a = build_sample_index(sizes, 16, 200, seed=7)
    b = build_sample_index(sizes, 16, 200, seed=7)
    c = build_sample_index(sizes, 16, 200, seed=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[2], c[2])
    assert not np.array_equal(a[0][: len(sizes)], c[0][: len(sizes)])
    # a longer run sees the same samples first (index for N is a prefix of index for 3N)
    big = build_sample_index(sizes, 16, 600, seed=7)
    np.testing.assert_array_equal(big[2][:200], a[2])
    np.testing.assert_array_equal(big[0][: len(a[0])], a[0])
    # each epoch has its own document order
    n = len(sizes)
    assert not np.array_equal(big[0][:n], big[0][n : 2 * n])


def test_index_is_cached_and_reused(tmp_path, monkeypatch):
    prefix, _ = make_dataset(tmp_path, [9, 14, 6, 20])
    first = GPTDataset(prefix, 10, 4, seed=3)
    path = sample_index_path(prefix, 10, 4, 3)
    assert os.path.dirname(path) == str(tmp_path) and os.path.isfile(path)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]

    def fail(*a, **k):
        raise AssertionError("the cached index should have been used")

    monkeypatch.setattr(gpt_dataset, "build_sample_index", fail)
    again = GPTDataset(prefix, 10, 4, seed=3)
    np.testing.assert_array_equal(first.shuffle_idx, again.shuffle_idx)
    np.testing.assert_array_equal(first[3]["tokens"], again[3]["tokens"])


def test_cache_from_other_data_is_rebuilt(tmp_path):
    prefix, _ = make_dataset(tmp_path, [9, 14, 6, 20])
    GPTDataset(prefix, 10, 4, seed=3)
    prefix, docs = make_dataset(tmp_path, [30, 1, 2])  # same prefix, new data
    ds = GPTDataset(prefix, 10, 4, seed=3)
    stream = stream_from(ds.doc_idx, docs)
    k = int(ds.shuffle_idx[0])
    np.testing.assert_array_equal(ds[0]["tokens"].numpy(), stream[4 * k : 4 * k + 5])


def test_no_tokens_is_an_error(tmp_path):
    prefix, _ = make_dataset(tmp_path, [0, 0])
    with pytest.raises(ValueError, match="no tokens"):
        GPTDataset(prefix, 3, 4, seed=0)
