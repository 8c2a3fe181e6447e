"""One training step of a GPT-2 (dense or MoE) on one device: ms, tokens/s, TFLOP/s and host syncs.

  python tools/bench_train_step.py --device cuda --bf16 --num-layers 12 --hidden-size 768 \\
      --num-attention-heads 12 --seq-length 1024 --micro-batch-size 8 --vocab-size 50304 \\
      --num-experts 8 --moe-router-topk 2 --json out.json

The flags are the trainer's (model, MoE, optimizer, training); the model is the trainer's
(`GPT2MoE`, one process), the optimizer its AdamW (`optim.build_optimizer`: fused on CUDA), the
input random token ids (no data pipeline, no tokenizer: the vocabulary is --vocab-size). A step is
forward, backward and optimizer step under --bf16 autocast; it is timed with CUDA events on CUDA
(the device's time, not the host's enqueue) and with the host clock on CPU, --iters steps after
--warmup. TFLOP/s uses the trainer's own count (`training.model_flops_per_token`: 6 x active
parameters + attention), as its log lines do. `host_syncs_per_step` counts, on CUDA, the
synchronizing calls one step makes (`torch.cuda.set_sync_debug_mode("warn")`, one warning each);
on CPU it is the `opspy.OpSpy` count of the same calls by name. --num-experts 0: the dense model.
Prints a table; --json writes {config, ms_median, ms_p90, tokens_per_s, tflops, host_syncs_per_step,
moe_layer_syncs, device}.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from megatron_moe.arguments import add_config_flags, config_from_args
from megatron_moe.config import Config
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.opspy import OpSpy
from megatron_moe.optim import build_optimizer
from megatron_moe.fileio import atomic_write_json
from megatron_moe.parallel_state import local_state, resolve_device
from megatron_moe.training import model_flops_per_token


def defaults() -> Config:
    """GPT-2 124M with every second block MoE (E=8, top-2, capacity 1.25), batch 8 x 1024."""
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 12, 768, 12, 1024
    m.max_position_embeddings, m.vocab_size = 1024, 50304
    moe.num_experts, moe.moe_router_topk, moe.moe_expert_capacity_factor = 8, 2, 1.25
    cfg.train.micro_batch_size = 8
    cfg.optim.bf16 = True
    return cfg


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p, ("model", "moe", "optim", "parallel", "train"), defaults())
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    try:
        args.cfg = config_from_args(args)
    except ValueError as e:
        p.error(str(e))
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    try:
        args.device = resolve_device(args.cfg.parallel.device)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg, device = args.cfg, args.device
    torch.manual_seed(cfg.train.seed)
    model = GPT2MoE(cfg, local_state(device)).to(device)
    opt, opt_name = build_optimizer(model, cfg.optim, device)
    B, T = cfg.train.micro_batch_size, cfg.model.seq_length
    g = torch.Generator(device="cpu").manual_seed(cfg.train.seed)
    ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g).to(device)
    cuda = device.type == "cuda"

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.optim.bf16):
            lm, aux = model(ids[:, :-1], ids[:, 1:])
        (lm + aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    syncs, moe_syncs = count_syncs(step, cuda)
    ms = []
    for _ in range(args.iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            ms.append(1e3 * (time.perf_counter() - t0))
    ms.sort()
    med = statistics.median(ms)
    tokens = B * T
    out = {
        "config": describe(cfg, opt_name),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "ms_median": med,
        "ms_p90": ms[max(0, -(-9 * len(ms) // 10) - 1)],
        "tokens_per_s": tokens / (med / 1e3),
        "tflops": model_flops_per_token(cfg) * tokens / (med / 1e3) / 1e12,
        "host_syncs_per_step": syncs,
        "moe_layer_syncs": moe_syncs,
    }
    print(f"train step: {out['config']} on {out['device']}")
    print(f"{'median ms':>10}{'p90 ms':>9}{'tokens/s':>11}{'TFLOP/s':>9}{'syncs/step':>12}{'in MoE':>8}")
    print(
        f"{med:>10.2f}{out['ms_p90']:>9.2f}{out['tokens_per_s']:>11.0f}{out['tflops']:>9.1f}"
        f"{syncs:>12}{'' if moe_syncs is None else moe_syncs:>8}"
    )
    if args.json:
        atomic_write_json(args.json, out)
    return out


def count_syncs(step, cuda: bool) -> tuple[int, int | None]:
    """(host syncs of one step, those made inside the MoE layers or None where not attributable): on CUDA
    the driver-level count (sync debug mode), beside the spy's count by name in the MoE layers."""
    spy = OpSpy()
    if not cuda:
        with spy:
            step()
        return len(spy.syncs), len(spy.syncs_in("megatron_moe/moe/"))
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught, spy:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught), len(spy.syncs_in("megatron_moe/moe/"))


def describe(cfg: Config, opt_name: str) -> str:
    m, moe, t = cfg.model, cfg.moe, cfg.train
    kind = (
        "dense"
        if moe.num_experts == 0
        else (
            f"MoE E={moe.num_experts} top-{moe.moe_router_topk} "
            + ("dropless" if moe.moe_dropless else f"cf {moe.moe_expert_capacity_factor}")
            + f", every {moe.moe_layer_freq} block(s)"
        )
    )
    return (
        f"{m.num_layers} layers M={m.hidden_size} heads={m.num_attention_heads} T={m.seq_length} "
        f"vocab={m.vocab_size} batch {t.micro_batch_size}, {kind}, "
        f"{'bf16 autocast' if cfg.optim.bf16 else 'fp32'}, {opt_name}"
    )


if __name__ == "__main__":
    main()
