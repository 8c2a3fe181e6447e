"""mmoe-plan's predicted step time against the step time measured on an emulated cluster.

    . .venv/bin/activate
    python tools/validate_plan.py --rate 200mbit --json /tmp/validate_plan.json     # as root
    python tools/validate_plan.py --rate 200mbit --unshaped --json /tmp/validate_plan.json
    python tools/validate_plan.py --reuse measured --json /tmp/validate_plan.json   # re-plan only

For each world N of --worlds (N emulated nodes x 1 process, links of --rate per node), with the
model flags of --model plus --global-batch-size = --samples-per-rank x N, it runs, one at a time:

  1. the profile, under the same emulated cluster:
       scripts/emulate_cluster.sh --nodes N --procs-per-node 1 --inter-node-rate RATE -- \\
           -m megatron_moe.cli.plan profile --out DIR/profN.json --nodes N --gpus-per-node 1 MODEL
  2. the plan on that profile:
       python -m megatron_moe.cli.plan --profile DIR/profN.json --nodes N --gpus-per-node 1 MODEL \\
           --json DIR/planN.json
  3. each candidate of --candidates (DP2, EP2, MP2xEP2, EP4+lina, EP4+lancet, ...):
       scripts/emulate_cluster.sh --nodes N --procs-per-node 1 --inter-node-rate RATE -- \\
           pretrain_gpt_moe.py MODEL LAYOUT --moe-schedule SCHEDULE --train-iters ITERS \\
           --eval-interval 0 --measure-iters 0 --save '' --log-interval 1 --log-json DIR/run-....jsonl
     (SCHEDULE: the one the plan predicted the candidate with, so both sides time the same layer),
     and with --unshaped once more with --inter-node-rate none: the step without the link's cost.

The measured step time is the median of the logged per-iteration times (`ms_per_iter`) after the
first --warmup; a run whose interquartile range exceeds --max-spread of that median, or during
which other processes kept more than --max-foreign cores busy on average (from /proc/stat minus
the run's own CPU time), is repeated (up to --tries runs) and the least disturbed run is kept
(marked * in the table when none was clean). The predicted one is the candidate's
`step_s` in the plan. Prints the table (predicted, measured, error), the median absolute error per
world and overall, and whether the measured-fastest candidate of each world is in the plan's top 2
among the measured ones; --json writes it all (atomic). Exit status 0 when the median absolute
error is within --max-error and every world's fastest is in the top 2, 1 otherwise, 2 on a failed
run or bad arguments. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from typing import Optional

from megatron_moe.fileio import atomic_write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATE = os.path.join(ROOT, "scripts", "emulate_cluster.sh")
MODEL = (
    "--vocab-size 512 --num-layers 4 --hidden-size 128 --num-attention-heads 4 --num-experts 4 "
    "--seq-length 128 --micro-batch-size 4"
)
CANDIDATES = {
    2: "DP2,EP2,MP2,ESP2,EP2+lina,EP2+lancet",
    4: "EP4,EP2,MP2xEP2,EP2xESP2,EP4+lina,EP4+lancet",
}
OPT_NAMES = {"lina": "lina", "lancet": "lancet", "pro-prophet": "pro_prophet"}
BREAKDOWN_COMM = ("mp_all_reduce", "moe_mp", "moe_ep", "moe_esp", "moe_ep_esp", "dp_all_reduce_exposed")


def parse_candidate(spec: str, world: int) -> dict:
    """'MP2xEP2+lina' -> {'spec', 'mp', 'ep', 'esp', 'opts'}; DPn is only a label (DP is the rest)."""
    layout, *opts = spec.split("+")
    deg = {"MP": 1, "EP": 1, "ESP": 1, "DP": 1}
    for part in layout.split("x"):
        m = re.fullmatch(r"(MP|EP|ESP|DP)(\d+)", part)
        if not m:
            raise ValueError(f"candidate {spec!r}: {part!r} is not MPn, EPn, ESPn or DPn")
        deg[m.group(1)] = int(m.group(2))
    bad = [o for o in opts if o not in OPT_NAMES]
    if bad:
        raise ValueError(f"candidate {spec!r}: unknown switch {bad[0]!r} (one of {', '.join(OPT_NAMES)})")
    if world % deg["MP"] or world % (deg["EP"] * deg["ESP"]):
        raise ValueError(f"candidate {spec!r} does not fit world {world}")
    on = {OPT_NAMES[o] for o in opts}
    return {
        "spec": spec,
        "mp": deg["MP"],
        "ep": deg["EP"],
        "esp": deg["ESP"],
        "opts": {k: k in on for k in OPT_NAMES.values()},
    }


def layout_flags(c: dict) -> list[str]:
    out = [
        "--tensor-model-parallel-size", str(c["mp"]),
        "--expert-model-parallel-size", str(c["ep"]),
        "--expert-sharding-parallel-size", str(c["esp"]),
    ]  # fmt: skip
    out += ["--lina"] if c["opts"]["lina"] else []
    out += ["--lancet-wgrad"] if c["opts"]["lancet"] else []
    out += ["--pro-prophet"] if c["opts"]["pro_prophet"] else []
    return out


def cpu_times() -> tuple[float, float]:
    """(busy, total) core-seconds of the whole machine since boot (from /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(v) - v[3] - v[4]) / tick, sum(v) / tick  # idle and iowait are not busy


def cpu_busy(seconds: float = 1.0) -> float:
    """Share of all cores busy over `seconds`."""
    b0, t0 = cpu_times()
    time.sleep(seconds)
    b1, t1 = cpu_times()
    return (b1 - b0) / max(1e-9, t1 - t0)


def children_cpu() -> float:
    """Core-seconds used by this process's finished children and their waited-for descendants."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(limit: float, max_wait: float) -> float:
    """Wait (up to max_wait s) until the machine's cores are busy below `limit`; the last share seen.
    Other jobs on the machine share the cores the emulated nodes compute on, so a step timed while
    they run measures them too."""
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy > limit and time.monotonic() < deadline:
        busy = cpu_busy(2.0)
    return busy


def emulated(world: int, rate: str, port: int, timeout: int, command: list[str]) -> list[str]:
    return [
        EMULATE, "--nodes", str(world), "--procs-per-node", "1", "--inter-node-rate", rate,
        "--master-port", str(port), "--timeout", str(timeout), "--", *command,
    ]  # fmt: skip


def run(cmd: list[str], log: str) -> None:
    """Run `cmd` in the repository root, its output to `log`; raise with the log's tail on failure."""
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if rc:
        with open(log) as f:
            tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"exit status {rc}: {shlex.join(cmd)}\n(log {log})\n{tail}")


def iteration_times(path: str) -> list[float]:
    with open(path) as f:
        return [float(json.loads(line)["ms_per_iter"]) for line in f if line.strip()]


def summarize(times: list[float], warmup: int) -> dict:
    kept = sorted(times[warmup:])
    if len(kept) < 4:
        raise RuntimeError(f"only {len(kept)} iterations after the first {warmup}: raise --iters")
    q = statistics.quantiles(kept, n=4)
    med = statistics.median(kept)
    return {"median_ms": med, "iqr_ms": q[2] - q[0], "spread": (q[2] - q[0]) / med, "n": len(kept)}


class Validator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.port = args.master_port
        self.cache_path = os.path.join(args.dir, "measured.json")
        self.cache: dict = {}
        if args.reuse != "none" and os.path.exists(self.cache_path):
            with open(self.cache_path) as f:
                self.cache = json.load(f)

    def model(self, world: int) -> list[str]:
        return shlex.split(self.a.model) + ["--global-batch-size", str(self.a.samples_per_rank * world)]

    def next_port(self) -> int:
        # a fresh rendezvous port per run: a port the last run's store held may sit in TIME_WAIT
        self.port = self.port + 1 if self.port < self.a.master_port + 200 else self.a.master_port
        return self.port

    def profile(self, world: int) -> str:
        out = os.path.join(self.a.dir, f"prof{world}.json")
        if self.a.reuse == "all" and os.path.exists(out):
            return out
        cmd = ["-m", "megatron_moe.cli.plan", "profile", "--out", out, "--nodes", str(world), "--gpus-per-node", "1"]
        cmd += self.model(world) + shlex.split(self.a.profile_args)
        self.say(f"world {world}: profiling ({self.a.rate})")
        wait_quiet(self.a.quiet, self.a.quiet_wait)
        run(emulated(world, self.a.rate, self.next_port(), self.a.timeout, cmd), out[:-5] + ".log")
        return out

    def plan(self, world: int, profile: str) -> dict:
        out = os.path.join(self.a.dir, f"plan{world}.json")
        cmd = [sys.executable, "-m", "megatron_moe.cli.plan", "--profile", profile, "--nodes", str(world)]
        cmd += ["--gpus-per-node", "1", *self.model(world), "--top", "100", "--json", out]
        run(cmd, out[:-5] + ".log")
        with open(out) as f:
            return json.load(f)

    def measure(self, world: int, c: dict, rate: str, schedule: str) -> dict:
        key = json.dumps([world, c["spec"], rate, schedule, self.model(world), self.a.iters, self.a.warmup])
        if self.a.reuse != "none" and key in self.cache:
            return self.cache[key]
        slug = re.sub(r"[^A-Za-z0-9]+", "-", c["spec"]) + "-" + rate
        tries = []
        for i in range(self.a.tries):
            log = os.path.join(self.a.dir, f"run-w{world}-{slug}-{i}.jsonl")
            if os.path.exists(log):
                os.remove(log)  # --log-json appends
            cmd = ["pretrain_gpt_moe.py", *self.model(world), *layout_flags(c), "--moe-schedule", schedule]
            cmd += ["--train-iters", str(self.a.iters), "--eval-interval", "0", "--measure-iters", "0"]
            cmd += ["--save", "", "--log-interval", "1", "--log-json", log]
            busy = wait_quiet(self.a.quiet, self.a.quiet_wait)
            ours0, (busy0, _) = children_cpu(), cpu_times()
            t0 = time.monotonic()
            run(emulated(world, rate, self.next_port(), self.a.timeout, cmd), log[:-6] + ".log")
            wall = time.monotonic() - t0
            # cores used by anything but this run (other jobs; also the links' softirq work, which
            # the docs measured at 10-60 ms per 1.7 s step with jumbo frames: a few % of a core)
            foreign = ((cpu_times()[0] - busy0) - (children_cpu() - ours0)) / wall
            times = iteration_times(log)
            s = summarize(times, self.a.warmup)
            s.update(
                times_ms=[round(t, 2) for t in times],
                busy_before=round(busy, 3),
                foreign_cores=round(foreign, 3),
                wall_s=round(wall, 1),
                log=log,
            )
            tries.append(s)
            self.say(
                f"  {c['spec']:<14} {rate:>8} try {i + 1}: median {s['median_ms']:.1f} ms, "
                f"spread {100 * s['spread']:.1f} %, other load {foreign:.2f} cores"
            )
            if s["spread"] <= self.a.max_spread and foreign <= self.a.max_foreign:
                break
        # a run that shared the cores with other jobs times them too: the least disturbed run wins
        best = min(tries, key=lambda s: (s["foreign_cores"] > self.a.max_foreign, s["spread"]))
        res = {
            "median_ms": best["median_ms"],
            "spread": best["spread"],
            "foreign_cores": best["foreign_cores"],
            "clean": best["spread"] <= self.a.max_spread and best["foreign_cores"] <= self.a.max_foreign,
            "tries": tries,
        }
        self.cache[key] = res
        atomic_write_json(self.cache_path, self.cache)
        return res

    def say(self, text: str) -> None:
        print(text, flush=True)

    def world(self, world: int, specs: list[str]) -> dict:
        cands = [parse_candidate(s, world) for s in specs]
        prof = self.profile(world)
        plan = self.plan(world, prof)
        rows = []
        for c in cands:
            match = [
                p
                for p in plan["candidates"]
                if (p["mp"], p["ep"], p["esp"]) == (c["mp"], c["ep"], c["esp"])
                and all(bool(p["opts"].get(k)) == v for k, v in c["opts"].items())
            ]
            row = dict(c, world=world)
            if not match or not match[0]["fits"]:
                row["missing"] = match[0]["rejected"] if match else "not among the plan's candidates"
                self.say(f"  {c['spec']}: skipped ({row['missing']})")
                rows.append(row)
                continue
            p = match[0]
            b = p["breakdown_s"]
            comm = {k: b[k] for k in BREAKDOWN_COMM if b.get(k)}
            row.update(
                name=p["name"],
                schedule=p["schedule"],
                predicted_ms=1e3 * p["step_s"],
                predicted_compute_ms=1e3 * b["compute"],
                predicted_comm_ms=1e3 * (p["step_s"] - b["compute"]),
                predicted_breakdown_ms={k: 1e3 * v for k, v in b.items() if isinstance(v, (int, float))},
                predicted_comm_terms_ms={k: 1e3 * v for k, v in comm.items()},
            )
            m = self.measure(world, c, self.a.rate, p["schedule"])
            row.update(measured_ms=m["median_ms"], spread=m["spread"], measured=m)
            row["error"] = (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
            if self.a.unshaped:
                u = self.measure(world, c, "none", p["schedule"])
                row.update(unshaped_ms=u["median_ms"], unshaped=u)
                row["measured_comm_ms"] = row["measured_ms"] - u["median_ms"]
                row["compute_error"] = (row["predicted_compute_ms"] - u["median_ms"]) / u["median_ms"]
            rows.append(row)
        done = [r for r in rows if "measured_ms" in r]
        fastest = min(done, key=lambda r: r["measured_ms"]) if done else None
        by_pred = sorted(done, key=lambda r: r["predicted_ms"])
        top2 = [r["spec"] for r in by_pred[:2]]
        with open(prof) as f:
            profile = json.load(f)
        return {
            "world": world,
            "profile": prof,
            "profile_links": profile.get("links"),
            "plan": os.path.join(self.a.dir, f"plan{world}.json"),
            "cluster": plan.get("cluster"),
            "rows": rows,
            "median_abs_error": statistics.median(abs(r["error"]) for r in done) if done else None,
            "measured_fastest": fastest["spec"] if fastest else None,
            "predicted_order": [r["spec"] for r in by_pred],
            "predicted_top2": top2,
            "fastest_in_top2": bool(fastest) and fastest["spec"] in top2,
            # how much slower, measured, the plan's top 2's faster one ran than the measured fastest:
            # a miss by less than the runs' spread is a tie the measurement cannot order
            "top2_measured_gap": (
                min(r["measured_ms"] for r in by_pred[:2]) / fastest["measured_ms"] - 1.0 if fastest else None
            ),
        }


def table(rows: list[dict], unshaped: bool) -> list[str]:
    head = f"{'world':>5} {'candidate':<14}{'sched':>9}{'pred ms':>9}{'meas ms':>9}{'error':>8}{'spread':>8} "
    head += f"{'pred cmp':>9}{'pred com':>9}" + (f"{'unshaped':>9}{'meas com':>9}" if unshaped else "")
    lines = [head]
    for r in rows:
        if "measured_ms" not in r:
            lines.append(f"{r['world']:>5} {r['spec']:<14} skipped: {r.get('missing', '')[:60]}")
            continue
        line = (
            f"{r['world']:>5} {r['spec']:<14}{r['schedule']:>9}{r['predicted_ms']:>9.1f}{r['measured_ms']:>9.1f}"
            f"{100 * r['error']:>7.1f}%{100 * r['spread']:>6.1f}%{' ' if r['measured']['clean'] else '*'}"
            f"{r['predicted_compute_ms']:>9.1f}{r['predicted_comm_ms']:>9.1f}"
        )
        if unshaped and "unshaped_ms" in r:
            line += f"{r['unshaped_ms']:>9.1f}{r['measured_comm_ms']:>9.1f}"
        lines.append(line)
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="emulated nodes (1 process each)")
    p.add_argument(
        "--candidates",
        action="append",
        default=None,
        metavar="N:SPEC,...",
        help="candidates of world N, e.g. 2:DP2,EP2,MP2,EP2+lina (default: six per world)",
    )
    p.add_argument("--rate", default="200mbit", help="inter-node link rate per node (tc units)")
    p.add_argument("--unshaped", action="store_true", help="also measure each candidate with unshaped links")
    p.add_argument("--model", default=MODEL, help="model flags of the profile, the plan and the runs")
    p.add_argument("--samples-per-rank", type=int, default=8, help="--global-batch-size = this x world")
    p.add_argument("--profile-args", default="", help="extra flags of `mmoe-plan profile`")
    p.add_argument("--iters", type=int, default=30, help="training iterations per measured run")
    p.add_argument("--warmup", type=int, default=5, help="first iterations left out of the median")
    p.add_argument("--tries", type=int, default=3, help="runs per candidate at most")
    p.add_argument("--max-spread", type=float, default=0.10, help="repeat a run whose IQR / median exceeds this")
    p.add_argument("--max-error", type=float, default=0.15, help="pass: median absolute error at most this")
    p.add_argument("--quiet", type=float, default=0.25, help="start a run once the cores are busy below this")
    p.add_argument("--quiet-wait", type=float, default=120.0, help="seconds to wait for --quiet at most")
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.2,
        help="repeat a run during which other processes used more than this many cores on average",
    )
    p.add_argument("--timeout", type=int, default=600, help="seconds per emulated run")
    p.add_argument("--master-port", type=int, default=29610, help="first rendezvous port")
    p.add_argument(
        "--reuse",
        choices=("none", "measured", "all"),
        default="none",
        help="measured: take step times from --dir's cache (profile and plan again); all: the profiles too",
    )
    p.add_argument("--dir", default="/tmp/validate_plan", help="profiles, plans and run logs")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: Optional[list] = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    specs = dict(CANDIDATES)
    for item in a.candidates or []:
        n, _, s = item.partition(":")
        if not n.isdigit() or not s:
            p.error(f"--candidates {item!r}: expected N:SPEC,SPEC,...")
        specs[int(n)] = s
    for w in a.worlds:
        if w not in specs:
            p.error(f"no candidates for world {w}: pass --candidates {w}:SPEC,...")
        try:
            [parse_candidate(s, w) for s in specs[w].split(",")]
        except ValueError as e:
            p.error(str(e))
    if a.warmup < 0 or a.iters <= a.warmup + 3:
        p.error("--iters must exceed --warmup by at least 4")
    if os.geteuid() != 0:
        p.error("needs root (scripts/emulate_cluster.sh builds network namespaces)")
    os.makedirs(a.dir, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    v = Validator(a)
    worlds = []
    try:
        for w in a.worlds:
            worlds.append(v.world(w, specs[w].split(",")))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [r for w in worlds for r in w["rows"]]
    done = [r for r in rows if "measured_ms" in r]
    overall = statistics.median(abs(r["error"]) for r in done) if done else None
    print(f"rate {a.rate} per node; model {a.model} --global-batch-size {a.samples_per_rank} x world")
    for line in table(rows, a.unshaped):
        print(line)
    for w in worlds:
        print(
            f"world {w['world']}: median |error| {100 * (w['median_abs_error'] or 0):.1f} %; measured fastest "
            f"{w['measured_fastest']}, plan's top 2 {w['predicted_top2']}: "
            f"{'in' if w['fastest_in_top2'] else 'NOT in'} top 2 (the top 2's best ran "
            f"{100 * (w['top2_measured_gap'] or 0):.1f} % slower than the fastest)"
        )
    err_ok = overall is not None and overall <= a.max_error
    top2_ok = all(w["fastest_in_top2"] for w in worlds)
    ok = err_ok and top2_ok
    print(
        f"overall: median |error| {100 * (overall or 0):.1f} % (<= {100 * a.max_error:g} %: "
        f"{'met' if err_ok else 'missed'}); measured fastest in the top 2 in every world: "
        f"{'met' if top2_ok else 'missed'}; {'pass' if ok else 'fail'}"
    )
    if a.json:
        atomic_write_json(
            a.json,
            {
                "rate": a.rate,
                "model": a.model,
                "samples_per_rank": a.samples_per_rank,
                "iters": a.iters,
                "warmup": a.warmup,
                "worlds": worlds,
                "median_abs_error": overall,
                "max_error": a.max_error,
                "pass": ok,
                "argv": sys.argv,
            },
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
