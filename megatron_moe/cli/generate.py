"""Sample text from a checkpoint (any parallel layout) or a consolidated safetensors file.

Installed as `mmoe-generate`; `python tools/generate.py` runs the same. Examples, from the
repository root:

    python tools/generate.py --load checkpoints/gpt2-moe --prompt "The history of" --greedy
    python tools/generate.py --load model.safetensors --prompt "In 1996" --temperature 0.8 \\
        --top-k 50 --top-p 0.95 --max-new-tokens 64 --seed 7 --num-samples 3

The tokenizer is --tokenizer-name-or-path, else the one the checkpoint carries (ITER_DIR/tokenizer,
copied at save), else the one recorded in its config, else the one beside its training data.
See megatron_moe/generation.py.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megatron_moe.arguments import HelpFormatter
from megatron_moe.generation import (carried_tokenizer, check_sampling, generate, load_model,
                                     tokenizer_path)


def build_parser() -> argparse.ArgumentParser:
    """Flags of the generator."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (any layout) or FILE.safetensors")
    p.add_argument("--iteration", type=int, help="use this iteration instead of the latest")
    p.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples (seeds seed, seed+1, ...)")
    p.add_argument("--tokenizer-name-or-path", help="tokenizer directory or hub name (default: from the checkpoint)")
    p.add_argument("--moe-expert-capacity-factor", type=float,
                   help="override the MoE capacity factor of the checkpoint (e.g. 4 for no dropped tokens)")
    p.add_argument("--no-stop-at-eod", action="store_true", help="keep going after an end-of-document token")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Print the prompt and each sample's continuation; errors go to stderr with status 2."""
    args = build_parser().parse_args(argv)
    try:
        temperature = 0.0 if args.greedy else args.temperature
        check_sampling(temperature, args.top_k, args.top_p)
        if args.max_new_tokens < 0 or args.num_samples < 1:
            raise ValueError("--max-new-tokens must be >= 0 and --num-samples >= 1")
        from megatron_moe.data.tokenizer import load_tokenizer
        model, cfg = load_model(args.load, args.iteration, args.moe_expert_capacity_factor)
        tok = load_tokenizer(tokenizer_path(cfg, args.tokenizer_name_or_path,
                                            carried_tokenizer(args.load, args.iteration)))
        prompt = tok.encode(args.prompt) if args.prompt else [tok.eod]
        eod = None if args.no_stop_at_eod else tok.eod
        for i in range(args.num_samples):
            new = generate(model, prompt, args.max_new_tokens, temperature, args.top_k, args.top_p,
                           args.seed + i, eod)
            if args.num_samples > 1:
                print(f"--- sample {i + 1} (seed {args.seed + i})")
            print(args.prompt + tok.decode(new), flush=True)
    except (ValueError, FileNotFoundError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
