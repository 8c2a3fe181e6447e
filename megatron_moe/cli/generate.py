"""Sample text from a checkpoint (any parallel layout) or a consolidated safetensors file.

Installed as `mmoe-generate` (= `python tools/generate.py`). Examples:

    python tools/generate.py --prompt "The history of"   # the default training run's checkpoint
    python tools/generate.py --load checkpoints/gpt2-moe --prompt "The history of" --greedy
    python tools/generate.py --load model.safetensors --prompt "In 1996" --temperature 0.8 \\
        --top-k 50 --top-p 0.95 --max-new-tokens 64 --seed 7 --num-samples 3
    torchrun --nproc-per-node 4 tools/generate.py --load checkpoints/gpt2-moe --greedy \\
        --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --prompts-file prompts.txt

Runs on `megatron_moe.inference` (batched, KV cache, dropless). Under torchrun the ranks load their
slices of a checkpoint of any layout; request i (seed --seed + sample) goes to DP rank i % DP, and rank
0 prints every result in request order.
`--lina-inference PROFILE` schedules experts by Lina's popularity estimation (same output);
`--moe-expert-capacity-factor` generates on one process with the training router's capacity.
The tokenizer is --tokenizer-name-or-path, else the checkpoint's (ITER_DIR/tokenizer), else the
one recorded in its config, else the one beside its training data.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from megatron_moe.arguments import HelpFormatter
from megatron_moe.config import DEFAULT_SAVE
from megatron_moe.fileio import read_lines
from megatron_moe.generation import carried_tokenizer, check_sampling, generate, load_model, tokenizer_path
from megatron_moe.inference.engine import load_engine, serve
from megatron_moe.inference.fallback import use_lina
from megatron_moe.parallel_state import initialize_model_parallel, local_state, resolve_device, shutdown


def build_parser() -> argparse.ArgumentParser:
    """Flags of the generator."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument(
        "--load",
        default=DEFAULT_SAVE,
        help="checkpoint directory (any layout) or FILE.safetensors (default: ./checkpoints/gpt2-moe-tiny, "
        "where the trainer's default run saves)",
    )
    p.add_argument("--iteration", type=int, help="use this iteration instead of the latest")
    p.add_argument(
        "--prompt", action="append", help="text to continue (repeat for a batch; empty: start a new document)"
    )
    p.add_argument("--prompts-file", help="a file of prompts, one per line (added after the --prompt ones)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples (seeds seed, seed+1, ...)")
    p.add_argument("--tokenizer-name-or-path", help="tokenizer directory or hub name (default: from the checkpoint)")
    p.add_argument(
        "--moe-expert-capacity-factor",
        type=float,
        help="one-process generation with the training router's capacity (tokens may be dropped) "
        "instead of the dropless engine",
    )
    p.add_argument("--no-stop-at-eod", action="store_true", help="keep going after an end-of-document token")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model and its KV cache live: cuda (this rank's GPU, LOCAL_RANK; NCCL under torchrun), "
        "cpu, or auto (cuda when available)",
    )
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="MP degree (under torchrun)")
    p.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP degree (under torchrun)")
    p.add_argument("--expert-sharding-parallel-size", type=int, default=1, help="ESP degree (under torchrun)")
    p.add_argument(
        "--lina-inference",
        metavar="PROFILE",
        help="Lina's two-phase expert scheduling from this profile (tools/profile_expert_paths.py)",
    )
    p.add_argument(
        "--max-experts-per-rank",
        type=int,
        default=4,
        help="with --lina-inference: unpopular experts packed onto one rank at most",
    )
    p.add_argument(
        "--lina-probe-forwards",
        type=int,
        default=4,
        help="with --lina-inference: forwards run both ways at the start; the scheduling is kept only if faster",
    )
    return p


def _prompts(args) -> list[str]:
    """Every prompt's text, read before loading (empty: start from the end-of-document token)."""
    texts = list(args.prompt or [])
    if args.prompts_file:
        if not os.path.isfile(args.prompts_file):
            raise FileNotFoundError(f"--prompts-file {args.prompts_file} does not exist")
        texts += [ln.rstrip("\n") for ln in read_lines(args.prompts_file) if ln.strip()]
        if not texts:
            raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt")
    if args.prompt is None and not args.prompts_file:
        texts = [""]
    return texts


def main(argv: Optional[list[str]] = None) -> int:
    """Print the prompt and each sample's continuation; errors go to stderr with status 2."""
    args = build_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        temperature = 0.0 if args.greedy else args.temperature
        check_sampling(temperature, args.top_k, args.top_p)
        if args.max_new_tokens < 0 or args.num_samples < 1:
            raise ValueError("--max-new-tokens must be >= 0 and --num-samples >= 1")
        if args.moe_expert_capacity_factor is not None and (world > 1 or args.lina_inference):
            raise ValueError(
                "--moe-expert-capacity-factor is the one-process capacity path: not under torchrun "
                "and not with --lina-inference"
            )
        if args.load == DEFAULT_SAVE and not os.path.exists(DEFAULT_SAVE):
            raise FileNotFoundError(
                f"no --load given and no {DEFAULT_SAVE} in {os.getcwd()} (where the trainer's default run saves): "
                "run mmoe-pretrain here first, or pass --load DIR"
            )
        texts = _prompts(args)
        device = resolve_device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        sizes = (args.tensor_model_parallel_size, args.expert_model_parallel_size, args.expert_sharding_parallel_size)
        ps = initialize_model_parallel(*sizes, device=device) if world > 1 else local_state(device)
        engine, cap_model = None, None
        if args.moe_expert_capacity_factor is None:
            engine = load_engine(args.load, ps, args.iteration)
            cfg = engine.cfg
        else:
            cap_model, cfg = load_model(args.load, args.iteration, args.moe_expert_capacity_factor)
            cap_model = cap_model.to(device)
        from megatron_moe.data.tokenizer import load_tokenizer

        tok = load_tokenizer(
            tokenizer_path(cfg, args.tokenizer_name_or_path, carried_tokenizer(args.load, args.iteration))
        )
        prompts = [(t, tok.encode(t) if t else [tok.eod]) for t in texts]
        requests = [(ids, args.seed + s) for _, ids in prompts for s in range(args.num_samples)]
        eod = None if args.no_stop_at_eod else tok.eod
        if engine is None:  # the training router's capacity, one process, full recomputation
            new = [
                generate(cap_model, ids, args.max_new_tokens, temperature, args.top_k, args.top_p, seed, eod)
                for ids, seed in requests
            ]
        else:
            if args.lina_inference:
                use_lina(engine, args.lina_inference, args.max_experts_per_rank, args.lina_probe_forwards)
            ids, seeds = [r[0] for r in requests], [r[1] for r in requests]
            new = serve(engine, ids, args.max_new_tokens, temperature, args.top_k, args.top_p, seeds, eod)
        if rank == 0:
            for i, ((text, _), s) in enumerate((p, s) for p in prompts for s in range(args.num_samples)):
                if args.num_samples > 1:
                    print(f"--- sample {s + 1} (seed {args.seed + s})")
                print(text + tok.decode(new[i]), flush=True)
    except (ValueError, FileNotFoundError) as e:
        if rank == 0:
            print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        if world > 1 and dist.is_initialized():
            shutdown()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
