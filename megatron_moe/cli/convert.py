"""Convert checkpoints between parallel layouts and to/from Hugging Face and one safetensors file.

Installed as `mmoe-convert`; `python tools/convert_checkpoint.py` runs the same. Examples, from
the repository root (docs/TOOLS.md has more):

    # a checkpoint trained on 1 process -> MP2 x EP2 on 4 ranks, optimizer state included
    python tools/convert_checkpoint.py reshard --load ckpt --save ckpt_mp2ep2 \\
        --target-tensor-model-parallel-size 2 --target-expert-model-parallel-size 2 --target-world-size 4 --verify

    # GPT-2 from a save_pretrained directory (or a hub name), upcycled to 8 experts every 2nd block
    python tools/convert_checkpoint.py import-hf --hf ./gpt2 --save ckpt_moe --num-experts 8 --verify

    # one consolidated file (+ .json) and back; a dense model to GPT2LMHeadModel
    python tools/convert_checkpoint.py export --load ckpt --output model.safetensors --verify
    python tools/convert_checkpoint.py import --input model.safetensors --save ckpt2 --verify
    python tools/convert_checkpoint.py export-hf --load ckpt_dense --output hf_dir --verify

Every output is staged under a temporary name and renamed when complete. --verify compares the
logits of a fixed batch (one-process models on the consolidated tensors) before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megatron_moe import convert as cv
from megatron_moe.arguments import HelpFormatter

TOLERANCE = 1e-5


def add_target_flags(p: argparse.ArgumentParser) -> None:
    """--target-* layout flags of the output (each default 1)."""
    p.add_argument("--target-tensor-model-parallel-size", type=int, default=1, help="MP degree of the output")
    p.add_argument("--target-expert-model-parallel-size", type=int, default=1, help="EP degree of the output")
    p.add_argument("--target-expert-sharding-parallel-size", type=int, default=1, help="ESP degree of the output")
    p.add_argument(
        "--target-world-size",
        type=int,
        default=None,
        help="ranks of the output (default: the smallest that holds the layout, "
        "lcm(MP, EP x ESP); data parallel is world / MP)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The five subcommands and their flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--verify",
        action="store_true",
        help=f"check that logits of a fixed batch are equal before and after (within {TOLERANCE})",
    )
    common.add_argument("--no-progress", action="store_true", help="no progress bars")

    def add(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], formatter_class=HelpFormatter, help=text)

    p = add("reshard", "a sharded checkpoint to another parallel layout")
    p.add_argument("--load", required=True, help="checkpoint directory (uses its 'latest') or an iter_* directory")
    p.add_argument("--iteration", type=int, help="convert this iteration instead of the latest")
    p.add_argument("--save", required=True, help="output checkpoint directory")
    add_target_flags(p)

    p = add("import-hf", "Hugging Face GPT-2 -> our format (iteration 0)")
    p.add_argument("--hf", required=True, help="a save_pretrained directory or a hub name such as gpt2")
    p.add_argument("--save", required=True, help="output checkpoint directory")
    p.add_argument("--num-experts", type=int, default=0, help="0: dense; else experts per MoE block")
    p.add_argument("--moe-layer-freq", type=int, default=2, help="every this many blocks is an MoE block")
    p.add_argument("--moe-router-topk", type=int, default=1, help="experts per token k (1 <= k <= --num-experts)")
    p.add_argument("--moe-expert-capacity-factor", type=float, default=1.0, help="capacity factor in the config")
    p.add_argument("--seed", type=int, default=1234, help="seed of the gate initialization (and of the run)")
    add_target_flags(p)

    p = add("export", "a checkpoint -> one safetensors file + .json")
    p.add_argument("--load", required=True, help="checkpoint directory (any layout)")
    p.add_argument("--iteration", type=int, help="export this iteration instead of the latest")
    p.add_argument("--output", required=True, help="FILE.safetensors (FILE.json is written beside it)")

    p = add("import", "a consolidated safetensors file -> our format")
    p.add_argument("--input", required=True, help="FILE.safetensors written by `export` (FILE.json beside it)")
    p.add_argument("--save", required=True, help="output checkpoint directory")
    add_target_flags(p)

    p = add("export-hf", "a dense checkpoint -> GPT2LMHeadModel directory")
    p.add_argument("--load", required=True, help="checkpoint directory (any layout) or consolidated file")
    p.add_argument("--iteration", type=int, help="export this iteration instead of the latest")
    p.add_argument("--output", required=True, help="output directory (must not exist)")
    return parser


def check(name: str, diff: float) -> None:
    """Print a --verify result; raise when it is over the tolerance (the output is then not committed)."""
    ok = diff <= TOLERANCE
    print(
        f"verify {name}: max |logit difference| = {diff:.3e} (tolerance {TOLERANCE:g}) -> {'OK' if ok else 'FAILED'}",
        flush=True,
    )
    if not ok:
        raise RuntimeError(f"--verify failed for {name}: max |logit difference| {diff:.3e} > {TOLERANCE:g}")


def targets(args, cfg) -> tuple:
    """(target config, world size) from the --target-* flags, validated against the model."""
    mp, ep = args.target_tensor_model_parallel_size, args.target_expert_model_parallel_size
    esp = args.target_expert_sharding_parallel_size
    cfg, world = cv.target_config(cfg, mp, ep, esp, args.target_world_size)
    note = cv.batch_warning(cfg, world)
    if note:
        print(note, flush=True)
    return cfg, world


def write_with_verify(src: cv.FullCheckpoint, args, cfg, world: int, compare_optimizer: bool) -> str:
    """Write the sharded output; with --verify re-read it before the rename and compare."""
    progress = not args.no_progress

    def verify(staged: str) -> None:
        back = cv.read_sharded(staged, progress=progress)
        check("source vs written checkpoint", cv.max_logit_diff(src, back))
        if compare_optimizer:
            bad = cv.optimizer_mismatches(src, back)
            n = sum(len(s) for s in src.optim.values())
            print(f"verify optimizer state: {n} tensors, {len(bad)} differ -> {'OK' if not bad else 'FAILED'}")
            if bad:
                raise RuntimeError(f"--verify failed: optimizer state differs for {bad[:5]}")

    path = cv.write_sharded(src, args.save, cfg, world, progress, verify if args.verify else None)
    p = cfg.parallel
    print(
        f"wrote {path}: world {world} MP{p.tensor_model_parallel_size} EP{p.expert_model_parallel_size} "
        f"ESP{p.expert_sharding_parallel_size} DP{world // p.tensor_model_parallel_size}, "
        f"iteration {src.meta.get('iteration', 0)}"
    )
    return path


def cmd_reshard(args) -> None:
    src = cv.read_sharded(args.load, args.iteration, progress=not args.no_progress)
    cfg, world = targets(args, src.cfg)
    write_with_verify(src, args, cfg, world, compare_optimizer=True)


def cmd_import_hf(args) -> None:
    from megatron_moe.model.hf_import import moe_config

    flags = (args.num_experts, args.moe_layer_freq, args.moe_router_topk, args.moe_expert_capacity_factor)
    moe_config(*flags)  # the MoE flags first: a bad one is named before the model is read (or downloaded)
    hf = cv.load_hf_model(args.hf)
    src = cv.import_hf(hf, args.hf, *flags, args.seed)
    cfg, world = targets(args, src.cfg)
    if args.verify:
        moe = any(src.cfg.is_moe_layer(i) for i in range(src.cfg.model.num_layers))
        diff = cv.hf_logit_diff(hf, src, no_drop=True)
        if not moe or src.cfg.moe.moe_router_topk >= 2:
            check("Hugging Face vs imported" + (" (top-k >= 2, no drops)" if moe else ""), diff)
        else:
            print(
                f"verify: Hugging Face vs upcycled top-1 model differ by {diff:.3e}: expected, a top-1 "
                f"expert's output is scaled by its gate probability (see docs/TOOLS.md); not checked"
            )
    write_with_verify(src, args, cfg, world, compare_optimizer=False)


def cmd_export(args) -> None:
    src = cv.read_sharded(args.load, args.iteration, with_optimizer=False, progress=not args.no_progress)

    def verify(tmp: str, tmp_json: str) -> None:
        check("source vs exported file", cv.max_logit_diff(src, cv.read_file(tmp, tmp_json)))

    out, js = cv.export_file(src, args.output, verify if args.verify else None)
    print(f"wrote {out} and {js} ({len(src.model)} tensors, iteration {src.meta.get('iteration')})")


def cmd_import(args) -> None:
    src = cv.read_file(args.input)
    cfg, world = targets(args, src.cfg)
    write_with_verify(src, args, cfg, world, compare_optimizer=False)


def cmd_export_hf(args) -> None:
    src = cv.read_any(args.load, args.iteration, with_optimizer=False, progress=not args.no_progress)

    def verify(staged: str) -> None:
        hf = cv.load_hf_model(staged)
        check("source vs Hugging Face export", cv.hf_logit_diff(hf, src))

    note = cv.export_hf(src, args.output, verify if args.verify else None)
    print(f"wrote {args.output} (GPT2LMHeadModel); {note}")


COMMANDS = {
    "reshard": cmd_reshard,
    "import-hf": cmd_import_hf,
    "export": cmd_export,
    "import": cmd_import,
    "export-hf": cmd_export_hf,
}


def main(argv: Optional[list[str]] = None) -> int:
    """Run one subcommand; bad input ends with `error: ...` on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        print(f"convert_checkpoint.py {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
