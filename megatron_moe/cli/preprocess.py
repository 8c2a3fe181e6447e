"""Tokenize WikiText (or jsonl) into Megatron indexed datasets for `--data-path PREFIX`.

Writes PREFIX_{train,valid,test}_text_document.{bin,idx} (and PREFIX_tokenizer/ when it trains
the tokenizer). Installed as `mmoe-preprocess`; `python tools/preprocess_data.py` runs the same. Examples, from
the repository root:

    # the bundled sample corpus, with a byte-level BPE of 512 ids trained on its train split
    python tools/preprocess_data.py --input data/wikitext-sample \\
        --output-prefix data/processed/sample --train-tokenizer --vocab-size 512 --append-eod

    # real WikiText-103 through the HF hub, GPT-2 BPE, 8 tokenizer processes
    python tools/preprocess_data.py --dataset wikitext-103-raw-v1 \\
        --output-prefix data/processed/wt103 --tokenizer-name-or-path gpt2 --append-eod --workers 8

See megatron_moe/data/preprocess.py for the accepted inputs and data/README.md for more.
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron_moe.data.preprocess import WIKITEXT_DATASETS, preprocess


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (Megatron-LM's tools/preprocess_data.py names where they exist)."""
    p = argparse.ArgumentParser(description="Tokenize WikiText or jsonl into Megatron indexed datasets (.bin/.idx).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--dataset", choices=WIKITEXT_DATASETS, help="load WikiText from the HF hub with datasets.load_dataset"
    )
    src.add_argument(
        "--input",
        help="a directory with wiki.{train,valid,test}.{raw,tokens} "
        "(or {train,valid,test}.jsonl), or one WikiText/.jsonl file",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="jsonl fields to tokenize, one output per field (default: text)",
    )
    p.add_argument(
        "--split",
        default="90,5,5",
        help="train,valid,test percentages for a single --input file (default 90,5,5; a 0 skips that split)",
    )
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{train,valid,test}_text_document.{bin,idx}")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer-name-or-path", help="hub name (e.g. gpt2) or local directory for AutoTokenizer")
    tok.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="train a byte-level BPE on the train split (needs --vocab-size); saved as PREFIX_tokenizer/",
    )
    p.add_argument("--vocab-size", type=int, help="vocabulary size of --train-tokenizer")
    p.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        args.split = [float(x) for x in args.split.split(",")]
    except ValueError:
        p.error(f"--split {args.split}: expected three comma-separated numbers")
    if args.train_tokenizer and args.vocab_size is None:
        p.error("--train-tokenizer needs --vocab-size")
    if args.vocab_size is not None and not args.train_tokenizer:
        p.error("--vocab-size is only used with --train-tokenizer")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the preprocessing; print what was written. Returns the exit status."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        res = preprocess(
            args.output_prefix,
            input_path=args.input,
            dataset=args.dataset,
            tokenizer_name_or_path=args.tokenizer_name_or_path,
            train_tokenizer=args.train_tokenizer,
            vocab_size=args.vocab_size,
            append_eod=args.append_eod,
            workers=args.workers,
            json_keys=args.json_keys,
            split=args.split,
            progress=not args.no_progress,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"tokenizer: {res.tokenizer} (vocab {res.vocab_size}, eod id {res.eod}, stored as {res.dtype})")
    for key, prefix in res.prefixes.items():
        print(f"{key:>12}: {res.documents[key]:>8} documents {res.tokens[key]:>11} tokens -> {prefix}.{{bin,idx}}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
