"""Turn WikiText (or jsonl) into `PREFIX_{train,valid,test}_{key}_document.{bin,idx}`.

Inputs (exactly one): `dataset` (a WikiText name, through `datasets`); `input_path=DIR` holding
`wiki.{train,valid,test}.raw` or `.tokens` (`.raw` wins) or `{train,valid,test}.jsonl`;
`input_path=FILE` (WikiText, or `.jsonl`/`.json`) cut into contiguous train/valid/test blocks of
documents by `split`; `input_path=[FILE, ...]`: WikiText files as one corpus, written as train.
WikiText documents start at top-level headings (` = Title = `), never at ` = = Sub = = `. jsonl
gives one document per line and `json_keys` field, each key written to its own files (WikiText's
key is `text`). Tokenizer (exactly one): `tokenizer_name_or_path`, or `train_tokenizer=True` with
`vocab_size` (a byte-level BPE trained on the train split, saved as `PREFIX_tokenizer/`).

All files go to a temporary directory beside the output (`.NAME.tmp-HOST-PID`) and are renamed into
place only when every split has been written, so a failure leaves no partial output.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import socket
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from ..fileio import pid_alive, read_lines
from .indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset, best_dtype
from .tokenizer import Tokenizer, load_tokenizer, save_tokenizer
from .tokenizer import train_tokenizer as train_bpe

if TYPE_CHECKING:
    from .paths import WikiTextSource

SPLITS = ("train", "valid", "test")
WIKITEXT_DATASETS = ("wikitext-2-raw-v1", "wikitext-103-raw-v1", "wikitext-2-v1", "wikitext-103-v1")


def sample_corpus_dir() -> Path:
    """The bundled sample corpus: `megatron_moe/sample_corpus/` in an installed package, else the
    checkout's `data/wikitext-sample/`."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "sample_corpus"
    return installed if installed.is_dir() else package.parent / "data" / "wikitext-sample"


SAMPLE_CORPUS_DIR = sample_corpus_dir()
_TITLE = re.compile(r"= [^=](.*[^=])? =")  # ' = Title = ' stripped; '= = Sub = =' fails

Records = Callable[[], Iterator[dict[str, str]]]  # re-iterable source of {key: document}


def is_title_line(line: str) -> bool:
    """True for a WikiText top-level heading line (` = Title = `), False for sub-headings."""
    return _TITLE.fullmatch(line.strip()) is not None


def split_wikitext_documents(lines: Iterable[str]) -> Iterator[str]:
    """Group WikiText lines (newlines kept) into articles, each starting at its heading.
    Whitespace-only pieces (e.g. the blank line before the first heading) are dropped."""
    buf: list[str] = []
    for line in lines:
        if buf and is_title_line(line):
            doc = "".join(buf)
            if doc.strip():
                yield doc
            buf = []
        buf.append(line)
    doc = "".join(buf)
    if doc.strip():
        yield doc


def _wikitext_file(path: Path) -> Records:
    def records() -> Iterator[dict[str, str]]:
        for doc in split_wikitext_documents(read_lines(path)):
            yield {"text": doc}

    return records


def _jsonl_file(path: Path, keys: Sequence[str]) -> Records:
    def records() -> Iterator[dict[str, str]]:
        for n, line in enumerate(read_lines(path), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from e
            missing = [k for k in keys if not isinstance(obj.get(k), str)]
            if missing:
                raise ValueError(f"{path}:{n}: no text field {missing} (--json-keys)")
            yield {k: obj[k] for k in keys}

    return records


class HubUnavailable(ValueError):
    """`datasets.load_dataset` could not give a WikiText dataset (offline, hub down, ...)."""


HUB_PROBE_S = 1.5  # how long one request may take to show that the hub answers


def _hf_wikitext(name: str) -> dict[str, tuple[str, Records]]:
    """The three splits of WikiText from the HF hub. Online, one request first checks that the hub
    answers, so an unreachable hub fails at once instead of after the retries (about 25 s)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if not constants.HF_HUB_OFFLINE:
        try:
            get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_S)
        except Exception as e:  # DNS, refused, timeout, proxy, TLS: the hub cannot be reached
            why = (
                f"{constants.ENDPOINT} is unreachable ({type(e).__name__}: {e}), not retried; "
                f"HF_HUB_OFFLINE=1 loads a copy already in the Hugging Face cache"
            )
            raise HubUnavailable(f"--dataset {name}: {why}") from ConnectionError(why)
    import datasets

    try:
        ds = datasets.load_dataset("wikitext", name)
    except Exception as e:  # offline, hub down, ...: name the flag and say why
        raise HubUnavailable(
            f"--dataset {name}: datasets.load_dataset('wikitext', '{name}') failed ({type(e).__name__}: {e})"
        ) from e
    out: dict[str, tuple[str, Records]] = {}
    for split, hf_split in zip(SPLITS, ("train", "validation", "test")):

        def records(rows=ds[hf_split]) -> Iterator[dict[str, str]]:
            # blank lines come as "": put back the released files' " \n" (the same documents)
            lines = (" \n" if r == "" else r if r.endswith("\n") else r + "\n" for r in rows["text"])
            for doc in split_wikitext_documents(lines):
                yield {"text": doc}

        out[split] = (f"--dataset {name} ({hf_split})", records)
    return out


def _check_file(path: Path, flag: str = "--input") -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: {path} does not exist")
    if path.stat().st_size == 0:
        raise ValueError(f"{flag}: {path} is empty")


def _directory_sources(d: Path, keys: Sequence[str]) -> dict[str, tuple[str, Records]]:
    out = {}
    for split in SPLITS:
        cands = [d / f"wiki.{split}.raw", d / f"wiki.{split}.tokens", d / f"{split}.jsonl"]
        found = next((c for c in cands if c.exists()), None)
        if found is None:
            raise FileNotFoundError(
                f"--input {d}: found none of {', '.join(c.name for c in cands)} for the {split} split"
            )
        _check_file(found)
        recs = _jsonl_file(found, keys) if found.suffix == ".jsonl" else _wikitext_file(found)
        out[split] = (str(found), recs)
    return out


def _slice_of(recs: Records, lo: int, hi: int) -> Iterator[dict[str, str]]:
    """Documents lo..hi-1 of `recs` (one split of a single file)."""
    return islice(recs(), lo, hi)


def _single_file_sources(path: Path, keys: Sequence[str], split: Sequence[float]) -> dict[str, tuple[str, Records]]:
    """Cut one file's documents into contiguous train/valid/test blocks by percentage."""
    _check_file(path)
    if len(split) != 3 or min(split) < 0 or split[0] <= 0:
        raise ValueError(f"--split {split}: need three non-negative weights, train > 0")
    recs = _jsonl_file(path, keys) if path.suffix in (".jsonl", ".json") else _wikitext_file(path)
    n = sum(1 for _ in recs())
    cum = np.cumsum(np.asarray(split, dtype=np.float64)) / float(sum(split))
    bounds = [0] + [int(round(c * n)) for c in cum]
    out: dict[str, tuple[str, Records]] = {}
    for i, s in enumerate(SPLITS):
        lo, hi = bounds[i], bounds[i + 1]
        if split[i] == 0:
            continue  # this split is not written
        if hi <= lo:
            raise ValueError(f"--split {split}: the {s} split of {path} gets no documents ({n} in the file)")
        out[s] = (f"{path} [{s}: documents {lo}..{hi - 1}]", partial(_slice_of, recs, lo, hi))
    return out


def resolve_sources(
    input_path: str | Sequence[str] | None, dataset: str | None, json_keys: Sequence[str], split: Sequence[float]
) -> dict[str, tuple[str, Records]]:
    """Check the input flags and files; map split -> (label for messages, record source)."""
    if (input_path is None) == (dataset is None):
        raise ValueError("give exactly one of --input and --dataset")
    if dataset is not None:
        if dataset not in WIKITEXT_DATASETS:
            raise ValueError(f"--dataset {dataset}: expected one of {', '.join(WIKITEXT_DATASETS)}")
        return _hf_wikitext(dataset)
    if isinstance(input_path, (list, tuple)):
        paths = [Path(f) for f in input_path]
        for f in paths:
            _check_file(f)

        def records() -> Iterator[dict[str, str]]:
            for f in paths:
                yield from _wikitext_file(f)()

        return {"train": (" + ".join(map(str, paths)), records)}
    p = Path(str(input_path))
    if p.is_dir():
        return _directory_sources(p, json_keys)
    return _single_file_sources(p, json_keys, split)


# ---- encoding (in-process or in a multiprocessing pool) ----
_WORKER: dict = {}


def _init_worker(tok: Tokenizer, keys: Sequence[str], append_eod: bool, dtype: type) -> None:
    _WORKER.update(tok=tok, keys=keys, append_eod=append_eod, dtype=dtype)


def _encode_chunk(records: list[dict[str, str]]) -> list[dict[str, np.ndarray]]:
    """Token arrays of each record's fields, EOD appended when asked."""
    w = _WORKER
    out: list[dict[str, np.ndarray]] = [{} for _ in records]
    for k in w["keys"]:
        for o, ids in zip(out, w["tok"].encode_batch([r[k] for r in records])):
            o[k] = np.asarray(ids + [w["tok"].eod] if w["append_eod"] else ids, dtype=w["dtype"])
    return out


def _chunks(it: Iterator, n: int) -> Iterator[list]:
    while chunk := list(islice(it, n)):
        yield chunk


def encode_records(
    records: Iterator[dict[str, str]],
    tok: Tokenizer,
    keys: Sequence[str],
    append_eod: bool,
    dtype: type,
    workers: int = 1,
    chunk_docs: int = 64,
) -> Iterator[dict[str, np.ndarray]]:
    """Encode records in order, in this process (workers=1) or in a pool of `workers`."""
    args = (tok, tuple(keys), append_eod, dtype)
    if workers <= 1:
        _init_worker(*args)
        for chunk in _chunks(records, chunk_docs):
            yield from _encode_chunk(chunk)
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    # forked children must not use the tokenizers thread pool (tokenizers would warn and decide so)
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = mp.get_context(method).Pool(workers, initializer=_init_worker, initargs=args)
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old
    with pool:
        for out in pool.imap(_encode_chunk, _chunks(records, chunk_docs)):
            yield from out


@dataclass
class PreprocessResult:
    """What `preprocess` wrote; prefixes, documents and tokens are keyed "split/key"."""

    output_prefix: str
    tokenizer: str
    vocab_size: int
    eod: int
    dtype: str
    prefixes: dict[str, str] = field(default_factory=dict)  # "train/text" -> prefix
    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)


def output_prefix_for(output_prefix: str, split: str, key: str = "text") -> str:
    """`PREFIX_{split}_{key}_document`."""
    return f"{output_prefix}_{split}_{key}_document"


def preprocess(
    output_prefix: str,
    *,
    input_path: str | Sequence[str] | None = None,
    dataset: str | None = None,
    tokenizer_name_or_path: str | None = None,
    train_tokenizer: bool = False,
    vocab_size: int | None = None,
    append_eod: bool = False,
    workers: int = 1,
    json_keys: Sequence[str] = ("text",),
    split: Sequence[float] = (90, 5, 5),
    progress: bool = True,
) -> PreprocessResult:
    """Tokenize the input's splits into Megatron indexed datasets (see module docstring)."""
    if (tokenizer_name_or_path is None) == (not train_tokenizer):
        raise ValueError("give exactly one of --tokenizer-name-or-path and --train-tokenizer")
    if train_tokenizer and vocab_size is None:
        raise ValueError("--train-tokenizer needs --vocab-size")
    if workers < 1:
        raise ValueError(f"--workers {workers}: must be >= 1")
    sources = resolve_sources(input_path, dataset, json_keys, split)
    tok = (
        load_tokenizer(tokenizer_name_or_path) if tokenizer_name_or_path is not None else None
    )  # load before writing anything: a bad name fails early
    out = Path(output_prefix)
    created = not out.parent.exists()
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    tmp = out.parent / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if tok is None:
            texts = (v for r in sources["train"][1]() for v in r.values())
            tok = train_bpe(texts, int(vocab_size or 0))  # checked above: given with --train-tokenizer
            save_tokenizer(tok, tmp / f"{out.name}_tokenizer")
        dtype = best_dtype(tok.vocab_size)
        result = PreprocessResult(
            str(out),
            tok.name if tokenizer_name_or_path else f"{out}_tokenizer",
            tok.vocab_size,
            tok.eod,
            np.dtype(dtype).name,
        )
        for split_name, (label, records) in sources.items():
            args = (split_name, label, records(), tok, json_keys, append_eod, dtype, workers, progress, result)
            _write_split(tmp / out.name, *args)
        # Everything is complete: move it into place, index files last (a reader needs both).
        for f in sorted(tmp.iterdir(), key=lambda f: (f.suffix == ".idx", f.name)):
            dest = out.parent / f.name
            if f.is_dir() and dest.exists():
                shutil.rmtree(dest)
            os.replace(f, dest)
        for key in result.prefixes:
            result.prefixes[key] = str(out.parent / Path(result.prefixes[key]).name)
        return result
    except BaseException:
        if created and not any(p for p in out.parent.iterdir() if p != tmp):
            shutil.rmtree(out.parent, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_leftovers(out: Path) -> None:
    """Remove `.NAME.tmp-HOST-PID` directories of killed preprocessings of `out` on this host."""
    name = re.compile(re.escape(f".{out.name}.tmp-{socket.gethostname()}-") + r"(\d+)")
    for p in out.parent.iterdir():
        m = name.fullmatch(p.name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _write_split(
    tmp_prefix: Path,
    split: str,
    label: str,
    records: Iterator[dict[str, str]],
    tok: Tokenizer,
    keys: Sequence[str],
    append_eod: bool,
    dtype: type,
    workers: int,
    progress: bool,
    result: PreprocessResult,
) -> None:
    builders = {k: IndexedDatasetBuilder(output_prefix_for(str(tmp_prefix), split, k), dtype) for k in keys}
    n_docs, n_tok = 0, {k: 0 for k in keys}
    bar = tqdm(desc=f"{split}", unit="doc", disable=not progress)
    try:
        for enc in encode_records(records, tok, keys, append_eod, dtype, workers):
            for k in keys:
                builders[k].add_document(enc[k])
                n_tok[k] += len(enc[k])
            n_docs += 1
            bar.update(1)
            bar.set_postfix(tokens=sum(n_tok.values()), refresh=False)
        if n_docs == 0:
            raise ValueError(f"{label}: no documents found (the {split} split would be empty)")
        for k, b in builders.items():
            b.finalize()
            result.prefixes[f"{split}/{k}"] = output_prefix_for(str(tmp_prefix), split, k)
            result.documents[f"{split}/{k}"] = n_docs
            result.tokens[f"{split}/{k}"] = n_tok[k]
    except BaseException:
        for b in builders.values():
            b.abort()
        raise
    finally:
        bar.close()


def prepare_sample_data(output_prefix: str, vocab_size: int = 512, progress: bool = False) -> PreprocessResult:
    """Preprocess the bundled sample corpus with a byte-level BPE of `vocab_size` and --append-eod,
    unless `output_prefix` already holds the result. Call it on one rank only."""
    prefixes = {f"{s}/text": output_prefix_for(output_prefix, s) for s in SPLITS}
    tok_dir = f"{output_prefix}_tokenizer"
    if all(os.path.isfile(p + ".idx") for p in prefixes.values()) and os.path.isdir(tok_dir):
        if load_tokenizer(tok_dir).vocab_size == vocab_size:
            return _existing(output_prefix, tok_dir, prefixes)
    return preprocess(
        output_prefix,
        input_path=str(sample_corpus_dir()),
        train_tokenizer=True,
        vocab_size=vocab_size,
        append_eod=True,
        progress=progress,
    )


def _existing(output_prefix: str, tokenizer: str, prefixes: dict[str, str]) -> PreprocessResult:
    """The result of an earlier preprocessing whose files are all there."""
    tok = load_tokenizer(tokenizer)
    dtype = np.dtype(best_dtype(tok.vocab_size)).name
    res = PreprocessResult(output_prefix, tokenizer, tok.vocab_size, tok.eod, dtype, prefixes)
    for key, p in prefixes.items():
        ds = MMapIndexedDataset(p)
        res.documents[key], res.tokens[key] = len(ds), ds.num_tokens
    return res


WIKITEXT_URL = "https://wikitext.smerity.com"  # the publishers' release zips


def wikitext_split_files(directory: Path) -> dict[str, Path | None]:
    """{split: wiki.{split}.raw, else wiki.{split}.tokens, else None} in `directory`."""
    out: dict[str, Path | None] = {}
    for split in SPLITS:
        cands = [directory / f"wiki.{split}.raw", directory / f"wiki.{split}.tokens"]
        out[split] = next((c for c in cands if c.is_file()), None)
    return out


def _download_hint(dataset: str) -> str:
    """What to download for `dataset` and where to put it (see paths.wikitext_local_dir)."""
    from .paths import default_data_dir, wikitext_local_dir

    raw = "raw" in dataset
    ext = "raw" if raw else "tokens"
    title = "WikiText-103" if "103" in dataset else "WikiText-2"
    return (
        f"download {title} ({WIKITEXT_URL}/{dataset}.zip) and unzip it into {default_data_dir()} so "
        f"that {wikitext_local_dir(dataset)}/ holds wiki.train.{ext}, wiki.valid.{ext} and "
        f"wiki.test.{ext} (then this --data-path finds it), or pass --data-path DIR naming any "
        f"directory that holds those three files (wiki.*.tokens work too)"
    )


def one_corpus_files(source: WikiTextSource) -> list[Path]:
    """The WikiText files of a directory `source` that lacks one of wiki.{train,valid,test} (in
    that order; read as one corpus that --split cuts); [] for all three, or a hub name."""
    if source.directory is None:
        return []
    files = [f for f in wikitext_split_files(source.directory).values() if f is not None]
    return files if len(files) < len(SPLITS) else []


def prepare_wikitext_data(
    source: WikiTextSource,
    output_prefix: str,
    tokenizer_name_or_path: str | None = None,
    vocab_size: int | None = None,
    progress: bool = False,
) -> tuple[PreprocessResult, bool]:
    """Preprocess raw WikiText (a directory or a hub name) into `output_prefix` with --append-eod,
    unless it already holds the result; returns (result, whether it was reused). Call it on one rank.

    The tokenizer is `tokenizer_name_or_path`, else a byte-level BPE of `vocab_size` ids. All three
    splits give `output_prefix_{train,valid,test}_text_document`; a directory with only some gives
    them, in order, as one corpus `output_prefix.{bin,idx}` that `--split` cuts. A hub name that
    cannot be loaded gives a ValueError saying what to download and where to put it.
    """
    if (tokenizer_name_or_path is None) == (vocab_size is None):
        raise ValueError("give exactly one of tokenizer_name_or_path and vocab_size")
    flag = f"--data-path {source.word}"
    one = one_corpus_files(source)
    if source.directory is not None:
        files = [f for f in wikitext_split_files(source.directory).values() if f is not None]
        if not files:
            raise FileNotFoundError(
                f"{flag}: {source.directory} has none of wiki.train.tokens, wiki.valid.tokens and "
                f"wiki.test.tokens (or .raw): a WikiText directory needs them (the three splits, or "
                f"any of them as one corpus that --split cuts)"
            )
        for f in files:
            _check_file(f, flag)
    prefixes = (
        {"all/text": output_prefix} if one else {f"{s}/text": output_prefix_for(output_prefix, s) for s in SPLITS}
    )
    tok_dir = f"{output_prefix}_tokenizer"
    if all(os.path.isfile(p + ".idx") for p in prefixes.values()) and (
        tokenizer_name_or_path is not None or os.path.isdir(tok_dir)
    ):
        return _existing(output_prefix, tokenizer_name_or_path or tok_dir, prefixes), True
    try:
        res = preprocess(
            output_prefix,
            input_path=[str(f) for f in one] if one else str(source.directory) if source.directory else None,
            dataset=source.dataset,
            tokenizer_name_or_path=tokenizer_name_or_path,
            train_tokenizer=tokenizer_name_or_path is None,
            vocab_size=vocab_size,
            append_eod=True,
            progress=progress,
        )
    except HubUnavailable as e:
        raise ValueError(
            f"{flag}: cannot load {source.dataset} from the Hugging Face hub "
            f"({e.__cause__.__class__.__name__}: {e.__cause__}); "
            f"{_download_hint(str(source.dataset))}"
        ) from e
    if one:  # the one corpus is a Megatron prefix: PREFIX.{bin,idx}, index last
        for ext in (".bin", ".idx"):
            os.replace(output_prefix_for(output_prefix, "train") + ext, output_prefix + ext)
        res.prefixes = prefixes
    return res, False
