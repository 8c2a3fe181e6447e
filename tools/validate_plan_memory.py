"""Check the planner's memory model (`planner.memory.memory`) against the trainer's own CPU runs.

  python tools/validate_plan_memory.py [--runs one-process,EP2,...] [--json out.json]

Each run builds the trainer's model, optimizer and gradient sync (`GPT2MoE`, `optim.build_optimizer`,
`GradSync`) on gloo ranks of one layout and runs two iterations of `Trainer.train_step` (forward,
backward, gradient sync, clipping, optimizer step) on random token ids, all inside
`torch.profiler.profile(profile_memory=True)`. The measured peak of a rank is the maximum of the
running sum of the profiler's allocation events in time order: every byte torch's allocator handed
out from an empty state, so parameters, gradients, the optimizer state of the first step, the
activations, the gradient buckets and every temporary. The prediction is `memory(cfg, candidate,
load)` with the load the planner uses (the capacity factor, or dropless the most loaded rank's
share measured in the run). Prints per run the predicted terms, total, the measured peak of the
most loaded rank and the error; --json writes the same (atomically). Exit status 1 when a run is
off by more than --tolerance.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import types
from dataclasses import dataclass, field

import torch

from megatron_moe.arguments import validate
from megatron_moe.config import Config
from megatron_moe.fileio import atomic_write_json
from megatron_moe.planner.memory import memory
from megatron_moe.planner.predict import Candidate

MiB = 2**20


@dataclass(frozen=True)
class Run:
    world: int
    mp: int = 1
    ep: int = 1
    esp: int = 1
    bf16: bool = False
    optimizer: str = "adamw"
    moe: dict = field(default_factory=dict)


RUNS: dict[str, Run] = {
    "one-process": Run(1),
    "one-process-bf16": Run(1, bf16=True),
    "one-process-sgd": Run(1, optimizer="sgd"),
    "DP2": Run(2),
    "EP2": Run(2, ep=2),
    "MP2": Run(2, mp=2),
    "ESP2": Run(2, esp=2),
    "EP2-dropless": Run(2, ep=2, moe={"moe_dropless": True}),
    "EP2-bf16-sgd": Run(2, ep=2, bf16=True, optimizer="sgd"),
    "MP2xEP2": Run(4, mp=2, ep=2),
    "EP4": Run(4, ep=4),
}


def model_config(run: Run, layers: int = 4, hidden: int = 256, seq: int = 256, micro: int = 4) -> Config:
    """A GPT-2 MoE big enough that the modelled parts dominate: `layers` blocks (every second MoE,
    8 experts, top-2, capacity 1.25), `hidden` wide, 4 heads, sequence `seq`, vocab 2048."""
    cfg = Config()
    m, moe, p = cfg.model, cfg.moe, cfg.parallel
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = layers, hidden, 4, 4 * hidden
    m.seq_length = m.max_position_embeddings = seq
    m.vocab_size = 2048
    moe.num_experts, moe.moe_router_topk, moe.moe_expert_capacity_factor = 8, 2, 1.25
    moe.moe_schedule = "baseline"
    for k, v in run.moe.items():
        setattr(moe, k, v)
    p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size = (
        run.mp,
        run.ep,
        run.esp,
    )
    p.device = "cpu"
    cfg.optim.bf16, cfg.optim.optimizer = run.bf16, run.optimizer
    cfg.train.micro_batch_size = micro
    cfg.train.global_batch_size = micro * run.world // run.mp
    cfg.train.seed = 1
    validate(cfg, run.world)
    return cfg


def peak_of(prof) -> tuple[int, int]:
    """(peak, final) of the running sum of the profiler's CPU allocation events (+ allocated, - freed)
    in time order."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    total = peak = 0
    for _, delta in sorted(events):
        total += delta
        peak = max(peak, total)
    return peak, total


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, bf16: bool = False) -> int:
    """Bytes one forward's graph keeps for backward: the distinct storages autograd saves
    (`saved_tensors_hooks`) and the tensors custom Functions keep on their ctx (the grouped experts'
    `Saved`), parameters excluded (their bf16 casts under `bf16` are included)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        add(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            lm, aux = model(ids, labels)
    todo, done = [(lm + aux).grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in done:
            continue
        done.add(node)
        for v in getattr(node, "__dict__", {}).values():  # a custom Function's ctx attributes
            for x in v if isinstance(v, tuple) else (v,):
                if isinstance(x, torch.Tensor):
                    add(x)
        todo.extend(f for f, _ in node.next_functions)
    return sum(seen.values())


def _measure(rank: int, world: int, run: Run, shape: dict, iters: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from megatron_moe.distributed.grad_sync import GradSync
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.optim import build_optimizer
    from megatron_moe.parallel_state import initialize_model_parallel, local_state
    from megatron_moe.training import Trainer

    cfg = model_config(run, **shape)
    device = torch.device("cpu")
    ps = initialize_model_parallel(run.mp, run.ep, run.esp, device=device) if world > 1 else local_state(device)
    torch.manual_seed(cfg.train.seed + ps.rank("dp"))
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    batches = [[{"tokens": torch.randint(0, cfg.model.vocab_size, (b, s + 1))}] for _ in range(iters)]
    gc.collect()
    shares = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tr = Trainer.__new__(Trainer)  # the trainer's step on the trainer's parts, without data or logging
        tr.cfg, tr.ps, tr.device, tr.iteration, tr.lancet = cfg, ps, device, 0, None
        tr.applied = types.SimpleNamespace(pro_prophet=None)
        tr.model = GPT2MoE(cfg, ps, device=device)
        tr.optimizer, _ = build_optimizer(tr.model, cfg.optim, device)
        tr.grad_sync = GradSync(tr.model, ps)
        for batch in batches:
            tr.train_step(batch)
            tr.iteration += 1
            shares.append(_expert_share(tr.model, ps))
    peak, final = peak_of(prof)
    return {"rank": rank, "peak": peak, "final": final, "share": max(shares)}


def _expert_share(model, ps) -> float:
    """The rows this rank's experts computed in the last forward over the mean rows per rank (the
    dropless load the planner's `rank_load` predicts; 1 for capacity buffers)."""
    shares = []
    for layer in model.moe_layers():
        kept, n = layer.router.device_stats  # kept tokens per expert of this rank's routing group(s)
        counts = kept.float().clone()
        if ps.size("ep") * ps.size("esp") > 1:
            torch.distributed.all_reduce(counts, group=ps.group("world"))
            counts /= ps.size("mp")  # every MP rank of a group routes the same tokens
        ep = ps.size("ep")
        per_rank = counts.view(ep, -1).sum(1)
        shares.append(float(per_rank.max() / per_rank.mean()))
    return max(shares) if shares else 1.0


def measure(run: Run, shape: dict, iters: int = 2) -> list[dict]:
    """The profiled peak of every rank of `run`."""
    if run.world == 1:
        return [_measure(0, 1, run, shape, iters)]
    from megatron_moe.testing import spawn

    return spawn(_measure, run.world, run, shape, iters, timeout=600)


def predict(run: Run, shape: dict, share: float) -> dict:
    cfg = model_config(run, **shape)
    c = Candidate(run.mp, run.ep, run.esp, run.world // run.mp)
    load = share if cfg.moe.moe_dropless else max(cfg.moe.moe_expert_capacity_factor, 1.0)
    return memory(cfg, c, load)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    shape = {"layers": args.layers, "hidden": args.hidden, "seq": args.seq, "micro": args.micro}
    terms = ("parameters", "gradients", "optimizer", "grad_buckets", "bf16_weights", "activations", "workspace")
    heads = ("params", "grads", "optim", "bucket", "bf16", "act", "work")
    print(f"{'run':<18}" + "".join(f"{h:>8}" for h in heads) + f"{'pred':>9}{'meas':>9}{'err %':>8}  (MiB per rank)")
    rows, worst = [], 0.0
    for name in args.runs.split(","):
        run = RUNS[name]
        ranks = measure(run, shape)
        top = max(ranks, key=lambda r: r["peak"])
        share = max(r["share"] for r in ranks)
        pred = predict(run, shape, share)
        err = pred["total"] / top["peak"] - 1
        worst = max(worst, abs(err))
        print(
            f"{name:<18}"
            + "".join(f"{pred[t] / MiB:>8.1f}" for t in terms)
            + f"{pred['total'] / MiB:>9.1f}{top['peak'] / MiB:>9.1f}{100 * err:>+8.1f}",
            flush=True,
        )
        rows.append(
            {
                "run": name,
                "layout": {"world": run.world, "mp": run.mp, "ep": run.ep, "esp": run.esp},
                "bf16": run.bf16,
                "optimizer": run.optimizer,
                "moe": run.moe,
                "load": share if run.moe.get("moe_dropless") else None,
                "predicted_bytes": pred,
                "measured_peak_bytes": [r["peak"] for r in ranks],
                "error": err,
            }
        )
    ok = worst <= args.tolerance
    print(f"worst error {100 * worst:.1f} % ({'within' if ok else 'above'} {100 * args.tolerance:g} %)")
    if args.json:
        atomic_write_json(args.json, {"shape": shape, "tolerance": args.tolerance, "runs": rows, "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
