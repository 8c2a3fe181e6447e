"""Megatron indexed dataset: round trip, byte layout checked by an independent reader, errors."""

import os
import struct

import numpy as np
import pytest

from megatron_moe.data.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset, best_dtype


def _docs(seed: int, vocab: int, n: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, size=int(rng.integers(1, 40))) for _ in range(n)]
    docs[3] = np.zeros(0, dtype=np.int64)  # an empty document must survive too
    return docs


def _write(prefix, docs, dtype) -> None:
    with IndexedDatasetBuilder(prefix, dtype) as b:
        for d in docs:
            b.add_document(d)


def read_idx_independently(path: str) -> dict:
    """Parse an .idx from the documented layout only (struct + numpy), no project code."""
    with open(path, "rb") as f:
        raw = f.read()
    magic, version, code, n, d = struct.unpack_from("<9sQBQQ", raw, 0)
    off = 9 + 8 + 1 + 8 + 8
    sizes = np.frombuffer(raw, "<i4", n, off)
    pointers = np.frombuffer(raw, "<i8", n, off + 4 * n)
    doc_idx = np.frombuffer(raw, "<i8", d, off + 12 * n)
    return dict(
        magic=magic,
        version=version,
        code=code,
        n=n,
        d=d,
        sizes=sizes,
        pointers=pointers,
        doc_idx=doc_idx,
        total_bytes=len(raw),
    )


@pytest.mark.parametrize("vocab,dtype,code", [(50257, np.uint16, 8), (100000, np.int32, 4)])
def test_round_trip_returns_the_documents(tmp_path, vocab, dtype, code):
    docs = _docs(0, vocab)
    prefix = str(tmp_path / "ds")
    _write(prefix, docs, best_dtype(vocab))
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds.sizes, [len(d) for d in docs])
    np.testing.assert_array_equal(ds.doc_idx, np.arange(len(docs) + 1))
    np.testing.assert_array_equal(ds.get(0, 2, 3), docs[0][2:5])
    assert ds.num_tokens == sum(len(d) for d in docs)


def test_layout_matches_independent_reader(tmp_path):
    docs = _docs(1, 50257)
    prefix = str(tmp_path / "ds")
    _write(prefix, docs, np.uint16)
    idx = read_idx_independently(prefix + ".idx")
    n = len(docs)
    assert idx["magic"] == b"MMIDIDX\x00\x00"
    assert (idx["version"], idx["code"], idx["n"], idx["d"]) == (1, 8, n, n + 1)
    assert idx["total_bytes"] == 34 + 4 * n + 8 * n + 8 * (n + 1)
    lengths = np.array([len(d) for d in docs])
    np.testing.assert_array_equal(idx["sizes"], lengths)
    byte_starts = np.concatenate([[0], np.cumsum(2 * lengths)[:-1]])  # 2 bytes per uint16
    np.testing.assert_array_equal(idx["pointers"], byte_starts)
    np.testing.assert_array_equal(idx["doc_idx"], np.arange(n + 1))
    raw = np.fromfile(prefix + ".bin", dtype="<u2")
    assert raw.nbytes == 2 * lengths.sum()
    np.testing.assert_array_equal(raw, np.concatenate(docs))


def test_multi_sequence_documents_keep_their_boundaries(tmp_path):
    prefix = str(tmp_path / "ds")
    b = IndexedDatasetBuilder(prefix, np.int64)
    b.add_item([1, 2])
    b.add_item([3])
    b.end_document()
    b.add_item([4, 5, 6])
    b.finalize()  # the trailing sequence becomes the last document
    idx = read_idx_independently(prefix + ".idx")
    assert idx["code"] == 5
    np.testing.assert_array_equal(idx["doc_idx"], [0, 2, 3])
    np.testing.assert_array_equal(MMapIndexedDataset(prefix)[2], [4, 5, 6])


def test_best_dtype_boundary():
    assert best_dtype(65499) is np.uint16
    assert best_dtype(65500) is np.int32


def test_failed_write_leaves_no_files(tmp_path):
    prefix = tmp_path / "ds"
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix, np.uint16) as b:
            b.add_document([1, 2, 3])
            raise RuntimeError("tokenizer crashed")
    assert os.listdir(tmp_path) == []


def test_nothing_visible_before_finalize(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "ds", np.uint16)
    b.add_document([1, 2, 3])
    assert sorted(os.listdir(tmp_path)) == ["ds.bin.tmp"]
    b.finalize()
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]


def test_out_of_range_token_is_rejected(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "ds", np.uint16) as b:
        with pytest.raises(ValueError, match="do not fit uint16"):
            b.add_document(np.array([1, 70000]))


def test_reader_names_the_bad_file(tmp_path):
    prefix = str(tmp_path / "ds")
    _write(prefix, _docs(2, 1000), np.uint16)
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"NOTMAGIC!")
    with pytest.raises(ValueError, match="ds.idx is not a Megatron indexed dataset"):
        MMapIndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match="missing.idx"):
        MMapIndexedDataset(str(tmp_path / "missing"))


def test_reader_detects_truncated_bin(tmp_path):
    prefix = str(tmp_path / "ds")
    _write(prefix, _docs(3, 1000), np.uint16)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 2)
    with pytest.raises(ValueError, match="ds.bin"):
        MMapIndexedDataset(prefix)


def test_pickles_as_its_prefix_not_its_data(tmp_path):
    import pickle

    prefix = str(tmp_path / "ds")
    docs = [np.arange(5000) % 300 for _ in range(20)]  # 200 kB of tokens
    _write(prefix, docs, np.uint16)
    blob = pickle.dumps(MMapIndexedDataset(prefix))
    assert len(blob) < 1000
    np.testing.assert_array_equal(pickle.loads(blob)[7], docs[7])
