"""Profile expert paths for Lina's inference scheduling (paper section 5.2).

Runs a checkpoint (any layout, or a consolidated .safetensors file) on one process with dropless
routing over a calibration split and saves, per MoE layer and per path of experts over the last
--path-length MoE layers (fewer for early layers), how often each expert is among the tokens'
top-k choices at that layer (megatron_moe/inference/popularity.py). The output is JSON (never
pickle), written under a temporary name and renamed, and carries a fingerprint of the model
(config shape, SHA-256 of the gate weights): `--lina-inference` refuses a profile of another model.

    python tools/profile_expert_paths.py --load checkpoints/gpt2-moe \\
        --input data/wikitext-sample/wiki.valid.tokens --output expert_paths.json --path-length 3

--input is a WikiText-format .tokens file (documents split at title lines) or plain text, tokenized
with the checkpoint's tokenizer (an end-of-document id after each document), cut into windows of
--seq-length tokens (default: the model's context).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megatron_moe.arguments import HelpFormatter
from megatron_moe.data.preprocess import split_wikitext_documents
from megatron_moe.data.tokenizer import load_tokenizer
from megatron_moe.generation import carried_tokenizer, tokenizer_path
from megatron_moe.inference.engine import load_engine
from megatron_moe.inference.popularity import calibration_batches, collect_profile, save_profile
from megatron_moe.inference.scheduled import gate_fingerprint
from megatron_moe.parallel_state import local_state


def build_parser() -> argparse.ArgumentParser:
    """Flags of the profiler."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (any layout) or FILE.safetensors")
    p.add_argument("--iteration", type=int, help="use this iteration instead of the latest")
    p.add_argument("--input", required=True, help="calibration text: a WikiText .tokens file or plain text")
    p.add_argument("--output", required=True, help="profile to write (JSON)")
    p.add_argument("--path-length", type=int, default=3, help="MoE layers in a path (l)")
    p.add_argument("--seq-length", type=int, help="tokens per window (default: the model's context)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    p.add_argument("--max-batches", type=int, default=32, help="forwards at most")
    p.add_argument("--tokenizer-name-or-path", help="tokenizer (default: the checkpoint's)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Write the profile; errors go to stderr with status 2."""
    args = build_parser().parse_args(argv)
    try:
        if args.path_length < 0:
            raise ValueError(f"--path-length must be >= 0, got {args.path_length}")
        if not os.path.isfile(args.input):
            raise FileNotFoundError(f"--input {args.input} does not exist")
        if os.path.isdir(args.output):
            raise ValueError(f"--output {args.output} is a directory")
        engine = load_engine(args.load, local_state(), args.iteration)
        tok = load_tokenizer(
            tokenizer_path(engine.cfg, args.tokenizer_name_or_path, carried_tokenizer(args.load, args.iteration))
        )
        with open(args.input, encoding="utf-8") as f:
            docs = list(split_wikitext_documents(f))
        ids: list[int] = []
        for d in docs:
            ids += tok.encode(d) + [tok.eod]
        seq = args.seq_length or engine.max_pos
        if seq > engine.max_pos:
            raise ValueError(f"--seq-length {seq} is longer than the model's context of {engine.max_pos}")
        batches = calibration_batches(ids, seq, args.batch_size, args.max_batches, engine.device)
        profile = collect_profile(engine.model, batches, args.path_length, gate_fingerprint(engine))
        save_profile(profile, args.output)
        paths = sum(len(c) for c in profile.counts)
        print(
            f"profiled {sum(b.numel() for b in batches)} tokens, {profile.num_layers} MoE layers, {paths} paths "
            f"(path length {args.path_length}) -> {args.output}",
            flush=True,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"profile_expert_paths.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
