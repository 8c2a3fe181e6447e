"""Cost-model simulators. `parm`: predicted speedups of S1, S2 and Parm over the baseline.

  python tools/simulate.py parm                                  # the paper's MP all-gather fit for every collective
  python tools/simulate.py parm --a2a-alpha 1e-3 --a2a-beta 2e-9 # inter-node all-to-alls slower than the rest
  python tools/simulate.py parm --profile comm.json --json out.json   # alpha/beta from a --comm-profile cache

For every configuration of Parm's Table III grid (P in {8,16,32}, N_MP and N_ESP
in {1,2,4}, B in {2,4,8}, L in {512,1024,2048}, M/N_ESP in {1024,2048,4096},
f in {1.2,2.4}) it predicts the forward + backward communication time of the
baseline, S1 and S2 with the alpha-beta model of `megatron_moe.moe.cost_model`,
lets Algorithm 1 pick S1 or S2 ("Parm"), and prints the speedups over the
baseline averaged per (N_MP, N_ESP) like the paper's Table IV. Communication
only: the baseline's N_MP-fold duplicate expert compute is not counted.
"""
from __future__ import annotations

import argparse
import json
import os

from megatron_moe.moe.cost_model import (PAPER_ALLGATHER, AlphaBeta, CommModel, simulate_grid,
                                         uniform_model)


def parm_model(args) -> CommModel:
    """The alpha-beta model the simulation uses (profile file, or preset with command-line overrides)."""
    if args.profile:
        try:
            with open(args.profile) as f:
                costs = json.load(f)["costs"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"--profile {args.profile}: not a readable --comm-profile cache ({e})")
        return CommModel({k: AlphaBeta(v["alpha"], v["beta"]) for k, v in costs.items()}, "cache")
    base = AlphaBeta(args.alpha if args.alpha is not None else PAPER_ALLGATHER.alpha,
                     args.beta if args.beta is not None else PAPER_ALLGATHER.beta)
    over = {}
    if args.a2a_alpha is not None or args.a2a_beta is not None:
        over["all_to_all"] = AlphaBeta(base.alpha if args.a2a_alpha is None else args.a2a_alpha,
                                       base.beta if args.a2a_beta is None else args.a2a_beta)
    return uniform_model(base, **over)


def run_parm(args) -> None:
    model = parm_model(args)
    rows = simulate_grid(model, k=args.topk, saa=not args.no_saa)
    print(f"Parm simulation, top-{args.topk}, SAA {'off' if args.no_saa else 'on'}; model: "
          + ", ".join(f"{k} a={v.alpha:.3g}s b={v.beta:.3g}s/el" for k, v in sorted(model.costs.items())))
    print(f"{'N_MP':>5}{'N_ESP':>6}{'configs':>9}{'S1':>8}{'S2':>8}{'Parm':>8}{'picks S1':>10}")
    out = []
    for (n_mp, n_esp), r in sorted(rows.items()):
        print(f"{n_mp:>5}{n_esp:>6}{r['configs']:>9}{r['s1']:>7.2f}x{r['s2']:>7.2f}x{r['parm']:>7.2f}x"
              f"{r['picked_s1']:>9.0%}")
        out.append({"n_mp": n_mp, "n_esp": n_esp, **r})
    if args.json:
        tmp = f"{args.json}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, args.json)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    pp = sub.add_parser("parm", help="Parm: S1 / S2 / Parm speedups over the baseline on the paper's grid")
    pp.add_argument("--alpha", type=float, default=None, help="alpha [s] of every collective (default: paper's "
                    f"MP all-gather fit, {PAPER_ALLGATHER.alpha})")
    pp.add_argument("--beta", type=float, default=None, help="beta [s/element] of every collective (default: "
                    f"{PAPER_ALLGATHER.beta})")
    pp.add_argument("--a2a-alpha", type=float, default=None, help="alpha of the all-to-alls (default --alpha)")
    pp.add_argument("--a2a-beta", type=float, default=None, help="beta of the all-to-alls (default --beta)")
    pp.add_argument("--profile", default=None, help="take alpha/beta from a --comm-profile cache file")
    pp.add_argument("--topk", type=int, default=1, choices=[1, 2])
    pp.add_argument("--no-saa", action="store_true", help="S2 without the all-to-all/all-gather overlap")
    pp.add_argument("--json", default=None, help="write the table as JSON here")
    args = p.parse_args(argv)
    if args.what == "parm":
        run_parm(args)


if __name__ == "__main__":
    main()
