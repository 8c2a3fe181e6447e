"""Cost-model simulators. `parm`: predicted speedups of S1, S2 and Parm over the baseline.
`pro-prophet`: Pro-Prophet's performance model on Zipf-skewed loads (see the end of this docstring).

  python tools/simulate.py parm                                  # the paper's MP all-gather fit for every collective
  python tools/simulate.py parm --a2a-alpha 1e-3 --a2a-beta 2e-9 # inter-node all-to-alls slower than the rest
  python tools/simulate.py parm --profile comm.json --json out.json   # alpha/beta from a --comm-profile cache
  python tools/simulate.py parm --table-iv                       # beside Parm's Table IV (testbeds A and B)

For every configuration of Parm's Table III grid (P in {8,16,32}, N_MP and N_ESP
in {1,2,4}, B in {2,4,8}, L in {512,1024,2048}, M/N_ESP = H/N_ESP in
{1024,2048,4096}, f in {1.2,2.4}) it predicts the forward + backward time of
the baseline (eq. (1)), S1 (eq. (13), the paper's capacity-padded buffers, or
`--s1 kept` for this project's kept-tokens-only transfer) and S2 (eq. (14),
with `--overlap-alpha/--overlap-beta` as the fitted SAA overlap, else the chunk
pipeline) with the alpha-beta model of `megatron_moe.moe.cost_model`, plus the
expert compute at `--tflops` (0: communication only), lets Algorithm 1 pick S1
or S2 ("Parm") and our `auto` pick among baseline, S1 and S2, and prints the
speedups over the baseline averaged per (N_MP, N_ESP) like the paper's Table IV.

`--table-iv` runs testbed A (P = 8, the paper's A fit, --tflops-a) and testbed
B (P = 8, 16, 32, the B fit, --tflops-b) and prints, for the cells of Table IV,
the simulated speedups beside the published ones.

`pro-prophet`: D ranks, E experts, --tokens routed choices per rank whose expert popularity
follows a Zipf law with exponent --skew (expert e gets a share proportional to 1 / (e + 1)^skew,
the same on every rank; counts rounded by largest remainder). For each skew it prints the
modelled MoE-layer time (eqs. (1)-(8) of `megatron_moe.pro_prophet.perf_model`) and the load
std of computed tokens per rank for: none, heaviest_to_all (the 2 heaviest experts to every
rank, eq. (6)), pro_prophet_plan_only (Algorithm 1 with eq. (6)) and pro_prophet (Algorithm 1
with the scheduler's eq. (8)). Constants from --bandwidth-gbps / --latency-us (all-to-all and
Trans/Agg) and --tflops (expert FFN: 4 M F flops per token forward).

  python tools/simulate.py pro-prophet --devices 4 --experts 4 --skew 0 0.6 1.2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_moe.moe.cost_model import (
    OVERLAP_KEY,
    PAPER_GRID,
    TABLE_IV,
    TABLE_IV_COLUMNS,
    TESTBEDS,
    AlphaBeta,
    CommModel,
    simulate_grid,
    uniform_model,
)
from megatron_moe.pro_prophet.perf_model import PerfConstants, PerfModel
from megatron_moe.pro_prophet.planner import heaviest_to_all, plan

# nominal fp32 peak throughput of the testbeds' GPUs [TFLOP/s]: RTX 4090 (A), RTX 2080 Ti (B)
TESTBED_TFLOPS = {"A": 82.6, "B": 13.4}
TABLE_IV_RUNS = (("A", "A", 8), ("B-8", "B", 8), ("B-16", "B", 16), ("B-32", "B", 32))


def parm_model(args, testbed: str | None = None) -> CommModel:
    """The alpha-beta model the simulation uses (profile file, or a testbed preset with command-line overrides)."""
    if args.profile:
        try:
            with open(args.profile) as f:
                costs = json.load(f)["costs"]
            model = CommModel({k: AlphaBeta(float(v["alpha"]), float(v["beta"])) for k, v in costs.items()}, "cache")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--profile {args.profile}: not a readable --comm-profile cache ({e})") from None
    else:
        preset = TESTBEDS[testbed or args.testbed]
        base = AlphaBeta(
            args.alpha if args.alpha is not None else preset.alpha, args.beta if args.beta is not None else preset.beta
        )
        over = {}
        if args.a2a_alpha is not None or args.a2a_beta is not None:
            over["all_to_all"] = AlphaBeta(
                base.alpha if args.a2a_alpha is None else args.a2a_alpha,
                base.beta if args.a2a_beta is None else args.a2a_beta,
            )
        model = uniform_model(base, **over)
    if (args.overlap_alpha is None) != (args.overlap_beta is None):
        raise ValueError("--overlap-alpha and --overlap-beta go together")
    if args.overlap_alpha is not None:
        model.costs[OVERLAP_KEY] = AlphaBeta(args.overlap_alpha, args.overlap_beta)
    return model


def _flops(tflops: float) -> float | None:
    if tflops < 0:
        raise ValueError(f"--tflops must be >= 0, got {tflops}")
    return tflops * 1e12 if tflops > 0 else None


def _write_json(path: str, data) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _describe(model: CommModel) -> str:
    return ", ".join(f"{k} a={v.alpha:.3g}s b={v.beta:.3g}s/el" for k, v in sorted(model.costs.items()))


def run_parm(args) -> list:
    """The plain table over the whole grid; returns its rows."""
    model = parm_model(args)
    rows = simulate_grid(
        model,
        k=args.topk,
        saa=not args.no_saa,
        s1=args.s1,
        paper_baseline=not args.runtime_baseline,
        flops_per_s=_flops(args.tflops),
    )
    print(
        f"Parm simulation, top-{args.topk}, SAA {'off' if args.no_saa else 'on'}, S1 {args.s1}, "
        f"compute {args.tflops:g} TFLOP/s; model: {_describe(model)}"
    )
    print(
        f"{'N_MP':>5}{'N_ESP':>6}{'configs':>9}{'S1':>8}{'S2':>8}{'Parm':>8}{'auto':>8}{'picks S1':>10}"
        f"{'auto=base':>11}"
    )
    out = []
    for (n_mp, n_esp), r in sorted(rows.items()):
        print(
            f"{n_mp:>5}{n_esp:>6}{r['configs']:>9}{r['s1']:>7.2f}x{r['s2']:>7.2f}x{r['parm']:>7.2f}x"
            f"{r['auto']:>7.2f}x{r['picked_s1']:>9.0%}{r['picked_baseline']:>11.0%}"
        )
        out.append({"n_mp": n_mp, "n_esp": n_esp, **r})
    return out


def run_table_iv(args) -> list:
    """Simulated speedups beside Table IV for its (schedule, N_MP, N_ESP) cells; returns the rows."""
    sims = {}
    for col, testbed, P in TABLE_IV_RUNS:
        model = parm_model(args, testbed)
        tflops = args.tflops_a if testbed == "A" else args.tflops_b
        sims[col] = simulate_grid(
            model,
            k=args.topk,
            saa=not args.no_saa,
            grid=dict(PAPER_GRID, P=(P,)),
            s1=args.s1,
            paper_baseline=not args.runtime_baseline,
            flops_per_s=_flops(tflops),
        )
        print(f"{col}: P={P}, compute {tflops:g} TFLOP/s, model: {_describe(model)}")
    print(f"top-{args.topk}, SAA {'off' if args.no_saa else 'on'}, S1 {args.s1}; each cell: simulated / Table IV")
    print(f"{'schedule':>9}{'N_MP':>5}{'N_ESP':>6}" + "".join(f"{c:>15}" for c in TABLE_IV_COLUMNS))
    out = []
    for (sched, n_mp, n_esp), paper in TABLE_IV.items():
        cells, row = [], {"schedule": sched, "n_mp": n_mp, "n_esp": n_esp}
        for col, p in zip(TABLE_IV_COLUMNS, paper):
            sim = sims[col][(n_mp, n_esp)][sched]
            cells.append(f"{sim:>7.2f}/{p:<5.2f}".rjust(15))
            row[col] = {"simulated": sim, "paper": p}
        print(f"{sched:>9}{n_mp:>5}{n_esp:>6}" + "".join(cells))
        out.append(row)
    for n_mp, n_esp in sorted({(m, e) for _, m, e in TABLE_IV}):
        share = "".join(f"{sims[col][(n_mp, n_esp)]['picked_s1']:>15.0%}" for col in TABLE_IV_COLUMNS)
        print(f"{'S1 share':>9}{n_mp:>5}{n_esp:>6}{share}   (Algorithm 1's picks)")
    return out


def zipf_counts(devices: int, experts: int, tokens: int, skew: float) -> list[list[int]]:
    """[D, E] counts: each rank routes `tokens` choices, expert e's share proportional to 1 / (e + 1)^skew
    (largest-remainder rounding, ties to the lower expert)."""
    w = [1.0 / (e + 1) ** skew for e in range(experts)]
    exact = [tokens * x / sum(w) for x in w]
    row = [int(x) for x in exact]
    for e in sorted(range(experts), key=lambda j: (-(exact[j] - row[j]), j))[: tokens - sum(row)]:
        row[e] += 1
    return [list(row) for _ in range(devices)]


def pro_prophet_model(args, overlap: bool) -> PerfModel:
    """The performance model of the `pro-prophet` subcommand's flags (fp32 elements)."""
    for name in ("bandwidth_gbps", "tflops"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.latency_us < 0:
        raise ValueError(f"--latency-us must be >= 0, got {args.latency_us}")
    beta = 4 * 8 / (args.bandwidth_gbps * 1e9)  # seconds per fp32 element
    alpha = args.latency_us * 1e-6
    c = PerfConstants(
        a2a_alpha=alpha,
        a2a_beta=beta,
        bcast_alpha=alpha,
        bcast_beta=beta,
        expert_alpha=0.0,
        expert_beta=4 * args.hidden * args.ffn_hidden / (args.tflops * 1e12),
    )
    params = 2 * args.hidden * args.ffn_hidden
    return PerfModel(
        c,
        token_elements=args.hidden,
        param_elements=params,
        grad_elements=params,
        fnec_s=args.fnec_ms * 1e-3,
        bnec_s=args.bnec_ms * 1e-3,
        overlap=overlap,
    )


def run_pro_prophet(args) -> list:
    """The `pro-prophet` table: one row per skew and mode; returns the rows."""
    if args.devices < 1 or args.experts % args.devices:
        raise ValueError(f"--experts ({args.experts}) must be a multiple of --devices ({args.devices})")
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    blocking, scheduled = pro_prophet_model(args, False), pro_prophet_model(args, True)
    print(
        f"Pro-Prophet model: D={args.devices} E={args.experts} tokens/rank={args.tokens} M={args.hidden} "
        f"F={args.ffn_hidden} alpha={args.alpha} n={args.n}; {blocking.constants}"
    )
    print(
        f"{'skew':>5} {'mode':>22}{'predicted_ms':>14}{'speedup':>9}{'std_before':>12}{'std_after':>11}"
        f"{'moved':>7}{'copies':>8}"
    )
    rows = []
    for skew in args.skew:
        counts = zipf_counts(args.devices, args.experts, args.tokens, skew)
        plans = {
            "none": (heaviest_to_all(counts, k=0, model=blocking), blocking),
            "heaviest_to_all": (heaviest_to_all(counts, k=min(2, args.experts), model=blocking), blocking),
            "pro_prophet_plan_only": (plan(counts, blocking, alpha=args.alpha, n=args.n), blocking),
            "pro_prophet": (plan(counts, scheduled, alpha=args.alpha, n=args.n), scheduled),
        }
        base = plans["none"][0].predicted_s
        for mode, (p, model) in plans.items():
            row = {
                "mode": mode,
                "skew": skew,
                "predicted_ms": p.predicted_s * 1e3,
                "speedup": base / p.predicted_s,
                "load_std_before": p.load_std_before,
                "load_std_after": p.load_std_after,
                "moved": len(p.order),
                "copies": p.num_transfers,
                "trans_bytes": 4 * p.num_transfers * model.param_elements,
                "agg_bytes": 4 * p.num_transfers * model.grad_elements,
            }
            rows.append(row)
            print(
                f"{skew:>5g} {mode:>22}{row['predicted_ms']:>14.3f}{row['speedup']:>9.2f}"
                f"{row['load_std_before']:>12.1f}{row['load_std_after']:>11.1f}{row['moved']:>7}{row['copies']:>8}"
            )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    pp = sub.add_parser("parm", help="Parm: S1 / S2 / Parm speedups over the baseline on the paper's grid")
    pp.add_argument(
        "--testbed",
        choices=sorted(TESTBEDS),
        default="A",
        help="the paper's MP all-gather fit used for every collective (A: "
        f"{TESTBEDS['A'].alpha}s, {TESTBEDS['A'].beta}s/el; B: {TESTBEDS['B'].alpha}s, "
        f"{TESTBEDS['B'].beta}s/el)",
    )
    pp.add_argument("--alpha", type=float, default=None, help="alpha [s] of every collective (default: --testbed)")
    pp.add_argument(
        "--beta", type=float, default=None, help="beta [s/element] of every collective (default: --testbed)"
    )
    pp.add_argument("--a2a-alpha", type=float, default=None, help="alpha of the all-to-alls (default --alpha)")
    pp.add_argument("--a2a-beta", type=float, default=None, help="beta of the all-to-alls (default --beta)")
    pp.add_argument(
        "--overlap-alpha",
        type=float,
        default=None,
        help="alpha_o [s] of eq. (14) (fitted SAA overlap; default: chunk-pipeline model)",
    )
    pp.add_argument("--overlap-beta", type=float, default=None, help="beta_o [s/element] of eq. (14)")
    pp.add_argument("--profile", default=None, help="take alpha/beta from a --comm-profile cache file")
    pp.add_argument("--topk", type=int, default=1, choices=[1, 2])
    pp.add_argument("--no-saa", action="store_true", help="S2 without the all-to-all/all-gather overlap")
    pp.add_argument(
        "--s1",
        choices=("padded", "kept"),
        default="padded",
        help="S1's all-to-all: the paper's padded buffers (default) or kept tokens only (this runtime)",
    )
    pp.add_argument(
        "--runtime-baseline",
        action="store_true",
        help="price the baseline as this project runs it (ESP all-gather of the dispatch buffer), not by eq. (1)",
    )
    pp.add_argument(
        "--tflops", type=float, default=0.0, help="expert compute throughput [TFLOP/s] (0: communication only)"
    )
    pp.add_argument("--table-iv", action="store_true", help="print the simulation beside Parm's Table IV")
    pp.add_argument(
        "--tflops-a",
        type=float,
        default=TESTBED_TFLOPS["A"],
        help="--table-iv: testbed A's throughput [TFLOP/s] (default RTX 4090 fp32 peak)",
    )
    pp.add_argument(
        "--tflops-b",
        type=float,
        default=TESTBED_TFLOPS["B"],
        help="--table-iv: testbed B's throughput [TFLOP/s] (default RTX 2080 Ti fp32 peak)",
    )
    pp.add_argument("--json", default=None, help="write the table as JSON here")
    pq = sub.add_parser("pro-prophet", help="Pro-Prophet: modelled MoE-layer time and load std under Zipf skew")
    pq.add_argument("--devices", type=int, default=4, help="expert-parallel ranks D")
    pq.add_argument("--experts", type=int, default=4, help="experts E (a multiple of --devices)")
    pq.add_argument("--tokens", type=int, default=8192, help="routed choices per rank and iteration")
    pq.add_argument("--hidden", type=int, default=1024, help="hidden size M (elements per token)")
    pq.add_argument("--ffn-hidden", type=int, default=2048, help="expert FFN hidden size F")
    pq.add_argument("--skew", type=float, nargs="+", default=[0.0, 0.6, 1.2], help="Zipf exponents")
    pq.add_argument("--alpha", type=float, default=0.25, help="balance threshold of eq. (7) (--pro-prophet-alpha)")
    pq.add_argument("--n", type=int, default=0, help="ranks a moved expert is not sent to (--pro-prophet-n)")
    pq.add_argument("--bandwidth-gbps", type=float, default=100.0, help="link bandwidth [Gbit/s] (paper: 100)")
    pq.add_argument("--latency-us", type=float, default=20.0, help="latency per collective [us]")
    pq.add_argument("--tflops", type=float, default=35.0, help="expert compute throughput [TFLOP/s] (RTX 3090 fp32)")
    pq.add_argument("--fnec-ms", type=float, default=0.0, help="non-expert forward compute of a block [ms] (eq. (8))")
    pq.add_argument("--bnec-ms", type=float, default=0.0, help="non-expert backward compute of a block [ms] (eq. (8))")
    pq.add_argument("--json", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        if args.what == "pro-prophet":
            out = run_pro_prophet(args)
            if args.json:
                _write_json(args.json, out)
        if args.what == "parm":
            out = run_table_iv(args) if args.table_iv else run_parm(args)
            if args.json:
                _write_json(args.json, out)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
