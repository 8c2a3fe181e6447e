"""Quality benchmarks: our GPT-2 against transformers, and MoE against dense on WikiText-2.

  python tools/bench_quality.py reference --steps 20 --json ref.json
  OMP_NUM_THREADS=1 python tools/bench_quality.py moe-vs-dense --seeds 1,2 --json moe_vs_dense.json

reference     a dense GPT-2 (--num-experts 0) built and trained by our Trainer, and a
              `transformers.GPT2LMHeadModel` with the same config and the same initial weights
              (our model exported through `megatron_moe.convert.export_hf`, loaded back with
              `from_pretrained`), trained on the same batches of the same indexed dataset (the
              bundled sample corpus) with the same AdamW (same weight-decay groups: matrices
              except the position table), the same LR schedule (`lr_at`) and the same global-norm
              clipping, dropout 0, fp32. Our side runs `Trainer.train()`; the HF side is the small
              explicit loop below. Prints both loss curves and the largest difference; --json
              writes {"steps", "max_abs_diff", "ours", "transformers"}.

moe-vs-dense  WikiText-2's validation split as the training data and its test split as the
              evaluation data (from --wikitext-dir, default ../shared/wikitext-2 beside the
              repository; the tool stops with a clear reason when it is absent), a byte-level BPE
              trained on the training split (megatron_moe.data.preprocess). Every model has the
              same active parameters per token and sees the same tokens: every block is an MoE
              block (--moe-layer-freq 1) so that halving the FFN only touches experts:
                dense         4 blocks, FFN H = 4M
                top1-e4/e8    top-1 routing over 4 / 8 experts of H = 4M
                top2-e8-half  top-2 routing over 8 experts of H = 2M
                *-dropless    the same with --moe-dropless (no capacity, nothing dropped; not in the default --models)
              Each (model, seed) is one Trainer run (with --log-json under --work-dir, which
              tools/plot_run.py draws). --json writes a list of objects with keys model, seed,
              tokens, valid_ppl, tokens_per_s, dropped_fraction, load_imbalance_final,
              params_total, params_active.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from megatron_moe.fileio import atomic_write_json
from megatron_moe.arguments import parse_args as parse_train_args
from megatron_moe.optim import lr_at

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_WIKITEXT = os.path.join(ROOT, "..", "shared", "wikitext-2")
DEFAULT_WORK_DIR = os.path.join(ROOT, "runs", "bench_quality")


class BenchError(Exception):
    """Bad input (a flag or a file): printed as `error: ...`, exit status 2."""


# ============================================================================ reference
def reference_flags(args, data_prefix: str) -> list[str]:
    """Trainer flags of the reference run: dense, dropout 0, fp32, AdamW, warmup + cosine, clipping."""
    return [
        "--data-path",
        data_prefix,
        "--num-experts",
        "0",
        "--num-layers",
        str(args.num_layers),
        "--hidden-size",
        str(args.hidden_size),
        "--num-attention-heads",
        str(args.num_attention_heads),
        "--seq-length",
        str(args.seq_length),
        "--make-vocab-size-divisible-by",
        str(args.vocab_divisor),
        "--hidden-dropout",
        "0",
        "--no-bf16",
        "--optimizer",
        "adamw",
        "--lr",
        str(args.lr),
        "--min-lr",
        str(args.lr / 10),
        "--lr-warmup-iters",
        str(max(1, args.steps // 4)),
        "--lr-decay-style",
        "cosine",
        "--weight-decay",
        str(args.weight_decay),
        "--clip-grad",
        str(args.clip_grad),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--global-batch-size",
        str(args.global_batch_size),
        "--train-iters",
        str(args.steps),
        "--eval-interval",
        "0",
        "--eval-iters",
        "0",
        "--log-interval",
        str(10**9),
        "--seed",
        str(args.seed),
    ]


def hf_twin(trainer, work_dir: str):
    """A GPT2LMHeadModel (train mode, fp32) with the trainer model's current weights, made by our
    HF export (`export_hf`) and loaded back with `from_pretrained`."""
    from megatron_moe.convert import FullCheckpoint, export_hf, load_hf_model, structure_specs

    full = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}  # one process: full shapes
    ckpt = FullCheckpoint(trainer.cfg, full, structure_specs(trainer.cfg))
    out = os.path.join(work_dir, "hf_initial")
    if os.path.exists(out):
        shutil.rmtree(out)
    export_hf(ckpt, out)
    return load_hf_model(out).float().train()


def hf_optimizer(model, optim_cfg) -> torch.optim.AdamW:
    """AdamW with our weight-decay groups: matrices decay, except the position table; biases and
    LayerNorms do not (megatron_moe.optim.param_groups, in HF names). lm_head is tied to wte."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and name != "transformer.wpe.weight" else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim_cfg.lr,
        betas=(optim_cfg.adam_beta1, optim_cfg.adam_beta2),
        eps=optim_cfg.adam_eps,
    )


def hf_train(model, loader, num_micro: int, optim_cfg, steps: int) -> list[float]:
    """The HF side: per step, set the LR from our schedule, accumulate the mean LM loss of
    `num_micro` micro-batches, clip the global norm (fp64 norm, as ours), AdamW step."""
    opt = hf_optimizer(model, optim_cfg)
    params = [p for p in model.parameters()]
    it, losses = iter(loader), []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, optim_cfg)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(num_micro):
            tokens = next(it)["tokens"]
            ids, labels = tokens[:, :-1], tokens[:, 1:]
            logits = model(input_ids=ids).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))
            (loss / num_micro).backward()
            total += loss.item()
        norm = float(torch.stack([p.grad.double().pow(2).sum() for p in params if p.grad is not None]).sum().sqrt())
        if optim_cfg.clip_grad > 0 and norm > optim_cfg.clip_grad:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(optim_cfg.clip_grad / (norm + 1e-6))
        opt.step()
        losses.append(total / num_micro)
    return losses


def run_reference(args) -> dict:
    """Both curves on the bundled sample corpus; returns the --json object."""
    from megatron_moe.data.preprocess import prepare_sample_data
    from megatron_moe.training import Trainer, build_loaders

    os.makedirs(args.work_dir, exist_ok=True)
    prefix = os.path.join(args.work_dir, "sample")
    prepare_sample_data(prefix)
    torch.manual_seed(args.seed)
    trainer = Trainer(parse_train_args(reference_flags(args, prefix)))
    hf = hf_twin(trainer, args.work_dir)  # before training: the same initial weights
    # the same loader function over the same files and seed: the same batches in the same order
    hf_loader, _, _ = build_loaders(trainer.cfg, trainer.ps, 0)
    ours = [h["loss"] for h in trainer.train()]
    theirs = hf_train(hf, hf_loader, trainer.num_micro, trainer.cfg.optim, args.steps)
    diffs = [abs(a - b) for a, b in zip(ours, theirs)]
    return {"steps": args.steps, "max_abs_diff": max(diffs), "ours": ours, "transformers": theirs}


def print_reference(res: dict) -> None:
    print(f"{'step':>5} {'ours':>12} {'transformers':>13} {'|diff|':>10}")
    for i, (a, b) in enumerate(zip(res["ours"], res["transformers"]), 1):
        print(f"{i:5d} {a:12.6f} {b:13.6f} {abs(a - b):10.2e}")
    print(f"max |diff| over {res['steps']} steps: {res['max_abs_diff']:.3e}")


# ============================================================================ moe vs dense
MODELS = {  # name -> (num_experts, top-k, FFN multiple of M, dropless); every block MoE when experts > 0
    "dense": (0, 1, 4, False),
    "top1-e4": (4, 1, 4, False),
    "top1-e8": (8, 1, 4, False),
    "top2-e8-half": (8, 2, 2, False),
    "top1-e4-dropless": (4, 1, 4, True),  # --moe-dropless: no capacity, nothing dropped
    "top2-e8-half-dropless": (8, 2, 2, True),
}
DEFAULT_MODELS = ("dense", "top1-e4", "top1-e8", "top2-e8-half")


def prepare_wikitext(wikitext_dir: str, work_dir: str, vocab_size: int) -> str:
    """Preprocess WikiText-2 valid (-> our train split) and test (-> our valid and test splits)
    with a BPE trained on the training split, once per vocab size; returns the data prefix.
    The text is read through symlinks in a scratch directory, never copied."""
    from megatron_moe.data.preprocess import output_prefix_for, preprocess

    src = {"train": "wiki.valid.tokens", "valid": "wiki.test.tokens", "test": "wiki.test.tokens"}
    missing = [f for f in set(src.values()) if not os.path.isfile(os.path.join(wikitext_dir, f))]
    if missing:
        raise BenchError(
            f"--wikitext-dir {wikitext_dir}: {', '.join(sorted(missing))} not found (the real "
            f"WikiText-2 validation and test files; skipping moe-vs-dense)"
        )
    prefix = os.path.join(work_dir, f"wikitext2_v{vocab_size}", "wt2")
    if all(os.path.isfile(output_prefix_for(prefix, s) + ".idx") for s in src) and os.path.isdir(prefix + "_tokenizer"):
        return prefix
    os.makedirs(work_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work_dir) as links:
        for ours, theirs in src.items():
            os.symlink(os.path.abspath(os.path.join(wikitext_dir, theirs)), os.path.join(links, f"wiki.{ours}.tokens"))
        preprocess(
            prefix, input_path=links, train_tokenizer=True, vocab_size=vocab_size, append_eod=True, progress=False
        )
    return prefix


def model_flags(args, name: str, seed: int, data_prefix: str, log_json: str) -> list[str]:
    """Trainer flags of one (model, seed) run; all models share everything but the MoE settings."""
    experts, topk, ffn_mult, dropless = MODELS[name]
    return [
        *(["--moe-dropless"] if dropless else []),
        "--data-path",
        data_prefix,
        "--num-layers",
        str(args.num_layers),
        "--hidden-size",
        str(args.hidden_size),
        "--num-attention-heads",
        str(args.num_attention_heads),
        "--seq-length",
        str(args.seq_length),
        "--ffn-hidden-size",
        str(ffn_mult * args.hidden_size),
        "--num-experts",
        str(experts),
        "--moe-layer-freq",
        "1",
        "--moe-router-topk",
        str(topk),
        "--moe-expert-capacity-factor",
        str(args.capacity_factor),
        "--moe-min-capacity",
        "4",
        "--moe-schedule",
        "baseline",
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--global-batch-size",
        str(args.micro_batch_size),
        "--train-iters",
        str(args.train_iters),
        "--lr",
        str(args.lr),
        "--min-lr",
        str(args.lr / 10),
        "--lr-warmup-iters",
        str(max(1, args.train_iters // 20)),
        "--hidden-dropout",
        "0",
        "--eval-interval",
        str(args.train_iters),  # valid and test once, at the end
        "--eval-iters",
        str(args.eval_iters),
        "--log-interval",
        str(args.log_interval),
        "--log-json",
        log_json,
        "--seed",
        str(seed),
    ]


def final_imbalance(history: list[dict], last: int = 10) -> float:
    """Mean over the last `last` iterations of the per-layer max/mean expert load, averaged over layers."""
    vals = []
    for rec in history[-last:]:
        per_layer = [max(c) / (sum(c) / len(c)) for c in rec.get("expert_counts", {}).values() if sum(c) > 0]
        if per_layer:
            vals.append(sum(per_layer) / len(per_layer))
    return statistics.fmean(vals) if vals else 1.0


def run_one(args, name: str, seed: int, data_prefix: str) -> dict:
    """Train one model with one seed; the evaluation-split perplexity after the last step."""
    from megatron_moe.training import Trainer

    log_json = os.path.join(args.work_dir, "logs", f"{name}_seed{seed}.jsonl")
    os.makedirs(os.path.dirname(log_json), exist_ok=True)
    if os.path.exists(log_json):
        os.remove(log_json)  # the log is appended to: start it fresh
    cfg = parse_train_args(model_flags(args, name, seed, data_prefix, log_json))
    trainer = Trainer(cfg)
    t0 = time.perf_counter()
    history = trainer.train()
    wall = time.perf_counter() - t0
    with open(log_json) as f:
        evals = [r for r in map(json.loads, f) if r.get("split") == "valid"]
    m = cfg.model
    n_total = sum(p.numel() for p in trainer.model.parameters())
    experts, topk, _, _ = MODELS[name]
    expert_params = sum(p.numel() for n, p in trainer.model.named_parameters() if ".experts." in n)
    n_active = n_total - expert_params + (expert_params * topk // experts if experts else 0)
    tokens = len(history) * cfg.train.global_batch_size * m.seq_length
    train_s = sum(h["ms_per_iter"] for h in history) / 1e3
    return {
        "model": name,
        "seed": seed,
        "tokens": tokens,
        "valid_ppl": evals[-1]["ppl"],
        "valid_loss": evals[-1]["loss"],
        "train_loss_final": statistics.fmean(h["loss"] for h in history[-10:]),
        "tokens_per_s": tokens / train_s,
        "wall_s": wall,
        "dropped_fraction": statistics.fmean(h["dropped_frac"] for h in history),
        "load_imbalance_final": final_imbalance(history),
        "params_total": n_total,
        "params_active": n_active,
        "log_json": os.path.relpath(log_json, ROOT),
    }


def run_moe_vs_dense(args) -> list[dict]:
    """Every model for every seed (seed-major order, so a cut-short run still compares models);
    with --json the rows so far are rewritten after every run."""
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        raise BenchError(f"--models: unknown {bad or 'empty'}; choose from {', '.join(MODELS)}")
    prefix = prepare_wikitext(args.wikitext_dir, args.work_dir, args.vocab_size)
    rows = []
    for seed in seeds:
        for name in models:
            rows.append(run_one(args, name, seed, prefix))
            r = rows[-1]
            if args.json:
                atomic_write_json(args.json, rows, sort_keys=False)
            print(f"> {name} seed {seed}: valid ppl {r['valid_ppl']:.2f}, {r['tokens_per_s']:.0f} tokens/s", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'model':<14} {'seed':>4} {'tokens':>9} {'valid ppl':>10} {'tokens/s':>9} {'dropped':>8} "
        f"{'imbalance':>9} {'active params':>13}"
    )
    for r in rows:
        print(
            f"{r['model']:<14} {r['seed']:4d} {r['tokens']:9d} {r['valid_ppl']:10.2f} {r['tokens_per_s']:9.0f} "
            f"{100 * r['dropped_fraction']:7.2f}% {r['load_imbalance_final']:9.2f} {r['params_active']:13d}"
        )
    by_model: dict[str, list[float]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r["valid_ppl"])
    if len(rows) > len(by_model):
        print("mean over seeds: " + ", ".join(f"{m} {statistics.fmean(v):.2f}" for m, v in by_model.items()))


# ============================================================================ command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="mode", required=True)
    ref = sub.add_parser("reference", help="our dense GPT-2 vs transformers.GPT2LMHeadModel, step by step")
    ref.add_argument("--steps", type=int, default=20)
    ref.add_argument("--num-layers", type=int, default=2)
    ref.add_argument("--hidden-size", type=int, default=64)
    ref.add_argument("--num-attention-heads", type=int, default=4)
    ref.add_argument("--seq-length", type=int, default=64)
    ref.add_argument(
        "--vocab-divisor",
        type=int,
        default=100,
        help="--make-vocab-size-divisible-by (100: the 512 ids pad to 600, exercising the mask)",
    )
    ref.add_argument("--micro-batch-size", type=int, default=4)
    ref.add_argument("--global-batch-size", type=int, default=8)
    ref.add_argument("--lr", type=float, default=3e-3)
    ref.add_argument("--weight-decay", type=float, default=0.1)
    ref.add_argument("--clip-grad", type=float, default=0.5)
    ref.add_argument("--seed", type=int, default=1234)
    mvd = sub.add_parser("moe-vs-dense", help="dense vs MoE at equal active parameters on WikiText-2")
    mvd.add_argument(
        "--wikitext-dir",
        default=DEFAULT_WIKITEXT,
        help="folder with wiki.valid.tokens and wiki.test.tokens (default ../shared/wikitext-2)",
    )
    mvd.add_argument("--seeds", default="1,2", help="comma-separated seeds")
    mvd.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    mvd.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary trained on the training split")
    mvd.add_argument("--num-layers", type=int, default=4)
    mvd.add_argument("--hidden-size", type=int, default=128)
    mvd.add_argument("--num-attention-heads", type=int, default=4)
    mvd.add_argument("--seq-length", type=int, default=128)
    mvd.add_argument("--micro-batch-size", type=int, default=16, help="one micro-batch per step")
    mvd.add_argument("--train-iters", type=int, default=150)
    mvd.add_argument("--eval-iters", type=int, default=16, help="evaluation batches (of --micro-batch-size)")
    mvd.add_argument("--lr", type=float, default=2e-3)
    mvd.add_argument("--capacity-factor", type=float, default=1.25)
    mvd.add_argument("--log-interval", type=int, default=10)
    for s in (ref, mvd):
        s.add_argument("--work-dir", default=DEFAULT_WORK_DIR, help="scratch: preprocessed data, run logs")
        s.add_argument("--json", help="write the results to this JSON file")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    try:
        if args.mode == "reference":
            res = run_reference(args)
            print_reference(res)
        else:
            res = run_moe_vs_dense(args)
            print_table(res)
    except (BenchError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        atomic_write_json(args.json, res, sort_keys=False)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(sys.argv[1:])
