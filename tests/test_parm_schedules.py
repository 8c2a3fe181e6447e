"""Parm: S1 and S2 (SAA on and off) equal the one-process reference; their comm bytes equal the formulas.

One spawn per world size runs every case; the parent computes references and
formulas. The tiny config drops tokens (capacity factor 0.5). Byte counts are
taken on a bare MoE layer (no tensor-parallel traffic of the dense blocks), and
the expected numbers come from routing the same inputs in the parent.
"""

import math
import os
import tempfile

import torch

from equivalence import compare, global_batch, reference, run_layout, tiny_config
from megatron_moe.distributed.observer import CommLog as CommTracer
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.router import route
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel, local_state
from megatron_moe.testing import spawn

B, T = 2, 16
SCHEDS = {"s1": {"schedule": "s1"}, "s2": {"schedule": "s2"}, "s2-aas": {"schedule": "s2", "moe_saa": False}}


def cfg_of(k, policy="position", sched="s1", **extra):
    return tiny_config(k, policy, **{**SCHEDS.get(sched, {"schedule": sched}), **extra})


# ----------------------------------------------------------------------------- in the spawned ranks


def layer_input(dp_rank: int, M: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + dp_rank)
    return torch.randn(B, T, M, generator=g)


def _layer_bytes(cfg, mp, ep, esp):
    """Forward + backward of one bare MoE layer; bytes sent per (op, group) and dropped count."""
    ps = initialize_model_parallel(mp, ep, esp)
    try:
        layer = MoELayer(cfg, ps, seed=7, name="moe", layer_idx=1)
        x = layer_input(ps.rank("dp"), cfg.model.hidden_size).requires_grad_()
        with CommTracer() as tr:
            y, aux = layer(x)
            (y.pow(2).sum() + aux).backward()
        return {"bytes": tr.totals("sent"), "dropped": layer.last_stats["dropped"]}
    finally:
        destroy_model_parallel()


def _saa_variants(world):
    """a2a_combine_gather: SAA (collective chunks), SAA with isend/irecv chunks, AAS: identical outputs."""
    from megatron_moe.distributed.saa import a2a_combine_gather

    ps = initialize_model_parallel(2, 2, 1)
    try:
        g = torch.Generator().manual_seed(ps.global_rank)
        send = torch.randn(ps.size("ep_esp"), 3, 5, 4, generator=g)
        args = (send, ps.group("ep_esp"), ps.group("mp"), ps.size("esp"))
        return [
            a2a_combine_gather(*args, overlap=True, chunks=2),
            a2a_combine_gather(*args, overlap=True, chunks=3, p2p=True),
            a2a_combine_gather(*args, overlap=False),
            send,
        ]
    finally:
        destroy_model_parallel()


def _profile_cache(path):
    """Profile once (writes the cache), then load it; every rank returns what it got."""
    from megatron_moe.moe.comm_profile import load_or_profile

    ps = initialize_model_parallel(2, 2, 1)
    try:
        first = load_or_profile(ps, 1024, path, reps=1)
        second = load_or_profile(ps, 1024, path)
        return first.source, second.source, first.costs, second.costs
    finally:
        destroy_model_parallel()


def _auto_choice(cfg, mp, ep, esp):
    from megatron_moe.moe.comm_profile import choose_for_layer

    ps = initialize_model_parallel(mp, ep, esp)
    try:
        return choose_for_layer(cfg, ps, 1)
    finally:
        destroy_model_parallel()


def _run_all(rank, world, model_cases, byte_cases, extras):
    out = {"model": [], "bytes": [], "choices": []}
    for layout, k, policy, sched, extra in model_cases:
        cfg = cfg_of(k, policy, sched, **extra)
        if sched == "auto":
            cfg.train.micro_batch_size = 2
            out["choices"].append(_auto_choice(cfg, *layout))
        out["model"].append(run_layout(cfg, *layout))
    for layout, k, sched in byte_cases:
        out["bytes"].append(_layer_bytes(cfg_of(k, "position", sched), *layout))
    if "saa" in extras:
        out["saa"] = _saa_variants(world)
    if "cache" in extras:
        out["cache"] = _profile_cache(extras["cache"])
    return out


# ----------------------------------------------------------------------------- formulas in the parent


def reference_routes(cfg, dp):
    """The one-process routing of every data-parallel group's inputs of `layer_input`."""
    layer = MoELayer(cfg, local_state(), seed=7, name="moe", layer_idx=1)
    M = cfg.model.hidden_size
    m = cfg.moe
    with torch.no_grad():
        return [
            route(
                layer.router.logits(layer_input(d, M).reshape(B * T, M)),
                m.moe_router_topk,
                m.moe_expert_capacity_factor,
                m.moe_min_capacity,
            )
            for d in range(dp)
        ]


def expected_bytes(cfg, sched, layout, rank, world):
    """Bytes one rank sends per (op, group) in forward + backward of one MoE layer, fp32."""
    mp, ep, esp = layout
    E, M, k = cfg.moe.num_experts, cfg.model.hidden_size, cfg.moe.moe_router_topk
    S, S_l, E_l = B * T, B * T // mp, E // ep
    C = max(math.ceil(k * cfg.moe.moe_expert_capacity_factor * S / E), cfg.moe.moe_min_capacity)
    C_mp = -(-C // mp)
    out = {}

    def add(op, group, size, n_groups):
        if n_groups > 1:
            out[(op, group)] = out.get((op, group), 0) + size

    if sched == "baseline":
        buf = E * C * M * 4
        add("all_gather", "esp", buf, esp)
        add("reduce_scatter", "esp", esp * buf, esp)
        add("all_to_all", "ep", 4 * esp * buf, ep)
        add("all_reduce", "esp", 2 * esp * buf, esp)
    elif sched == "s2":
        # Parm's S2: all-to-all of N_ESP * E * C/N_MP * M each way, both directions;
        # MP all-gather of E * C/N_MP * M forward (SAA) and backward (dispatch gradient)
        add("all_to_all", "ep_esp", 4 * esp * E * C_mp * M * 4, ep * esp)
        add("all_gather", "mp", 2 * E * C_mp * M * 4, mp)
    else:
        # S1 sends only kept tokens: N_ESP copies of this slice's kept choices out, and
        # back the rows its experts received; the same again in backward
        routes = reference_routes(cfg, world // mp)
        block = ep * esp

        def kept(src, lo, hi):  # kept choices of rank src's slice bound for experts [lo, hi)
            rt, r = routes[src // mp], src % mp
            e, s = rt.expert[r * S_l : (r + 1) * S_l], rt.slot[r * S_l : (r + 1) * S_l]
            return int(((s >= 0) & (e >= lo) & (e < hi)).sum())

        my_ep = (rank % block) // esp
        base = rank - rank % block
        K = kept(rank, 0, E)
        R = sum(kept(src, my_ep * E_l, (my_ep + 1) * E_l) for src in range(base, base + block))
        add("all_to_all", "ep_esp", 2 * (esp * K + R) * M * 4 + esp * E * 8, block)
        add("all_gather", "mp", k * E * 8 + 2 * S_l * M * 4, mp)  # counts; output; input grad
        add("all_reduce", "mp", (E + 1) * 4 + E * M * 4, mp)  # aux sums; gate grad
    return out


# ----------------------------------------------------------------------------- tests

P4_LAYOUTS = [(2, 2, 1), (1, 2, 2), (2, 1, 2), (2, 1, 1)]  # MP2xEP2, EP2xESP2, MP2 with ESP2, MP2xDP2


def _p4_cases():
    cases = [(lay, k, "position", s, {}) for lay in P4_LAYOUTS for k in (1, 2) for s in ("s1", "s2")]
    cases += [(lay, 2, "position", "s2-aas", {}) for lay in P4_LAYOUTS]
    cases += [
        ((2, 2, 1), k, pol, s, {}) for pol in ("batch_prioritized", "random") for k in (1, 2) for s in ("s1", "s2")
    ]
    cases += [((2, 2, 1), 1, "position", "s2", {"moe_expert_capacity_factor": 0.375})]  # C = 3: pad to 4
    return cases


def _check_models(cases, results, world):
    refs = {}
    for i, (lay, k, policy, sched, extra) in enumerate(cases):
        key = (world // lay[0], k, policy, tuple(sorted(extra.items())))
        if key not in refs:
            refs[key] = reference(cfg_of(k, policy, "baseline", **extra), key[0])
        assert refs[key][2][0] > 0, "the config must drop tokens"
        compare(
            [results[r]["model"][i] for r in range(world)],
            refs[key],
            f"P={world} MP{lay[0]} EP{lay[1]} ESP{lay[2]} top-{k} {policy} {sched} {extra}",
        )


def _check_bytes(cases, results, world):
    for i, (lay, k, sched) in enumerate(cases):
        cfg = cfg_of(k, "position", sched)
        for rank in range(world):
            got = results[rank]["bytes"][i]["bytes"]
            want = expected_bytes(cfg, sched, lay, rank, world)
            assert got == want, f"{sched} {lay} rank {rank}: bytes {got} != formula {want}"
    # the factors: S2's all-to-all moves 1/N_MP of the baseline's EP all-to-all, and S1/S2 use
    # no ESP collective at all (local dump and combine replace them)
    for i, (lay, k, sched) in enumerate(cases):
        if sched == "baseline":
            continue
        mine = results[0]["bytes"][i]["bytes"]
        base = results[0]["bytes"][next(j for j, c in enumerate(cases) if c == (lay, k, "baseline"))]["bytes"]
        assert not any(g in ("esp", "ep") for _, g in mine)
        if sched == "s2" and lay[1] > 1:
            assert mine[("all_to_all", "ep_esp")] * lay[0] == base[("all_to_all", "ep")]


def test_parm_schedules_p4():
    cases = _p4_cases()
    local_cap = ((2, 2, 1), 1, "position", "s1", {"moe_s1_local_capacity": True})
    byte_cases = [(lay, 2, s) for lay in [(2, 2, 1), (2, 1, 2)] for s in ("baseline", "s1", "s2")]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "comm.json")
        results = spawn(_run_all, 4, cases + [local_cap], byte_cases, {"saa": True, "cache": path}, timeout=600)
    _check_models(cases, results, 4)
    _check_bytes(byte_cases, results, 4)
    # SAA (collective or isend/irecv chunks) and AAS give bit-identical results ...
    for r in range(4):
        saa, p2p, aas, _ = results[r]["saa"]
        assert torch.equal(saa, aas) and torch.equal(p2p, aas)
    # ... which are the combined, MP-gathered partials: rank (mp m, ep e) gets from EP peer p
    # block e of p's send buffer; MP peers of one DP group hold the same ep_esp group here
    sends = [results[r]["saa"][3] for r in range(4)]
    for r in range(4):
        for m in range(2):
            from_peers = [sends[(r // 2) * 2 + p][m] for p in range(2)]  # [E_l, N, M] from each EP peer
            assert torch.equal(results[r]["saa"][2][m], torch.cat(from_peers, dim=0))
    # the profile cache: written by the first call, reused by the second, identical on every rank
    for r in range(4):
        first_src, second_src, first, second = results[r]["cache"]
        assert (first_src, second_src) == ("profile", "cache") and first == second == results[0]["cache"][2]
    # --moe-s1-local-capacity: each slice routed with its own capacity C(S/N_MP), not equivalent
    lc = results[0]["model"][-1]
    want_drops = _local_capacity_drops(cfg_of(1, "position", "s1"), dp=2, mp=2)
    ref = reference(cfg_of(1, "position", "baseline"), 2)
    got = sum(results[r]["model"][-1]["drops"][0] for r in (0, 2))
    assert got == want_drops != ref[2][0]
    assert abs(lc["loss"] - ref[0]) > 1e-5


def _local_capacity_drops(cfg, dp, mp):
    """Drops when every MP slice of every group is routed on its own (Parm's original S1)."""
    model = GPT2MoE(cfg, local_state(), routing_groups=dp)
    layer = model.moe_layers()[0]
    seen = {}

    def keep_input(mod, inp, out):
        seen["x"] = inp[0].detach()

    layer.register_forward_hook(keep_input)
    ids, labels = global_batch(dp)
    with torch.no_grad():
        model(ids, labels)
    x = seen["x"].reshape(dp * mp, -1, cfg.model.hidden_size)  # group-major, then slice
    m = cfg.moe
    return sum(
        route(
            layer.router.logits(x[i]), m.moe_router_topk, m.moe_expert_capacity_factor, m.moe_min_capacity
        ).num_dropped
        for i in range(dp * mp)
    )


def test_parm_schedules_p8():
    lay = (2, 2, 2)  # MP2 x EP2 x ESP2
    cases = [(lay, k, "position", s, {}) for k in (1, 2) for s in ("s1", "s2", "s2-aas")]
    cases += [(lay, 2, "position", "auto", {})]
    byte_cases = [(lay, 2, s) for s in ("baseline", "s1", "s2")]
    results = spawn(_run_all, 8, cases, byte_cases, {}, timeout=600)
    _check_models(cases, results, 8)
    _check_bytes(byte_cases, results, 8)
    choices = [results[r]["choices"][0] for r in range(8)]
    assert all(c == choices[0] for c in choices), "auto must choose the same schedule on every rank"
    assert choices[0].schedule in ("baseline", "s1", "s2")  # auto also prices the baseline
