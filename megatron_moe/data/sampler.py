"""Megatron-style pretraining batch sampler and the train/valid/test data loaders.

Dataset items are consumed in order, one global batch of G = --global-batch-size samples per
iteration. A global batch is cut into M = G / (B * P) micro-steps (B = --micro-batch-size,
P = data-parallel size); micro-step j gives data-parallel rank r the B samples

    start + j*B*P + r*B + [0, B)        (start = first sample of the global batch)

so the ranks' shards are disjoint and cover the global batch; model-parallel peers get the same
samples. Starting at `consumed_samples` resumes exactly; a trailing partial global batch is dropped.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .blended import build_split_dataset
from .paths import SPLITS, DataPath, split_prefix  # noqa: F401  (split_prefix: re-exported)


def check_batch_sizes(micro_batch_size: int, global_batch_size: int, dp_size: int) -> int:
    """Validate the batch sizes; return micro-steps per global batch, G / (B * P)."""
    if micro_batch_size < 1 or global_batch_size < 1 or dp_size < 1:
        raise ValueError(
            f"--micro-batch-size ({micro_batch_size}), --global-batch-size "
            f"({global_batch_size}) and the data-parallel size ({dp_size}) must "
            f"be positive"
        )
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"--global-batch-size ({global_batch_size}) must be a multiple of "
            f"--micro-batch-size ({micro_batch_size}) x data-parallel size "
            f"({dp_size})"
        )
    return global_batch_size // (micro_batch_size * dp_size)


def global_batch_indices(start: int, global_batch_size: int, micro_batch_size: int, dp_size: int) -> np.ndarray:
    """Sample ids of the global batch starting at `start`, int64 [M, P, B]:
    [j, r] is what data-parallel rank r gets at micro-step j."""
    m = check_batch_sizes(micro_batch_size, global_batch_size, dp_size)
    return start + np.arange(global_batch_size, dtype=np.int64).reshape(m, dp_size, micro_batch_size)


class PretrainingSampler(torch.utils.data.Sampler):
    """Yields this data-parallel rank's micro-batches (lists of B dataset indices), in order."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        self.micro_steps = check_batch_sizes(micro_batch_size, global_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for data-parallel size {dp_size}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed samples ({consumed_samples}) must be in [0, {total_samples}], the dataset size")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def num_global_batches(self) -> int:
        """Complete global batches left after `consumed_samples`."""
        return (self.total_samples - self.consumed_samples) // self.global_batch_size

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        return self.num_global_batches() * self.micro_steps

    def __iter__(self) -> Iterator[list[int]]:
        """Each call starts again from `consumed_samples`."""
        for t in range(self.num_global_batches()):
            start = self.consumed_samples + t * self.global_batch_size
            ids = global_batch_indices(start, self.global_batch_size, self.micro_batch_size, self.dp_size)
            for j in range(self.micro_steps):
                yield ids[j, self.dp_rank].tolist()


class HostDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose batches are built on the host (the trainer moves them to its device):
    the iterator's own bookkeeping tensors (its base seed) are CPU tensors whatever the default
    device is."""

    def __iter__(self):
        with torch.device("cpu"):
            return super().__iter__()


def build_pretraining_data_loader(
    dataset: torch.utils.data.Dataset,
    consumed_samples: int,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
) -> HostDataLoader:
    """A DataLoader over `dataset` driven by `PretrainingSampler`; each batch is the default
    collation of B items, e.g. {"tokens": int64 [B, seq_length + 1]} for a GPTDataset."""
    num_samples = len(dataset)  # type: ignore[arg-type]  # a map-style dataset: sized
    sampler = PretrainingSampler(num_samples, consumed_samples, micro_batch_size, global_batch_size, dp_rank, dp_size)
    return HostDataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, persistent_workers=num_workers > 0)


def build_train_valid_test_data_loaders(
    data_path: DataPath,
    seq_length: int,
    seed: int,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    train_samples: int,
    valid_samples: int = 0,
    test_samples: int = 0,
    consumed_train_samples: int = 0,
    num_workers: int = 0,
    cache_dir: str | None = None,
    split: str = "969,30,1",
) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader | None, torch.utils.data.DataLoader | None]:
    """Loaders for `--data-path` (a per-split PREFIX, a Megatron PREFIX cut by `split`, or a
    weighted blend of those; `megatron_moe.data.paths`).

    The train loader holds `train_samples` (normally --train-iters x G) samples and starts at
    `consumed_train_samples`. The valid/test loaders hold `valid_samples` / `test_samples`
    (normally --eval-iters x G) and start at 0 each time they are iterated, so every evaluation
    sees the same batches; a split asked for 0 samples gets None. Seeds differ per split so the
    splits' shuffles are unrelated.
    """
    check_batch_sizes(micro_batch_size, global_batch_size, dp_size)
    wanted = {"train": train_samples, "valid": valid_samples, "test": test_samples}
    loaders: list[torch.utils.data.DataLoader | None] = []
    for i, name in enumerate(SPLITS):
        if wanted[name] <= 0:
            if name == "train":
                raise ValueError(f"train_samples must be positive, got {train_samples}")
            loaders.append(None)
            continue
        if wanted[name] < global_batch_size:
            raise ValueError(
                f"{name} samples ({wanted[name]}) are fewer than one global batch "
                f"(--global-batch-size {global_batch_size})"
            )
        ds = build_split_dataset(data_path, name, wanted[name], seq_length, seed + i, split, cache_dir)
        consumed = consumed_train_samples if name == "train" else 0
        loaders.append(
            build_pretraining_data_loader(
                ds, consumed, micro_batch_size, global_batch_size, dp_rank, dp_size, num_workers
            )
        )
    train = loaders[0]
    assert train is not None  # train_samples > 0 was checked above
    return train, loaders[1], loaders[2]
