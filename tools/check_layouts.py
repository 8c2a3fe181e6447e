"""Every layout's code path in one process (torch's fake process group): GEMM dtypes and host syncs.

  python tools/check_layouts.py --device cuda [--layouts EP8,MP2xEP4-S2] [--json out.json]

For each layout of `megatron_moe.fake_world.LAYOUTS` (world 8: MP, EP, ESP, S1, S2, dropless, the
kept-row paths, Lina's chunks, Lancet's parts and dW queue, Pro-Prophet's replicas; and the inference
engine generating a few tokens under EP4 and MP2xEP2xESP2), one process
plays one rank and runs a bf16 forward + backward of a small GPT-2 MoE on --device: collectives move
no data, every other op runs for real. The table gives the GEMMs that did not run in bf16 (the
router's gate is fp32 by design and counted apart), the GEMMs written into `out=` tensors, and the
host syncs made inside the MoE layers and in the whole step (`opspy.OpSpy`). Exit status 1 when a
layout fails to run or runs a non-router GEMM above bf16; --json writes every layout's report.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

from megatron_moe.fileio import atomic_write_json
from megatron_moe.fake_world import INFERENCE_LAYOUTS, LAYOUTS, generate_report, step_report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    every = [*LAYOUTS, *INFERENCE_LAYOUTS]
    p.add_argument("--layouts", default=",".join(every), help="comma-separated, from the fake_world LAYOUTS")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    bad = [n for n in names if n not in every]
    if bad:
        p.error(f"--layouts: unknown {bad}; choose from {', '.join(every)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    device = torch.device(args.device)
    reports, status = [], 0
    print(
        f"{'layout':<26}{'gemms':>6}{'router fp32':>12}{'other >bf16':>12}{'out=':>6}{'MoE syncs':>10}{'step syncs':>11}"
    )
    for name in names:
        try:
            r = step_report(name, device) if name in LAYOUTS else generate_report(name, device)
        except Exception as e:  # noqa: BLE001 (reported, and the exit status says so)
            status = 1
            reports.append({"layout": name, "error": repr(e), "traceback": traceback.format_exc()})
            print(f"{name:<26}  failed: {e!r}")
            continue
        reports.append(r)
        status |= bool(r["high_precision_gemms"])
        print(
            f"{name:<26}{r.get('gemms', ''):>6}{r['router_gemms']:>12}{len(r['high_precision_gemms']):>12}"
            f"{len(r.get('out_gemms', [])):>6}{len(r['moe_syncs']):>10}{r['syncs']:>11}"
        )
    if args.json:
        atomic_write_json(args.json, {"device": args.device, "layouts": reports})
    return status


if __name__ == "__main__":
    sys.exit(main())
