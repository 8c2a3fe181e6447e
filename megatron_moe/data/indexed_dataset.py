"""Megatron's memory-mapped indexed dataset: a `.bin` of raw tokens and an `.idx` that indexes it.

Layout of `PREFIX.idx` (all little-endian), as written by Megatron-LM's `MMapIndexedDataset`:

    offset  size          field
    0       9             magic b"MMIDIDX\\x00\\x00"
    9       8   uint64    version, 1
    17      1   uint8     dtype code of the tokens (see DTYPE_CODES)
    18      8   uint64    N, number of sequences
    26      8   uint64    D, number of document boundaries (documents + 1)
    34      4*N int32     sizes: tokens in each sequence
    ..      8*N int64     pointers: byte offset of each sequence in the .bin
    ..      8*D int64     document index: sequence index where each document starts, then N

`PREFIX.bin` holds the sequences back to back in that dtype, with no header; one sequence per
document, so the document index is 0, 1, ..., N. Opening a dataset validates the index and the
token ids once; the result (with the largest token id, for `check_vocab`) is cached in
`PREFIX.idx.valid`, keyed by the files' sizes, mtimes and the `.idx`'s SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's codes for the token dtype (megatron/core/datasets/indexed_dataset.py, DType enum).
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D: 34 bytes


def dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's code for a numpy dtype; ValueError if the format has none."""
    for code, t in DTYPE_CODES.items():
        if np.dtype(t) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {np.dtype(dtype)} has no code in the indexed dataset format")


def best_dtype(vocab_size: int) -> type:
    """Smallest token dtype that holds ids < vocab_size: uint16 below 65500, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def data_file_path(prefix: str | os.PathLike) -> str:
    """`PREFIX.bin`."""
    return f"{prefix}.bin"


def index_file_path(prefix: str | os.PathLike) -> str:
    """`PREFIX.idx`."""
    return f"{prefix}.idx"


class IndexedDatasetBuilder:
    """Stream sequences into `PREFIX.bin` / `PREFIX.idx`.

    Both files are written under temporary names (`PREFIX.bin.tmp`, `PREFIX.idx.tmp`) and only
    renamed by `finalize()`, so a reader never sees a half-written dataset; `abort()` (or leaving
    a `with` block by an exception) deletes the temporary files.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: type = np.uint16) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._bin_tmp = data_file_path(self.prefix) + ".tmp"
        self._idx_tmp = index_file_path(self.prefix) + ".tmp"
        Path(self._bin_tmp).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self.sizes: list[int] = []
        self.doc_idx: list[int] = [0]
        self._finished = False

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence (1-D token ids); ValueError if an id does not fit the dtype."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {arr.shape}")
        if arr.size and arr.dtype != self.dtype and np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)  # type: ignore[type-var]  # an integer dtype (checked above)
            if arr.min() < info.min or arr.max() > info.max:
                raise ValueError(
                    f"token ids in [{arr.min()}, {arr.max()}] do not fit "
                    f"{self.dtype}; choose a wider dtype (see best_dtype)"
                )
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sizes.append(int(arr.size))

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self.doc_idx.append(len(self.sizes))

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one document made of a single sequence."""
        self.add_item(tokens)
        self.end_document()

    def finalize(self) -> tuple[str, str]:
        """Write the index, rename both files into place; return (bin path, idx path)."""
        if self.doc_idx[-1] != len(self.sizes):  # trailing sequences form the last document
            self.end_document()
        self._bin.close()
        sizes = np.asarray(self.sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self.doc_idx, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(sizes), len(doc_idx)))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
        bin_path, idx_path = data_file_path(self.prefix), index_file_path(self.prefix)
        os.replace(self._bin_tmp, bin_path)
        os.replace(self._idx_tmp, idx_path)
        self._finished = True
        return bin_path, idx_path

    def abort(self) -> None:
        """Close and delete the temporary files; nothing is left behind."""
        self._bin.close()
        self._finished = True
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """An exception aborts; a clean exit finalizes unless done already."""
        if exc_type is not None:
            self.abort()
        elif not self._finished:
            self.finalize()


class MMapIndexedDataset:
    """Read `PREFIX.bin` / `PREFIX.idx` through numpy memory maps (nothing is loaded eagerly).

    `ds[i]` is sequence i as a 1-D array of `ds.dtype`; `ds.get(i, offset, length)` reads a slice
    of it without touching the rest. `sizes` [N] int32, `pointers` [N] int64 and `doc_idx` [D]
    int64 are views of the index file.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self._open(prefix)

    def _open(self, prefix: str | os.PathLike) -> None:
        """Check and memory-map the index and data files of `prefix`."""
        self.prefix = str(prefix)
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"indexed dataset file not found: {p}")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:9] != MAGIC:
            raise ValueError(
                f"{idx_path} is not a Megatron indexed dataset index (magic {head[:9]!r}, expected {MAGIC!r})"
            )
        _, version, code, n, d = _HEADER.unpack(head)
        if version != VERSION:
            raise ValueError(f"{idx_path}: unsupported index version {version}")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 4 * n + 8 * n + 8 * d
        if idx_size != expected:
            raise ValueError(
                f"{idx_path}: {idx_size} bytes, expected {expected} for "
                f"{n} sequences and {d} document boundaries (truncated?)"
            )
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = _HEADER.size
        self.sizes = np.frombuffer(self._idx, dtype="<i4", count=n, offset=off)
        self.pointers = np.frombuffer(self._idx, dtype="<i8", count=n, offset=off + 4 * n)
        self.doc_idx = np.frombuffer(self._idx, dtype="<i8", count=d, offset=off + 12 * n)
        total = int(self.sizes.sum(dtype=np.int64)) * self.dtype.itemsize
        if os.path.getsize(bin_path) != total:
            raise ValueError(f"{bin_path}: {os.path.getsize(bin_path)} bytes, but {idx_path} indexes {total}")
        # np.memmap refuses empty files; an empty dataset gets an empty array instead.
        self._bin = np.memmap(bin_path, mode="r", dtype=self.dtype) if total else np.zeros(0, dtype=self.dtype)
        self.max_token_id = self._validated()

    # ------------------------------------------------------------------ validation
    def _cache_key(self) -> dict:
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        h = hashlib.sha256()
        with open(idx_path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        si, sb = os.stat(idx_path), os.stat(bin_path)
        return {
            "idx_size": si.st_size,
            "idx_mtime_ns": si.st_mtime_ns,
            "idx_sha256": h.hexdigest(),
            "bin_size": sb.st_size,
            "bin_mtime_ns": sb.st_mtime_ns,
        }

    def _validated(self) -> int:
        """Validate the index and the tokens (or trust the cache); returns the largest token id (-1: none)."""
        cache = index_file_path(self.prefix) + ".valid"
        key = self._cache_key()
        try:
            with open(cache) as f:
                saved = json.load(f)
            if saved.get("key") == key:
                return int(saved["max_token_id"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        max_id = self.validate()
        tmp = f"{cache}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump({"key": key, "max_token_id": max_id}, f)
            os.replace(tmp, cache)
        except OSError:  # a read-only dataset directory: check again next time
            if os.path.exists(tmp):
                os.remove(tmp)
        return max_id

    def validate(self) -> int:
        """Check sizes, pointers, document index and token ids; ValueError naming the file.
        Returns the largest token id (-1 for an empty dataset)."""
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        n = len(self.sizes)
        if n and int(self.sizes.min()) < 0:
            i = int(np.argmin(self.sizes))
            raise ValueError(f"{idx_path}: sequence {i} has negative size {int(self.sizes[i])}")
        expect = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(self.sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=expect[1:])
        if not np.array_equal(self.pointers, expect):
            i = int(np.argmax(self.pointers != expect))
            raise ValueError(
                f"{idx_path}: pointer of sequence {i} is {int(self.pointers[i])}, but the sizes "
                f"before it and the token dtype {self.dtype} put it at {int(expect[i])}"
            )
        d = self.doc_idx
        if len(d) == 0 or int(d[0]) != 0 or int(d[-1]) != n or (len(d) > 1 and bool((np.diff(d) < 0).any())):
            raise ValueError(
                f"{idx_path}: the document index must start at 0, never decrease and end at the number of sequences {n}"
            )
        if not self._bin.size:
            return -1
        if not np.issubdtype(self.dtype, np.integer):
            raise ValueError(f"{bin_path}: token dtype {self.dtype} is not an integer type")
        lo, hi = int(self._bin.min()), int(self._bin.max())
        if lo < 0:
            raise ValueError(f"{bin_path}: negative token id {lo}")
        return hi

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the .bin when a token id is >= `vocab_size`."""
        if self.max_token_id >= vocab_size:
            raise ValueError(
                f"{data_file_path(self.prefix)}: token id {self.max_token_id} is outside the "
                f"vocabulary of {vocab_size} (--vocab-size / the tokenizer); was it tokenized "
                f"with another tokenizer?"
            )

    def __getstate__(self) -> str:
        # DataLoader workers started by spawn get the prefix and map the files again,
        # instead of a pickled copy of the whole memory map.
        return self.prefix

    def __setstate__(self, prefix: str) -> None:
        self._open(prefix)

    def __len__(self) -> int:
        """Number of sequences N."""
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return int(self.sizes.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end if length is None)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        size = int(self.sizes[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) out of range for sequence {i} of {size} tokens")
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start : start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence i, 1-D array of `dtype`."""
        return self.get(i)
