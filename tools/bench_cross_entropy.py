"""The LM head's loss: our vocab-parallel cross entropy against PyTorch's `F.cross_entropy`.

  OMP_NUM_THREADS=1 python tools/bench_cross_entropy.py --shape 8 128 1024 --shape 4 256 8192 --json ce.json

One process (the vocabulary on one rank, as with --tensor-model-parallel-size 1). For each --shape
B T V: forward + backward of the per-token losses summed, on random float32 logits [B, T, V] and
targets, each implementation timed --iters times, alternating (median ms); and the largest
difference of the two losses and of the two logits' gradients. `ours` is
`layers.tensor_parallel.vocab_parallel_cross_entropy`, what the model's forward calls. Prints a
table; --json writes a list of {shape, ours_ms, torch_ms, ratio, max_abs_diff_loss,
max_abs_diff_grad}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from megatron_moe.fileio import atomic_write_json
from megatron_moe.layers.tensor_parallel import vocab_parallel_cross_entropy


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=3, action="append", metavar=("B", "T", "V"), help="logits shape")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    a.shape = a.shape or [[8, 128, 1024], [4, 256, 8192]]
    if a.iters < 1 or min(min(s) for s in a.shape) < 1:
        p.error("--iters and every --shape dim must be >= 1")
    return a


def timed(fns: dict, iters: int) -> dict:
    """Median ms of each callable, called in turn `iters` times after one warm-up call each."""
    for f in fns.values():
        f()
    ms: dict = {k: [] for k in fns}
    for _ in range(iters):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ms[k].append(1e3 * (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in ms.items()}


def bench_shape(B: int, T: int, V: int, iters: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(V)
    x = (torch.randn(B, T, V, generator=g, device="cpu") * 3).requires_grad_()
    target = torch.randint(0, V, (B, T), generator=g, device="cpu")

    def ours():
        loss = vocab_parallel_cross_entropy(x, target, None, 0, V)
        loss.sum().backward()
        return loss.detach(), x.grad

    def theirs():
        loss = F.cross_entropy(x.view(-1, V), target.view(-1), reduction="none").view(B, T)
        loss.sum().backward()
        return loss.detach(), x.grad

    results = {}
    for k, f in (("ours", ours), ("torch", theirs)):  # the values compared below
        x.grad = None
        loss, grad = f()
        results[k] = (loss, grad.clone())

    def fresh(f):
        def run():
            x.grad = None
            f()

        return run

    med = timed({"ours": fresh(ours), "torch": fresh(theirs)}, iters)
    return {
        "shape": [B, T, V],
        "ours_ms": med["ours"],
        "torch_ms": med["torch"],
        "ratio": med["ours"] / med["torch"],
        "max_abs_diff_loss": float((results["ours"][0] - results["torch"][0]).abs().max()),
        "max_abs_diff_grad": float((results["ours"][1] - results["torch"][1]).abs().max()),
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    rows = [bench_shape(B, T, V, a.iters) for B, T, V in a.shape]
    print(f"cross entropy, forward + backward, {torch.get_num_threads()} thread(s), median of {a.iters}")
    print(f"{'B x T x V':>18}{'ours ms':>10}{'torch ms':>10}{'ours/torch':>12}{'|d loss|':>10}{'|d grad|':>10}")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        print(
            f"{shape:>18}{r['ours_ms']:>10.2f}{r['torch_ms']:>10.2f}{r['ratio']:>11.2f}x"
            f"{r['max_abs_diff_loss']:>10.1e}{r['max_abs_diff_grad']:>10.1e}"
        )
    if a.json:
        atomic_write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
