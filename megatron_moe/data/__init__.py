"""Data pipeline: WikiText preprocessing, tokenizers, Megatron .bin/.idx datasets, GPT samples.

preprocess.py      WikiText/jsonl -> PREFIX_{train,valid,test}_text_document.{bin,idx}
tokenizer.py       GPT-2 BPE via AutoTokenizer, or a byte-level BPE trained here
indexed_dataset.py Megatron's memory-mapped indexed dataset (writer and reader)
gpt_dataset.py     seq_length + 1 token windows, seeded epoch-aware shuffle, cached index
sampler.py         Megatron pretraining batch sampler and train/valid/test loaders
paths.py           --data-path forms (prefix, per-split prefix, blend), --split, default locations
blended.py         document ranges of one corpus and weighted sample-exact blends
"""

from .gpt_dataset import GPTDataset, build_sample_index
from .indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset, best_dtype
from .preprocess import PreprocessResult, prepare_sample_data, preprocess
from .blended import BlendedDataset, DocumentRange, blend_index, build_split_dataset
from .paths import default_data_prefix, parse_data_path, split_prefix, split_ranges
from .sampler import (
    PretrainingSampler,
    build_pretraining_data_loader,
    build_train_valid_test_data_loaders,
    global_batch_indices,
)
from .tokenizer import EOD_TOKEN, Tokenizer, load_tokenizer, train_tokenizer

__all__ = [
    "GPTDataset",
    "build_sample_index",
    "IndexedDatasetBuilder",
    "MMapIndexedDataset",
    "best_dtype",
    "PreprocessResult",
    "prepare_sample_data",
    "preprocess",
    "PretrainingSampler",
    "build_pretraining_data_loader",
    "build_train_valid_test_data_loaders",
    "global_batch_indices",
    "split_prefix",
    "EOD_TOKEN",
    "Tokenizer",
    "load_tokenizer",
    "train_tokenizer",
    "BlendedDataset",
    "DocumentRange",
    "blend_index",
    "build_split_dataset",
    "default_data_prefix",
    "parse_data_path",
    "split_ranges",
]
