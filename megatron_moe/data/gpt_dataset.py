"""GPT pretraining samples: fixed windows over the concatenated documents, shuffled per epoch.

The split is one token stream of each epoch's documents in a shuffled order. Sample k is
`stream[k*L : k*L + L + 1]` (L = seq_length) and belongs to the epoch its first token falls in;
each epoch's samples are visited in a shuffled order. Orders are seeded with (seed, epoch), so the
index for N samples is a prefix of the index for any larger N. The index is cached beside the data
as `PREFIX_{N}ns_{L}sl_{seed}s_sample_index.npz` (written to a temporary name, then renamed).
"""

from __future__ import annotations

import os
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

from .indexed_dataset import MMapIndexedDataset


def _epoch_rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """Independent generator per (seed, epoch, purpose): 0 documents, 1 samples."""
    return np.random.default_rng([seed, epoch, stream])


def build_sample_index(
    sizes: np.ndarray, seq_length: int, num_samples: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Build the sample index for documents of the given sizes.

    Args: sizes [D] tokens per document; seq_length L; num_samples N; seed >= 0.
    Returns:
      doc_idx [D * epochs] int64: document order of the stream, epochs concatenated.
      sample_idx [S, 2] int64: (position in doc_idx, token offset in that document) where stream
        sample k starts, for every sample whose first token lies in the epochs used (S >= N).
      shuffle_idx [N] int64: stream sample id of dataset item i.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        raise ValueError("cannot build GPT samples from a dataset with no tokens")
    if seq_length < 1 or num_samples < 0 or seed < 0:
        raise ValueError(f"need seq_length >= 1, num_samples >= 0, seed >= 0; got {seq_length}, {num_samples}, {seed}")
    L, n_docs = seq_length, len(sizes)
    # Epochs of samples: the smallest E with ceil(E*T/L) >= N, i.e. E*T > (N-1)*L.
    epochs = (num_samples - 1) * L // total + 1 if num_samples else 0
    first = [-(-e * total // L) for e in range(epochs + 1)]  # first sample id of each epoch
    n_stream = first[-1]
    # Documents must cover the last sample's final token at position n_stream*L.
    doc_epochs = -(-(n_stream * L + 1) // total) if n_stream else 0
    doc_idx = np.concatenate(
        [_epoch_rng(seed, e, 0).permutation(n_docs) for e in range(doc_epochs)] or [np.zeros(0, np.int64)]
    )
    doc_idx = doc_idx.astype(np.int64)
    ends = np.cumsum(sizes[doc_idx])
    starts = np.arange(n_stream, dtype=np.int64) * L
    # side="right" skips empty documents: the first document whose end is past the start.
    pos = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[pos] - sizes[doc_idx[pos]])
    sample_idx = np.stack([pos, offset], axis=1).astype(np.int64)
    shuffle_idx = np.concatenate(
        [_epoch_rng(seed, e, 1).permutation(first[e + 1] - first[e]) + first[e] for e in range(epochs)]
        or [np.zeros(0, np.int64)]
    )[:num_samples].astype(np.int64)
    return doc_idx, sample_idx, shuffle_idx


def sample_index_path(prefix: str, num_samples: int, seq_length: int, seed: int, cache_dir: str | None = None) -> str:
    """Where the cached index of (prefix, N, L, seed) lives: next to the data or in cache_dir."""
    name = f"{Path(prefix).name}_{num_samples}ns_{seq_length}sl_{seed}s_sample_index.npz"
    return str(Path(cache_dir) / name if cache_dir else Path(prefix).parent / name)


def _fingerprint(sizes: np.ndarray) -> np.ndarray:
    """[3] int64 that changes when the data changes: documents, tokens, crc32 of the sizes."""
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    return np.array([len(sizes), int(sizes.sum(dtype=np.int64)), zlib.crc32(sizes.tobytes())], dtype=np.int64)


def load_or_build_sample_index(
    dataset: MMapIndexedDataset,
    num_samples: int,
    seq_length: int,
    seed: int,
    cache_dir: str | None = None,
    use_cache: bool = True,
) -> tuple[np.ndarray, ...]:
    """`build_sample_index` for a dataset, read from / written to the on-disk cache.

    A cache file built from different data (other sizes) is ignored and rebuilt; a directory
    that cannot be written only costs a warning.
    """
    fp = _fingerprint(dataset.sizes)
    path = sample_index_path(dataset.prefix, num_samples, seq_length, seed, cache_dir)
    if use_cache and os.path.isfile(path):
        try:
            with np.load(path) as z:
                if np.array_equal(z["fingerprint"], fp):
                    return z["doc_idx"], z["sample_idx"], z["shuffle_idx"]
        except (OSError, ValueError, KeyError):
            pass  # unreadable or old cache: rebuild below
    arrays = build_sample_index(dataset.sizes, seq_length, num_samples, seed)
    if use_cache:
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                np.savez(f, doc_idx=arrays[0], sample_idx=arrays[1], shuffle_idx=arrays[2], fingerprint=fp)
            os.replace(tmp, path)
        except OSError as e:
            warnings.warn(f"could not cache the sample index at {path}: {e}")
            if os.path.exists(tmp):
                os.remove(tmp)
    return arrays


class GPTDataset(torch.utils.data.Dataset):
    """`num_samples` GPT samples of `seq_length + 1` tokens from one indexed dataset.

    `ds[i]` is `{"tokens": LongTensor [seq_length + 1]}`; the trainer takes
    `tokens[:-1]` as the input and `tokens[1:]` as the labels. A default-collated micro-batch
    is `{"tokens": LongTensor [micro_batch_size, seq_length + 1]}`.
    """

    def __init__(
        self, data, num_samples: int, seq_length: int, seed: int, cache_dir: str | None = None, use_cache: bool = True
    ) -> None:
        # a prefix, an open dataset, or anything read like one (blended.DocumentRange)
        self.indexed = MMapIndexedDataset(data) if isinstance(data, (str, os.PathLike)) else data
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.doc_idx, self.sample_idx, self.shuffle_idx = load_or_build_sample_index(
            self.indexed, num_samples, seq_length, seed, cache_dir, use_cache
        )

    def __len__(self) -> int:
        """Number of samples N."""
        return self.num_samples

    def stream_sample(self, k: int) -> np.ndarray:
        """Stream sample k (before shuffling): int64 [seq_length + 1]."""
        pos, offset = (int(v) for v in self.sample_idx[k])
        need = self.seq_length + 1
        out = np.empty(need, dtype=np.int64)
        filled = 0
        while filled < need:  # walk documents until the window is full
            doc = int(self.doc_idx[pos])
            take = min(int(self.indexed.sizes[doc]) - offset, need - filled)
            out[filled : filled + take] = self.indexed.get(doc, offset, take)
            filled, pos, offset = filled + take, pos + 1, 0
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i: {"tokens": int64 [seq_length + 1]}."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        return {"tokens": torch.from_numpy(self.stream_sample(int(self.shuffle_idx[i])))}
