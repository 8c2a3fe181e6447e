"""GPT-2's tanh-GELU on CPU: PyTorch's kernel against the C kernel (`megatron_moe/kernels/cpu_gelu.py`).

  OMP_NUM_THREADS=1 python tools/bench_gelu.py --rows 253 506 1013 --json gelu.json

One process. For each --rows R: the activation alone on [R, --ffn-hidden-size] float32, forward and
backward, each implementation timed --iters times, alternating (median ms); then the experts'
grouped MLP (`Experts.forward_ragged`, --local-experts experts sharing the R rows, M =
--hidden-size) forward + backward with the C kernel and with aten (MEGATRON_MOE_NO_CPU_KERNELS=1),
alternating. Also the largest difference between the two implementations' results. Prints a
table; --json writes a list of {rows, what, aten_ms, c_ms, speedup, max_abs_diff}. Without a C
compiler (or above its thread limit) only aten runs and the tool says why (`cpu_gelu.status()`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from megatron_moe.kernels import cpu_gelu
from megatron_moe.layers.fused import gelu_tanh_backward, gelu_tanh_out
from megatron_moe.moe.experts import Experts
from megatron_moe.parallel_state import local_state

OFF = "MEGATRON_MOE_NO_CPU_KERNELS"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[253, 506, 1013], help="rows of the activation")
    p.add_argument("--hidden-size", type=int, default=256, help="M, the experts' input width")
    p.add_argument("--ffn-hidden-size", type=int, default=1024, help="H, the activation's width")
    p.add_argument("--local-experts", type=int, default=2, help="experts sharing the rows (the MLP rows)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    if min(a.rows) < 1 or min(a.hidden_size, a.ffn_hidden_size, a.local_experts, a.iters) < 1:
        p.error("--rows, --hidden-size, --ffn-hidden-size, --local-experts and --iters must be >= 1")
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


def with_kernel(on: bool, fn):
    """`fn` run with the C kernel allowed (on) or off (aten)."""

    def run():
        old = os.environ.get(OFF)
        os.environ[OFF] = "0" if on else "1"
        try:
            return fn()
        finally:
            if old is None:
                del os.environ[OFF]
            else:
                os.environ[OFF] = old

    return run


def bench_rows(a, R: int, have_c: bool) -> list[dict]:
    g = torch.Generator(device="cpu").manual_seed(R)
    x = torch.randn(R, a.ffn_hidden_size, generator=g, device="cpu") * 3
    grad = torch.randn(R, a.ffn_hidden_size, generator=g, device="cpu")
    y, dx = torch.empty_like(x), torch.empty_like(x)
    fwd = {"aten": with_kernel(False, lambda: gelu_tanh_out(x, y))}
    bwd = {"aten": with_kernel(False, lambda: gelu_tanh_backward(grad, x, out=dx))}
    if have_c:
        fwd["c"] = with_kernel(True, lambda: gelu_tanh_out(x, y))
        bwd["c"] = with_kernel(True, lambda: gelu_tanh_backward(grad, x, out=dx))

    experts = Experts(
        a.local_experts, a.hidden_size, a.ffn_hidden_size, local_state(), 7, "bench.gelu", device=x.device
    )
    xm = torch.randn(R, a.hidden_size, generator=g, device="cpu").requires_grad_()
    gy = torch.randn(R, a.hidden_size, generator=g, device="cpu")
    counts = [R // a.local_experts + (e < R % a.local_experts) for e in range(a.local_experts)]

    def mlp():
        out = experts.forward_ragged(xm, counts)
        (out * gy).sum().backward()
        result = [out.detach(), xm.grad] + [p.grad for p in experts.parameters()]
        experts.zero_grad(set_to_none=True)
        xm.grad = None
        return result

    mlps = {"aten": with_kernel(False, mlp)}
    if have_c:
        mlps["c"] = with_kernel(True, mlp)

    rows = []
    for what, fns, outputs in (
        ("forward", fwd, lambda f: (f(), y.clone())[1]),
        ("backward", bwd, lambda f: (f(), dx.clone())[1]),
        ("expert MLPs fwd+bwd", mlps, lambda f: torch.cat([t.reshape(-1) for t in f()])),
    ):
        ms = timed(fns, a.iters)
        diff = float((outputs(fns["c"]) - outputs(fns["aten"])).abs().max()) if have_c else None
        c = ms.get("c")
        rows.append(
            {
                "rows": R,
                "what": what,
                "aten_ms": ms["aten"],
                "c_ms": c,
                "speedup": ms["aten"] / c if c else None,
                "max_abs_diff": diff,
            }
        )
    return rows


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    have_c = cpu_gelu.status().startswith("C kernel")  # built, checked, and within its thread limit
    print(f"tanh-GELU on CPU, {torch.get_num_threads()} thread(s): {cpu_gelu.status()}")
    rows = [r for R in a.rows for r in bench_rows(a, R, have_c)]
    print(f"{'rows':>6}  {'what':<22}{'aten ms':>9}{'C ms':>9}{'speedup':>9}{'max |diff|':>12}")
    for r in rows:
        c = f"{r['c_ms']:.3f}" if r["c_ms"] else "-"
        s = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        d = f"{r['max_abs_diff']:.2e}" if r["max_abs_diff"] is not None else "-"
        print(f"{r['rows']:>6}  {r['what']:<22}{r['aten_ms']:>9.3f}{c:>9}{s:>9}{d:>12}")
    if a.json:
        tmp = f"{a.json}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
