"""Profile the MoE collectives on the run's real groups, fit alpha-beta, cache the fit, pick schedules.

`load_or_profile(ps, max_elements, path)` is collective over the world: rank 0 reuses the
cache `path` (--comm-profile) when it was written for the same layout (`layout_key`) and
covers `max_elements`; otherwise every rank times each collective of PROFILED on its own
group of that kind (all groups at once, as in training) at sizes from 1 KB up to
`max_elements` fp32 elements (x4 steps), plus S2's overlapped step (`profile_saa`, eq. (14))
when the layout has one; the medians are MAX-reduced over the world before the fit and
rank 0 writes the cache. Rank 0 broadcasts the fitted numbers, so Algorithm 1 makes the
same choice on every rank (a different choice would hang the run).
`choose_for_layer(cfg, ps, layer_idx)` applies Algorithm 1 to one MoE layer, pricing the
expert compute at the throughput measured on this machine (`expert_throughput`);
`moe.schedule_trial.auto_schedule` then times the candidates on the real layer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_moe.distributed import collectives as coll
from megatron_moe.moe.cost_model import (
    OVERLAP_KEY,
    AlphaBeta,
    Choice,
    CommModel,
    MoEShape,
    choose_schedule,
    fit_alpha_beta,
    fit_overlap,
)

if TYPE_CHECKING:
    from megatron_moe.config import Config
    from megatron_moe.parallel_state import ParallelState


log = logging.getLogger("megatron_moe.parm")

PROFILED = (
    ("all_to_all", "ep_esp"),
    ("all_gather", "mp"),
    ("all_reduce", "mp"),
    ("all_to_all", "ep"),
    ("all_gather", "esp"),
    ("all_reduce", "esp"),
    ("reduce_scatter", "esp"),
)
MIN_ELEMENTS = 256  # 1 KB of fp32
MAX_PROFILE_ELEMENTS = 1 << 24  # 64 MB: larger messages are extrapolated from the fit
CACHE_VERSION = 3  # a cache of another version is profiled again

_MEMO: dict = {}


def profile_sizes(max_elements: int, min_elements: int = MIN_ELEMENTS, factor: int = 4) -> list[int]:
    """Message sizes [elements]: min, min*factor, ... and max (at least two sizes)."""
    top = max(min(int(max_elements), MAX_PROFILE_ELEMENTS), 2 * min_elements)
    sizes, n = [], min_elements
    while n < top:
        sizes.append(n)
        n *= factor
    return sizes + [top]


def _run_once(op: str, group, t: torch.Tensor) -> None:
    if op == "all_to_all":
        coll.all_to_all_raw(t, group)
    elif op == "all_gather":
        coll.all_gather_raw(t, group)
    elif op == "all_reduce":
        coll.all_reduce_raw(t, group)
    elif op == "reduce_scatter":
        coll.reduce_scatter_raw(t, group)
    else:
        raise ValueError(f"unknown collective {op!r}")


def time_collective(
    op: str, group, n: int, reps: int = 3, warmup: int = 1, device: torch.device = torch.device("cpu")
) -> float:
    """Median wall time [s] of `op` on `group` for an n-element fp32 message (n rounded up to the group size)."""
    size = coll.group_size(group)
    n = -(-n // size) * size
    t = torch.ones(n, device=device)
    samples = []
    for i in range(warmup + reps):
        dist.barrier(group=group)
        if t.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _run_once(op, group, t)
        if t.is_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return float(sorted(samples)[len(samples) // 2])


def fit_sizes(op: str, group_size: int, sizes: list[int]) -> list[int]:
    """The sizes the cost model prices a profiled collective by: the message one rank puts in
    (rounded up to the group size, as `time_collective` does), times the group size for an
    all-gather (its gathered output, the paper's convention)."""
    rounded = [-(-n // group_size) * group_size for n in sizes]
    return [n * group_size for n in rounded] if op == "all_gather" else rounded


def layout_key(ps: "ParallelState") -> dict:
    """What a cached profile must match to be reused."""
    dev = ps.device.type  # the run's device (a --device cpu run on a CUDA machine is "cpu")
    return {
        "world_size": ps.layout.world_size,
        "mp": ps.layout.mp,
        "ep": ps.layout.ep,
        "esp": ps.layout.esp,
        "backend": str(ps.backend),
        "device": dev,
        "procs_per_node": os.environ.get("LOCAL_WORLD_SIZE", ""),
    }


def _kinds(ps: "ParallelState") -> list[tuple[str, str]]:
    return [(op, kind) for op, kind in PROFILED if ps.size(kind) > 1]


def _has_saa(ps: "ParallelState") -> bool:
    """S2 has an SAA step to profile: MP and an EP x ESP group."""
    return ps.size("mp") > 1 and ps.size("ep_esp") > 1


def _names(ps: "ParallelState") -> list[str]:
    """The entries of this layout's profile: every collective of `_kinds`, and the SAA overlap."""
    return [f"{op}@{kind}" for op, kind in _kinds(ps)] + ([OVERLAP_KEY] if _has_saa(ps) else [])


def profile(ps: "ParallelState", max_elements: int, reps: int = 3, warmup: int = 1) -> tuple[CommModel, dict]:
    """Time every collective of PROFILED on this rank's groups; returns (fitted model, raw table)."""
    device = ps.device
    sizes = profile_sizes(max_elements)
    kinds = _kinds(ps)
    measured = [[time_collective(op, ps.group(kind), n, reps, warmup, device) for n in sizes] for op, kind in kinds]
    times = torch.tensor(measured, dtype=torch.float64, device=device).reshape(len(kinds), len(sizes))
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # every rank fits the same numbers
    times = times.cpu()
    costs, raw = {}, {}
    for i, (op, kind) in enumerate(kinds):
        priced = fit_sizes(op, ps.size(kind), sizes)
        costs[f"{op}@{kind}"] = fit_alpha_beta(priced, times[i].tolist())
        raw[f"{op}@{kind}"] = {"sizes": priced, "times": times[i].tolist()}
    if _has_saa(ps):  # eq. (14)'s overlap, measured (not modelled)
        costs[OVERLAP_KEY], raw[OVERLAP_KEY] = profile_saa(
            ps, sizes, costs.get("all_gather@mp"), reps=reps, warmup=warmup
        )
    return CommModel(costs, "profile"), raw


def _read_cache(path: str, key: dict, max_elements: int):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if data.get("version") != CACHE_VERSION or data.get("layout") != key:
        return None
    if data.get("max_elements", 0) < min(max_elements, MAX_PROFILE_ELEMENTS):
        return None
    if key["mp"] > 1 and key["ep"] * key["esp"] > 1 and OVERLAP_KEY not in data["costs"]:
        return None  # a profile without the SAA overlap this layout needs
    return CommModel({k: AlphaBeta(v["alpha"], v["beta"]) for k, v in data["costs"].items()}, "cache")


def write_cache(path: str, key: dict, max_elements: int, model: CommModel, raw: dict) -> None:
    """Write the fit as JSON (temporary file, then rename)."""
    data = {
        "version": CACHE_VERSION,
        "layout": key,
        "max_elements": int(max_elements),
        "units": "alpha [s], beta [s per fp32 element], size = elements one rank puts in (all_gather: gathered output)",
        "costs": {k: {"alpha": ab.alpha, "beta": ab.beta, **raw.get(k, {})} for k, ab in model.costs.items()},
    }
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _broadcast(ps: "ParallelState", model: CommModel, source: str) -> CommModel:
    names = _names(ps)
    rows = [[model.costs[n].alpha, model.costs[n].beta] if n in model.costs else [0.0, 0.0] for n in names]
    vals = torch.tensor(rows, device=ps.device, dtype=torch.float64).reshape(len(names), 2)
    dist.broadcast(vals, src=0)
    vals = vals.cpu()
    return CommModel({n: AlphaBeta(float(vals[i, 0]), float(vals[i, 1])) for i, n in enumerate(names)}, source)


def load_or_profile(ps: "ParallelState", max_elements: int, path: str | None = None, reps: int = 3) -> CommModel:
    """The fitted model for this layout (collective over the world; see the module docstring)."""
    if not _kinds(ps) or not dist.is_initialized():
        return CommModel({}, "none")  # nothing to communicate: every schedule is free
    key = layout_key(ps)
    cached = _read_cache(path, key, max_elements) if path and dist.get_rank() == 0 else None
    flag = torch.tensor([1 if cached is not None else 0], device=ps.device)
    dist.broadcast(flag, src=0)
    if int(flag.item()):
        return _broadcast(ps, cached if cached is not None else CommModel(), "cache")
    model, raw = profile(ps, max_elements, reps)
    error = ""
    if path and dist.get_rank() == 0:
        try:
            write_cache(path, key, max_elements, model, raw)
        except OSError as e:  # every rank must learn it, or the others would hang
            error = str(e)
    if path:  # the same on every rank: all take part
        failed = torch.tensor([1 if error else 0], device=flag.device)
        dist.broadcast(failed, src=0)
        if int(failed.item()):
            raise ValueError(f"--comm-profile {path}: cannot write the profile cache ({error or 'see rank 0'})")
    return _broadcast(ps, model, "profile")


def time_saa(
    a2a_group,
    mp_group,
    n: int,
    n_esp: int = 1,
    chunks: int = 4,
    reps: int = 3,
    warmup: int = 1,
    device: torch.device | None = None,
) -> float:
    """Median wall time [s] of an SAA-like step (collective over both groups): an all-to-all of n fp32
    elements (rounded up to a multiple of chunks * a2a size * n_esp) over `a2a_group` in `chunks`; each
    received chunk is summed over its N_ESP partials and all-gathered over `mp_group` while the next
    chunk's all-to-all is in flight. `device`: where the buffers live (None: CPU)."""
    d = coll.group_size(a2a_group)
    quantum = chunks * d * n_esp
    n = -(-max(int(n), 1) // quantum) * quantum
    send = torch.ones(n, device=device)
    recv = torch.empty(n, device=device)
    step = n // chunks
    samples = []
    for i in range(warmup + reps):
        dist.barrier(group=a2a_group)
        dist.barrier(group=mp_group)
        if send.is_cuda:
            torch.cuda.synchronize(send.device)
        t0 = time.perf_counter()
        gathers = []
        for c in range(chunks):
            dist.all_to_all_single(
                recv[c * step : (c + 1) * step], send[c * step : (c + 1) * step], group=a2a_group, async_op=True
            ).wait()
            part = recv[c * step : (c + 1) * step].view(n_esp, -1).sum(0)
            outs = [torch.empty_like(part) for _ in range(coll.group_size(mp_group))]
            gathers.append(dist.all_gather(outs, part, group=mp_group, async_op=True))
        for w in gathers:
            w.wait()
        if send.is_cuda:
            torch.cuda.synchronize(send.device)
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return float(sorted(samples)[len(samples) // 2])


def profile_saa(
    ps, sizes: list[int], all_gather: AlphaBeta | None, chunks: int = 4, reps: int = 3, warmup: int = 1
) -> tuple[AlphaBeta, dict]:
    """((alpha_o, beta_o) of Parm's eq. (14), raw table) on this rank's EP x ESP and MP groups (collective
    over the world): `time_saa` at each all-to-all size V of `sizes` [elements], MAX over the world per
    size, fitted by `fit_overlap` beside the MP all-gather `all_gather` (N_MP / N_ESP gathered elements
    per element of V). Stored under `cost_model.OVERLAP_KEY`."""
    device = ps.device
    n_esp = ps.size("esp")
    quantum = chunks * ps.size("ep_esp") * n_esp
    rounded = [-(-max(int(n), 1) // quantum) * quantum for n in sizes]
    measured = [time_saa(ps.group("ep_esp"), ps.group("mp"), n, n_esp, chunks, reps, warmup, device) for n in rounded]
    times = torch.tensor(measured, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.cpu()
    fit = fit_overlap(rounded, times.tolist(), all_gather, ps.size("mp") / n_esp)
    return fit, {"sizes": rounded, "times": times.tolist(), "chunks": chunks}


def shape_of(cfg: "Config", ps: "ParallelState") -> MoEShape:
    """The MoE layer shape Algorithm 1 sees for a config and layout."""
    m, moe = cfg.model, cfg.moe
    return MoEShape(
        B=cfg.train.micro_batch_size,
        L=m.seq_length,
        M=m.hidden_size,
        E=moe.num_experts,
        k=moe.moe_router_topk,
        f=moe.moe_expert_capacity_factor,
        n_mp=ps.size("mp"),
        n_ep=ps.size("ep"),
        n_esp=ps.size("esp"),
        min_capacity=moe.moe_min_capacity,
        H=m.ffn_hidden_size or 4 * m.hidden_size,
    )


def time_expert_gemms(rows: int, M: int, H: int, reps: int = 3, device: torch.device = torch.device("cpu")) -> float:
    """Median seconds of one expert MLP's GEMMs forward + backward on `rows` rows ([rows, M] x [M, H],
    [rows, H] x [H, M], and the four backward GEMMs); no activation, no communication."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, M, generator=g, device="cpu").to(device)
    w1 = torch.randn(M, H, generator=g, device="cpu").to(device)
    w2 = torch.randn(H, M, generator=g, device="cpu").to(device)
    samples = []
    for i in range(reps + 1):
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        t0 = time.perf_counter()
        h = x @ w1
        y = h @ w2
        dh = y @ w2.t()  # dY W2^T, then the weight gradients and dX
        _ = h.t() @ y, x.t() @ dh, dh @ w1.t()
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        if i:
            samples.append(time.perf_counter() - t0)
    return float(sorted(samples)[len(samples) // 2])


def expert_throughput(ps: "ParallelState", sh: MoEShape, reps: int = 3) -> float:
    """FLOP/s of this layer's expert GEMMs on this machine (collective: the MIN over the world, so every rank
    gets the same number and the slowest rank sets the pace). Timed on at most 1024 rows."""
    H_l = (sh.H or sh.M) // sh.n_esp
    rows = max(1, min(1024, sh.n_esp * sh.E * sh.C // sh.n_ep))
    flops = 3 * 2 * 2 * rows * sh.M * H_l
    seconds = max(time_expert_gemms(rows, sh.M, H_l, reps, ps.device), 1e-9)
    rate = torch.tensor([flops / seconds], dtype=torch.float64, device=ps.device)
    if dist.is_initialized():
        dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate.cpu()[0])


def comm_model_for(ps: "ParallelState", max_elements: int, path: str | None = None) -> CommModel:
    """`load_or_profile`, remembered per layout and cache path for the life of the process."""
    key = (tuple(sorted(layout_key(ps).items())), path)
    hit = _MEMO.get(key)
    if hit is None or hit[0] < min(max_elements, MAX_PROFILE_ELEMENTS):
        _MEMO[key] = (min(max_elements, MAX_PROFILE_ELEMENTS), load_or_profile(ps, max_elements, path))
    return _MEMO[key][1]


def choose_for_layer(cfg: "Config", ps: "ParallelState", layer_idx: int) -> Choice:
    """Algorithm 1 for one MoE layer (--moe-schedule auto); identical on every rank; logged on rank 0."""
    sh = shape_of(cfg, ps)
    model = comm_model_for(ps, sh.largest_message(), cfg.moe.comm_profile)
    key = ("throughput", sh.M, sh.H, sh.n_esp, sh.E * sh.C // sh.n_ep)
    if key not in _MEMO:
        _MEMO[key] = expert_throughput(ps, sh)
    flops_per_s = _MEMO[key]
    # one rank holding every expert computes only the kept rows (`moe.dispatcher.local_plan`), several the buffer
    kept = sh.n_ep * sh.n_esp == 1
    choice = choose_schedule(model, sh, saa=cfg.moe.moe_saa, flops_per_s=flops_per_s, kept_compute=kept)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(
            f"parm: layer {layer_idx} B={sh.B} L={sh.L} M={sh.M} H={sh.H} E={sh.E} k={sh.k} f={sh.f:g} "
            f"N_MP={sh.n_mp} N_EP={sh.n_ep} N_ESP={sh.n_esp} -> {choice.describe()} "
            f"[model: {model.source}; expert GEMMs {flops_per_s / 1e9:.1f} GFLOP/s]"
        )
    return choice
