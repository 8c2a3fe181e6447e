"""Generation tokens/s: our KV-cache engine against `transformers`' `generate` on the same weights.

  python tools/bench_generate.py --device cuda --num-layers 12 --hidden-size 768 --num-attention-heads 12 \\
      --seq-length 1024 --vocab-size 50304 --batch-size 8 --prompt-len 128 --max-new-tokens 128 --json out.json

A dense GPT-2 of the trainer's model flags (one process, random weights with the trainer's init)
is copied into a `GPT2LMHeadModel` exactly as `mmoe-convert export-hf` writes it
(`model.hf_import.hf_state_from_full`); both generate greedily from the same random prompts, with
their KV caches on --device (`inference.InferenceEngine` / `generate(use_cache=True)`), --bf16 under
autocast. Each side is timed over --rounds rounds after one warm-up (host clock, after a device
synchronize: generation reads every token on the host anyway); tokens/s counts the new tokens of the
whole batch. `agree` is the fraction of new tokens equal between the two (greedy on equal weights;
ties and bf16 round-off may differ). Prints a table; --json writes {config, rows, agree}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_moe.arguments import add_config_flags, config_from_args
from megatron_moe.config import Config
from megatron_moe.convert.formats import hf_config_of
from megatron_moe.inference.engine import InferenceEngine
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.model.hf_import import hf_state_from_full
from megatron_moe.fileio import atomic_write_json
from megatron_moe.parallel_state import local_state, resolve_device


def defaults() -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 4, 256, 8, 512, 8192
    cfg.moe.num_experts = 0
    return cfg


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p, ("model", "parallel"), defaults())
    a = p.add_argument
    a("--batch-size", type=int, default=4)
    a("--prompt-len", type=int, default=32)
    a("--max-new-tokens", type=int, default=32)
    a("--rounds", type=int, default=3)
    a("--bf16", action="store_true", help="both sides under bf16 autocast")
    a("--json", default=None)
    args = p.parse_args(argv)
    try:
        args.cfg = config_from_args(args)
    except ValueError as e:
        p.error(str(e))
    args.cfg.moe.num_experts = 0  # dense: the model GPT2LMHeadModel holds
    m = args.cfg.model
    if args.batch_size < 1 or args.prompt_len < 1 or args.max_new_tokens < 1 or args.rounds < 1:
        p.error("--batch-size, --prompt-len, --max-new-tokens and --rounds must be >= 1")
    if args.prompt_len + args.max_new_tokens > (m.max_position_embeddings or m.seq_length):
        p.error("--prompt-len + --max-new-tokens exceed --max-position-embeddings")
    try:
        args.device = resolve_device(args.cfg.parallel.device)
    except ValueError as e:
        p.error(str(e))
    return args


def timed(fn, device: torch.device, rounds: int) -> tuple[float, list]:
    """(median seconds over `rounds` after a warm-up, the last result)."""
    out = fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv=None) -> dict:
    from transformers import GPT2LMHeadModel

    args = parse_args(argv)
    cfg, device, B, P, N = args.cfg, args.device, args.batch_size, args.prompt_len, args.max_new_tokens
    torch.manual_seed(cfg.train.seed)
    ours = GPT2MoE(cfg, local_state(device)).to(device).eval()
    full = {k: v.detach().cpu() for k, v in ours.state_dict().items()}
    hf = GPT2LMHeadModel(hf_config_of(cfg))
    hf.load_state_dict(hf_state_from_full(full, cfg), strict=False)
    hf = hf.to(device).eval()
    g = torch.Generator(device="cpu").manual_seed(1)
    prompts = torch.randint(0, cfg.model.vocab_size, (B, P), generator=g)
    engine = InferenceEngine(ours)

    def run_ours():
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            return [o.tokens for o in engine.generate(prompts.tolist(), N)]

    ids = prompts.to(device)
    mask = torch.ones_like(ids)

    def run_hf():
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=N,
                min_new_tokens=N,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        return out[:, P:].tolist()

    rows, results = [], {}
    for name, fn in (("ours", run_ours), ("transformers", run_hf)):
        sec, results[name] = timed(fn, device, args.rounds)
        rows.append({"variant": name, "s_median": sec, "tokens_per_s": B * N / sec})
    same = sum(a == b for x, y in zip(results["ours"], results["transformers"]) for a, b in zip(x, y))
    total = sum(len(x) for x in results["ours"])
    out = {
        "config": f"{cfg.model.num_layers} layers M={cfg.model.hidden_size} vocab {cfg.model.vocab_size}, batch {B}, "
        f"prompt {P}, {N} new tokens, greedy, {'bf16 autocast' if args.bf16 else 'fp32'}, {device}",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "rows": rows,
        "agree": same / total if total else 0.0,
    }
    print(f"generation: {out['config']} on {out['device']}")
    for r in rows:
        print(f"  {r['variant']:<13}{r['s_median'] * 1e3:>10.1f} ms{r['tokens_per_s']:>12.1f} tokens/s")
    print(f"  greedy tokens equal: {out['agree']:.1%}")
    if args.json:
        atomic_write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
