"""Document ranges of one corpus (--split) and weighted blends of several (--data-path W A W B).

Blending is deterministic and sample-exact: item i of a blend of datasets with
weights w_k is taken from the dataset whose realized count falls furthest
below its target, argmax_k (w_k * (i + 1) - n_k(i)) where n_k(i) is how many of
the items 0..i-1 came from dataset k (ties go to the lower k). After any prefix
of n items every n_k is within 1 of w_k * n, and the first N items of a blend
of size N' > N are the blend of size N (the index does not depend on the size
asked for beyond its prefix), so resuming at `consumed_samples` is exact.
Dataset k supplies its own samples 0, 1, 2, ... in the order the blend visits it.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .gpt_dataset import GPTDataset
from .indexed_dataset import MMapIndexedDataset, index_file_path
from .paths import DataPath, SPLITS, parse_data_path, prefix_kind, split_prefix, split_ranges


class DocumentRange:
    """Documents [start, stop) of an indexed dataset, read like a whole one (sizes, get, prefix)."""

    def __init__(self, indexed: MMapIndexedDataset, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= len(indexed):
            raise ValueError(f"document range [{start}, {stop}) outside {indexed.prefix} ({len(indexed)} documents)")
        self.indexed, self.start, self.stop = indexed, start, stop
        self.sizes = indexed.sizes[start:stop]
        # the sample-index cache is keyed by this name, so each range gets its own file
        self.prefix = f"{indexed.prefix}_docs{start}-{stop}"

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of document i of the range (document start + i of the file)."""
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range for {len(self)} documents")
        return self.indexed.get(self.start + i, offset, length)


def blend_index(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index [size] int64, sample_index [size] int64): item i is sample
    sample_index[i] of dataset dataset_index[i] (greedy largest-deficit rule of the module doc)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {weights}")
    wl = (w / w.sum()).tolist()
    counts = [0] * len(wl)
    ks = range(len(wl))
    ds_index, sample_index = [0] * size, [0] * size
    for i in range(size):  # plain Python: about 1-2 s per million items for a few datasets
        k, best = 0, wl[0] * (i + 1) - counts[0]
        for j in ks:
            d = wl[j] * (i + 1) - counts[j]
            if d > best:  # strictly greater: ties go to the lower index
                k, best = j, d
        ds_index[i], sample_index[i] = k, counts[k]
        counts[k] += 1
    return np.asarray(ds_index, dtype=np.int64), np.asarray(sample_index, dtype=np.int64)


class BlendedDataset(torch.utils.data.Dataset):
    """`size` items drawn from `datasets` in the proportions `weights` (see `blend_index`)."""

    def __init__(self, datasets: list, weights: list[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = datasets
        self.dataset_index, self.sample_index = blend_index(weights, size)
        for k, ds in enumerate(datasets):
            need = int((self.dataset_index == k).sum())
            if len(ds) < need:
                raise ValueError(f"blend dataset {k} has {len(ds)} samples, the blend needs {need}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]


def split_source(prefix: str, split: str, split_weights: str):
    """What one prefix contributes to `split`: a per-split file prefix, or a document range of
    a single Megatron corpus; None when --split leaves that split no documents."""
    if prefix_kind(prefix) == "splits":
        path = split_prefix(prefix, split)
        if not os.path.isfile(index_file_path(path)):
            raise FileNotFoundError(
                f"--data-path {prefix}: {index_file_path(path)} not found (run "
                f"tools/preprocess_data.py --output-prefix {prefix} first)"
            )
        return path
    indexed = MMapIndexedDataset(prefix)
    start, stop = split_ranges(len(indexed), split_weights)[split]
    return DocumentRange(indexed, start, stop) if stop > start else None


def build_split_dataset(
    data_path: DataPath,
    split: str,
    num_samples: int,
    seq_length: int,
    seed: int,
    split_weights: str = "969,30,1",
    cache_dir: str | None = None,
):
    """The `num_samples`-sample dataset of `split` ("train", "valid" or "test") for --data-path.

    One prefix: a GPTDataset over its split. A blend: a BlendedDataset whose part k is a
    GPTDataset of exactly the samples the blend takes from prefix k.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}")
    blend = parse_data_path(data_path)
    sources = [split_source(p, split, split_weights) for _, p in blend]
    for (_, p), src in zip(blend, sources):
        if src is None:
            raise ValueError(
                f"--split {split_weights} leaves the {split} split of --data-path {p} "
                f"no documents, but {num_samples} {split} samples are needed"
            )
    if len(blend) == 1:
        return GPTDataset(sources[0], num_samples, seq_length, seed, cache_dir=cache_dir)
    weights = [w for w, _ in blend]
    ds_index, _ = blend_index(weights, num_samples)
    parts = []
    for k, src in enumerate(sources):
        n_k = int((ds_index == k).sum())
        # a dataset asked for 0 samples still needs a (valid) index: give it one sample
        parts.append(GPTDataset(src, max(n_k, 1), seq_length, seed + 1000 * k, cache_dir=cache_dir))
    return BlendedDataset(parts, weights, num_samples)
