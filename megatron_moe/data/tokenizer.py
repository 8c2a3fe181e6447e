"""Tokenizers for preprocessing and evaluation: GPT-2 BPE from the hub or disk, or our own.

`load_tokenizer(name_or_path)` accepts a directory written by `save_tokenizer` (read with
`tokenizers` directly, which avoids importing `transformers`: ~6 s), or anything
`AutoTokenizer.from_pretrained` accepts (a hub name such as `gpt2`, or a local directory).
A saved tokenizer also loads with `AutoTokenizer.from_pretrained(dir)`, with the same ids. Our
byte-level BPE pre-tokenizes as GPT-2 does and reserves id 0 for `<|endoftext|>` (always ask `.eod`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"
MARKER_FILE = "megatron_moe_tokenizer.json"  # says "trained here; load with `tokenizers`"


class Tokenizer:
    """Text <-> token ids with an end-of-document id; wraps a `tokenizers.Tokenizer` (fast path)
    or a `transformers` tokenizer. Never adds special tokens while encoding."""

    def __init__(self, backend: Any, eod: int, name: str) -> None:
        self.backend = backend
        self.name = name
        self._eod = eod

    @property
    def eod(self) -> int:
        """Id of the end-of-document token appended by --append-eod."""
        return self._eod

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the model's vocabulary must be >= this)."""
        if isinstance(self.backend, tokenizers.Tokenizer):
            return self.backend.get_vocab_size(with_added_tokens=True)
        return len(self.backend)

    def _fast(self) -> tokenizers.Tokenizer | None:
        if isinstance(self.backend, tokenizers.Tokenizer):
            return self.backend
        return getattr(self.backend, "backend_tokenizer", None)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added."""
        fast = self._fast()
        if fast is not None:
            return [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)]
        return self.backend(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def encode(self, text: str) -> list[int]:
        """Token ids of one text, no special tokens added."""
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids, special tokens kept."""
        ids = [int(i) for i in ids]
        if isinstance(self.backend, tokenizers.Tokenizer):
            return self.backend.decode(ids, skip_special_tokens=False)
        return self.backend.decode(ids)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` ids (256 bytes + <|endoftext|> + merges)
    on `texts`; deterministic for the same texts."""
    if vocab_size < 258:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small for a byte-level BPE: it needs "
            f"256 byte tokens + {EOD_TOKEN} + at least one merge (>= 258)"
        )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    eod = tok.token_to_id(EOD_TOKEN)
    assert eod is not None  # a special token of the trainer
    return Tokenizer(tok, eod, name="trained byte-level BPE")


def save_tokenizer(tok: Tokenizer, directory: str | os.PathLike) -> None:
    """Write a trained tokenizer as a directory: tokenizer.json (the `tokenizers` model),
    tokenizer_config.json (so AutoTokenizer loads it) and our marker file."""
    if not isinstance(tok.backend, tokenizers.Tokenizer):
        raise TypeError("save_tokenizer saves tokenizers trained by train_tokenizer only")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(d / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOD_TOKEN,
        "bos_token": EOD_TOKEN,
        "unk_token": EOD_TOKEN,
        "add_prefix_space": False,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    marker = {
        "eod_token": EOD_TOKEN,
        "vocab_size": tok.vocab_size,
        "kind": "byte-level BPE trained by megatron_moe.data.tokenizer",
    }
    (d / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


# A tokenizer directory may name Python code to import: an `auto_map` in tokenizer_config.json (or
# config.json) makes `AutoTokenizer.from_pretrained` import a .py file from that directory, and with
# trust_remote_code unset transformers asks on the terminal and runs it on "y". A tokenizer here is
# data (a checkpoint carries one): it is always loaded with trust_remote_code=False, and a directory
# with an `auto_map` is refused up front, naming the file, instead of a prompt or an opaque error.
CODE_CONFIG_FILES = ("tokenizer_config.json", "config.json")


def refuse_custom_code(directory: str | os.PathLike) -> None:
    """ValueError naming the file when `directory` has a config with an `auto_map` (custom code)."""
    for name in CODE_CONFIG_FILES:
        path = Path(directory) / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):  # unreadable: transformers reports it when it loads the file
            continue
        if isinstance(data, dict) and "auto_map" in data:
            raise ValueError(
                f"--tokenizer-name-or-path {directory}: {path} has an auto_map naming custom Python code; "
                "tokenizers are loaded without running code (trust_remote_code=False): remove the auto_map"
            )


def refuse_links(directory: str | os.PathLike) -> None:
    """ValueError naming the first symbolic link at or under `directory` (links are not followed).

    For a tokenizer a checkpoint carries: a link there can name any file on the machine, which
    loading would read and saving a new checkpoint would copy in as a regular file."""
    top = str(directory)
    if os.path.islink(top):
        raise ValueError(f"{top} is a symbolic link: a checkpoint's tokenizer directory must hold its own files")
    for dirpath, dirnames, filenames in os.walk(top):
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                raise ValueError(
                    f"{path} is a symbolic link inside a checkpoint's tokenizer directory "
                    f"(links there are refused, never followed): replace it with the file itself"
                )


def load_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer (see the module docstring for what is accepted), never running code from it.
    Errors name --tokenizer-name-or-path."""
    p = Path(name_or_path)
    if p.is_dir():
        refuse_custom_code(p)
    if (p / MARKER_FILE).is_file():
        marker = json.loads((p / MARKER_FILE).read_text())
        tok = tokenizers.Tokenizer.from_file(str(p / "tokenizer.json"))
        eod = tok.token_to_id(marker["eod_token"])
        if eod is None:
            raise ValueError(f"--tokenizer-name-or-path {p}: {marker['eod_token']} is not in the vocabulary")
        return Tokenizer(tok, eod, name=str(p))
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=False)
    except Exception as e:  # hub unreachable, bad directory, ...: say which flag and why
        raise ValueError(
            f"--tokenizer-name-or-path {name_or_path}: could not load it with "
            f"transformers.AutoTokenizer ({type(e).__name__}: {e})"
        ) from e
    hf_eod: Any = hf.eos_token_id
    if hf_eod is None:
        hf_eod = hf.convert_tokens_to_ids(EOD_TOKEN) if EOD_TOKEN in hf.get_vocab() else None
    if hf_eod is None:
        raise ValueError(
            f"--tokenizer-name-or-path {name_or_path}: the tokenizer has no "
            f"end-of-document token (no eos_token and no {EOD_TOKEN})"
        )
    return Tokenizer(hf, int(hf_eod), name=str(name_or_path))
