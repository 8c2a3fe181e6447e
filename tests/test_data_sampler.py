"""Pretraining sampler: disjoint DP shards covering each global batch, identical data on the MP
ranks of one DP group, exact resume from consumed_samples, and the split loaders."""

import numpy as np
import pytest
import torch

from megatron_moe.data.gpt_dataset import GPTDataset
from megatron_moe.data.indexed_dataset import IndexedDatasetBuilder
from megatron_moe.data.sampler import (
    PretrainingSampler,
    build_pretraining_data_loader,
    build_train_valid_test_data_loaders,
    global_batch_indices,
    split_prefix,
)
from megatron_moe.testing import spawn


def rank_batches(total, consumed, mbs, gbs, dp_size):
    """Every DP rank's micro-batches, as lists."""
    return [list(PretrainingSampler(total, consumed, mbs, gbs, r, dp_size)) for r in range(dp_size)]


def test_global_batch_layout_is_megatron_order():
    ids = global_batch_indices(100, 12, 2, 3)
    assert ids.shape == (2, 3, 2)
    assert ids[0].tolist() == [[100, 101], [102, 103], [104, 105]]
    assert ids[1].tolist() == [[106, 107], [108, 109], [110, 111]]


@pytest.mark.parametrize("mbs,gbs,dp", [(2, 16, 4), (1, 6, 3), (3, 3, 1)])
def test_dp_shards_are_disjoint_and_cover_each_global_batch(mbs, gbs, dp):
    total = 5 * gbs + gbs - 1  # a trailing partial global batch is dropped
    per_rank = rank_batches(total, 0, mbs, gbs, dp)
    steps = gbs // (mbs * dp)
    assert all(len(b) == 5 * steps for b in per_rank)
    for it in range(5):
        got = [i for r in range(dp) for mb in per_rank[r][it * steps : (it + 1) * steps] for i in mb]
        assert sorted(got) == list(range(it * gbs, (it + 1) * gbs))  # disjoint and complete
    assert len(PretrainingSampler(total, 0, mbs, gbs, 0, dp)) == 5 * steps


def test_resume_continues_the_exact_sequence():
    mbs, gbs, dp = 2, 8, 2
    full = rank_batches(100, 0, mbs, gbs, dp)
    for done in (1, 4, 7):
        resumed = rank_batches(100, done * gbs, mbs, gbs, dp)
        steps = gbs // (mbs * dp)
        for r in range(dp):
            assert resumed[r] == full[r][done * steps :]


def test_bad_batch_sizes_name_the_flags():
    with pytest.raises(
        ValueError,
        match="--global-batch-size .10. must be a multiple of --micro-batch-size .2. x data-parallel size .4.",
    ):
        PretrainingSampler(100, 0, 2, 10, 0, 4)
    with pytest.raises(ValueError, match="dp_rank 4 out of range"):
        PretrainingSampler(100, 0, 2, 16, 4, 4)


def _write_split(prefix, seed, n_docs=12):
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for _ in range(n_docs):
            b.add_document(rng.integers(0, 500, size=int(rng.integers(5, 60))))


def make_data_path(tmp_path) -> str:
    data_path = str(tmp_path / "corpus")
    for i, split in enumerate(("train", "valid", "test")):
        _write_split(split_prefix(data_path, split), seed=i)
    return data_path


def test_split_loaders_shapes_resume_and_fixed_eval(tmp_path):
    data_path = make_data_path(tmp_path)
    common = dict(seq_length=16, seed=1234, micro_batch_size=2, global_batch_size=8, dp_rank=1, dp_size=2)
    train, valid, test = build_train_valid_test_data_loaders(data_path, train_samples=40, valid_samples=16, **common)
    assert test is None
    batches = [b["tokens"] for b in train]
    assert len(batches) == 40 // 8 * 2 and batches[0].shape == (2, 17)
    assert batches[0].dtype == torch.int64
    first = [b["tokens"] for b in valid]
    assert len(first) == 4
    assert all(torch.equal(a, b["tokens"]) for a, b in zip(first, valid))  # same every eval
    resumed, _, _ = build_train_valid_test_data_loaders(
        data_path, train_samples=40, consumed_train_samples=16, **common
    )
    assert all(torch.equal(a, b["tokens"]) for a, b in zip(batches[4:], resumed, strict=True))


def test_missing_split_names_data_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data-path .*nothing_train_text_document.idx"):
        build_train_valid_test_data_loaders(str(tmp_path / "nothing"), 16, 1, 2, 8, 0, 1, 40)


def _loader_on_rank(rank, world_size, data_path, mp_size):
    """Layout r = mp + N_MP * dp: each rank builds its own loader (racing on the index cache)."""
    dp_rank, dp_size = rank // mp_size, world_size // mp_size
    train, _, _ = build_train_valid_test_data_loaders(
        data_path, 8, 99, micro_batch_size=2, global_batch_size=8, dp_rank=dp_rank, dp_size=dp_size, train_samples=24
    )
    return torch.stack([b["tokens"] for b in train])


def test_mp_ranks_of_a_dp_group_get_identical_samples(tmp_path):
    data_path = make_data_path(tmp_path)
    out = spawn(_loader_on_rank, 4, data_path, 2, timeout=120)  # MP 2 x DP 2
    assert out[0].shape == (6, 2, 9)
    assert torch.equal(out[0], out[1]) and torch.equal(out[2], out[3])
    # the two DP groups hold different samples, and together the whole stream in order
    one_rank = GPTDataset(split_prefix(data_path, "train"), 24, 8, 99)
    whole = torch.cat(
        [
            b["tokens"]
            for b in build_pretraining_data_loader(
                one_rank, 0, micro_batch_size=8, global_batch_size=8, dp_rank=0, dp_size=1
            )
        ]
    )
    merged = torch.stack([out[0], out[2]], dim=1)  # [micro-step, dp, b, 9]: Megatron's order
    assert torch.equal(merged.reshape(24, 9), whole)


def test_the_sample_order_inside_an_epoch_differs_between_epochs():
    """Each epoch shuffles its own samples (not only its documents): the order in which an epoch's
    samples are visited, relative to the epoch's first sample, differs from every other epoch's."""
    from megatron_moe.data.gpt_dataset import build_sample_index

    sizes = np.full(16, 10)  # 160 tokens, seq_length 8: 20 samples start in each epoch
    _, _, shuffle_idx = build_sample_index(sizes, 8, 80, seed=5)
    orders = [tuple(shuffle_idx[20 * e : 20 * e + 20] - 20 * e) for e in range(4)]
    assert all(sorted(o) == list(range(20)) for o in orders)  # each epoch visits its own samples once
    assert len(set(orders)) == 4, "two epochs visit their samples in the same order"
