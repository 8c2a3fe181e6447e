"""What `--data-path` names, and where the bundled sample corpus is preprocessed.

`--data-path PREFIX` is one corpus; `--data-path 0.3 PREFIX_A 0.7 PREFIX_B` a weighted blend.
A PREFIX is a Megatron prefix (`PREFIX.{bin,idx}`, cut into train/valid/test by `--split`) or a
per-split prefix (`PREFIX_{train,valid,test}_text_document.{bin,idx}`). A single word may also
name raw WikiText (a dataset name such as `wikitext-2`, or a directory of `wiki.*.tokens`),
preprocessed once into `default_data_dir()` (`wikitext_source`, `wikitext_cache_prefix`). An
existing PREFIX wins over a directory, and a directory over a name. Without `--data-path` the
bundled sample corpus is preprocessed into `default_data_dir()`, never the current directory.
"""

from __future__ import annotations

import math

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from .indexed_dataset import index_file_path

SPLITS = ("train", "valid", "test")
SAMPLE_NAME = "wikitext-sample"
DATA_DIR_ENV = "MEGATRON_MOE_DATA_DIR"

DataPath = Union[str, list[str], tuple[str, ...]]


def cache_home() -> Path:
    """`$XDG_CACHE_HOME/megatron-moe` (default `~/.cache/megatron-moe`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-moe"


def default_data_dir() -> Path:
    """Where corpora are preprocessed: `$MEGATRON_MOE_DATA_DIR`, else `processed/` beside the bundled
    corpus when writable, else `$XDG_CACHE_HOME/megatron-moe/processed`."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser().resolve()
    from .preprocess import SAMPLE_CORPUS_DIR

    beside = SAMPLE_CORPUS_DIR.resolve().parent / "processed"
    probe = beside if beside.is_dir() else beside.parent
    if probe.is_dir() and os.access(probe, os.W_OK):
        return beside
    return cache_home() / "processed"


def default_data_prefix() -> str:
    """Absolute prefix of the preprocessed bundled corpus."""
    return str(default_data_dir() / SAMPLE_NAME)


def parse_data_path(data_path: DataPath) -> list[tuple[float, str]]:
    """[(weight, prefix)] with weights summing to 1, from `--data-path`'s words (one PREFIX, or WEIGHT PREFIX ...)."""
    words = [data_path] if isinstance(data_path, str) else list(data_path)
    if not words:
        raise ValueError("--data-path needs a PREFIX or 'WEIGHT PREFIX ...'")
    if len(words) == 1:
        return [(1.0, words[0])]
    if len(words) % 2:
        raise ValueError(
            f"--data-path with several words must alternate WEIGHT PREFIX, got {len(words)} words: {' '.join(words)}"
        )
    pairs = []
    for w, prefix in zip(words[0::2], words[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(
                f"--data-path: '{w}' is not a weight (blends are 'WEIGHT PREFIX WEIGHT PREFIX ...')"
            ) from None
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"--data-path: weight {w} of {prefix} must be a finite number >= 0")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ValueError("--data-path: the blend weights sum to 0")
    return [(w / total, p) for w, p in pairs]


def split_prefix(data_path: str, split: str) -> str:
    """Prefix of one split's files: `PREFIX_{split}_text_document`."""
    return f"{data_path}_{split}_text_document"


def prefix_kind(prefix: str) -> str:
    """'single' for a Megatron PREFIX.{bin,idx}, 'splits' for PREFIX_{train,...}_text_document.*."""
    if os.path.isfile(index_file_path(prefix)):
        return "single"
    if os.path.isfile(index_file_path(split_prefix(prefix, "train"))):
        return "splits"
    raise FileNotFoundError(
        f"--data-path {prefix}: neither {index_file_path(prefix)} (a Megatron prefix) nor "
        f"{index_file_path(split_prefix(prefix, 'train'))} (per-split files) exists; run "
        f"tools/preprocess_data.py --output-prefix {prefix} first"
    )


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> normalized [train, valid, test] weights (`/` also separates, as in Megatron)."""
    try:
        w = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        w = []
    if len(w) != 3 or any(not (x >= 0 and math.isfinite(x)) for x in w) or sum(w) <= 0:
        raise ValueError(
            f"--split must be three non-negative weights 'train,valid,test' with a positive sum, got '{split}'"
        )
    return [x / sum(w) for x in w]


def split_ranges(num_docs: int, split: str) -> dict[str, tuple[int, int]]:
    """Disjoint document ranges {split: (start, stop)} covering [0, num_docs) in order; boundary k is
    round(num_docs x cumulative weight k)."""
    w = parse_split(split)
    cum = [0.0, w[0], w[0] + w[1], 1.0]
    bounds = [min(num_docs, int(round(c * num_docs))) for c in cum]
    bounds[-1] = num_docs
    return {s: (bounds[i], bounds[i + 1]) for i, s in enumerate(SPLITS)}


def tokenizer_dir_for(data_path: DataPath) -> str:
    """The tokenizer directory preprocess_data.py writes beside a corpus: `PREFIX_tokenizer` of the
    first prefix (a Megatron `..._text_document` prefix also looks beside its stem)."""
    prefix = parse_data_path(data_path)[0][1]
    here = f"{prefix}_tokenizer"
    if os.path.exists(here) or not prefix.endswith("_text_document"):
        return here
    stem = prefix[: -len("_text_document")]
    for s in SPLITS:  # PREFIX_train_text_document -> PREFIX_tokenizer
        if stem.endswith("_" + s):
            stem = stem[: -len(s) - 1]
            break
    return f"{stem}_tokenizer"


# ---- raw WikiText named by --data-path ----
WIKITEXT_ALIASES = {"wikitext-2": "wikitext-2-raw-v1", "wikitext-103": "wikitext-103-raw-v1"}
WIKITEXT_NAMES = ("wikitext-2-raw-v1", "wikitext-103-raw-v1", "wikitext-2-v1", "wikitext-103-v1")
WIKITEXT_VOCAB_SIZE = 8192  # the BPE trained on the train split when --vocab-size is not given
_UNZIPPED = {
    "wikitext-2-raw-v1": "wikitext-2-raw",
    "wikitext-103-raw-v1": "wikitext-103-raw",
    "wikitext-2-v1": "wikitext-2",
    "wikitext-103-v1": "wikitext-103",
}  # the zips' folders


@dataclass(frozen=True)
class WikiTextSource:
    """Raw WikiText named by `--data-path` `word`: a hub dataset name or a local directory (one is None)."""

    word: str
    dataset: Optional[str] = None
    directory: Optional[Path] = None

    def label(self) -> str:
        """How messages name the source."""
        return f"{self.dataset} from the Hugging Face hub" if self.dataset else str(self.directory)


def wikitext_local_dir(dataset: str) -> Path:
    """Where `--data-path NAME` looks before the hub: the release zip's folder in `default_data_dir()`."""
    return default_data_dir() / _UNZIPPED[dataset]


def _has_prefix_files(word: str) -> bool:
    return os.path.isfile(index_file_path(word)) or os.path.isfile(index_file_path(split_prefix(word, "train")))


def wikitext_source(word: str) -> Optional[WikiTextSource]:
    """The raw WikiText a `--data-path` word names, or None for a preprocessed PREFIX; a dataset
    name is its unzipped files under `default_data_dir()` when there, else the hub."""
    if _has_prefix_files(word):
        return None
    if os.path.isdir(word):
        return WikiTextSource(word, directory=Path(word).resolve())
    name = WIKITEXT_ALIASES.get(word.lower(), word.lower())
    if name not in WIKITEXT_NAMES:
        return None
    local = wikitext_local_dir(name)
    if local.is_dir():
        return WikiTextSource(word, directory=local.resolve())
    return WikiTextSource(word, dataset=name)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-.")[:40] or "x"


def _digest(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:10]


def _files_digest(files) -> str:
    """A hash of the names and bytes of `files` (WikiText-103's 540 MB in about 1.5 s)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"\0{Path(f).name}\0{os.path.getsize(f)}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:10]


def _tokenizer_files(directory) -> list[Path]:
    """A tokenizer directory's own files (not, say, an HF model's weights beside them)."""
    return sorted(f for f in Path(directory).iterdir() if f.is_file() and f.suffix in (".json", ".txt", ".model"))


def wikitext_cache_prefix(source: WikiTextSource, tokenizer: Optional[str], vocab_size: int) -> str:
    """Absolute prefix, in `default_data_dir()`, of `source` preprocessed with `tokenizer` (a name
    or directory) or, when None, a BPE of `vocab_size`. The key is content, never a path: the
    WikiText files' names and bytes (or the hub name) and the tokenizer's files (or name). A
    tokenizer directory with the files of a BPE trained here for this source (a checkpoint's copy)
    names that BPE's cache, so a resume reuses it."""
    from .preprocess import wikitext_split_files

    if source.directory is None:
        src = str(source.dataset)
    else:
        files = [f for f in wikitext_split_files(source.directory).values() if f is not None]
        src = f"wikitext-{_slug(source.directory.name)}-{_files_digest(files)}"
    if tokenizer is None:
        tok = f"bpe{vocab_size}"
    elif os.path.isdir(tokenizer):
        digest = _files_digest(_tokenizer_files(tokenizer))
        for trained in sorted(default_data_dir().glob(f"{src}-bpe*_tokenizer")):
            if _files_digest(_tokenizer_files(trained)) == digest:
                return str(trained)[: -len("_tokenizer")]
        tok = f"tok-{_slug(os.path.basename(tokenizer.rstrip('/')))}-{digest}"
    else:
        tok = f"tok-{_slug(tokenizer)}-{_digest(tokenizer)}"
    return str(default_data_dir() / f"{src}-{tok}")
