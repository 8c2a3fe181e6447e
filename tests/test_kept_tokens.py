"""Kept-token compute: on one rank holding every expert (`local_plan`) and under S1 (the uneven
dispatcher's rows grouped by expert) the expert GEMMs see exactly the rows that hold a kept token, and
on one rank computing only those gives the values and gradients of multiplying the whole padded buffer.

The GEMMs' operands are recorded with a TorchDispatchMode (every aten matmul the layer runs,
with its shapes; a grouped GEMM as one GEMM per expert over its offsets): the forward's first
expert GEMM of each local expert has exactly as many
rows as tokens routed and kept for that expert (from the router's own counts, gathered
over the sources), never the padded capacity.
"""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from equivalence import tiny_config
from megatron_moe.moe.layer import MoELayer
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel, local_state
from megatron_moe.testing import spawn

B = 2
MATMULS = {"addmm", "mm", "bmm", "baddbmm"}


class MatmulShapes(TorchDispatchMode):
    """Records (op name, shape of its activation operand, shape of its weight operand, the weight's data
    pointer) of every matmul."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple, tuple, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_grouped_mm" and args[1].dim() == 3:  # [R, K] x [X, K, N]: one GEMM per expert's rows
            a, b = args[0], args[1]
            ends = [0] + (kwargs or {}).get("offs", args[2] if len(args) > 2 else None).tolist()
            for e in range(b.size(0)):
                self.calls.append(("mm", (ends[e + 1] - ends[e], a.size(1)), tuple(b.shape[1:]), (b.data_ptr(), e)))
        elif name in MATMULS:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            self.calls.append((name, tuple(a.shape), tuple(b.shape), b.data_ptr()))
        return func(*args, **(kwargs or {}))


def expert_fc_rows(calls: list, M: int, H_l: int) -> list:
    """Rows of every expert's fc GEMMs of a forward: activation [n, M] (padded: bmm [E_l, N, M]) times
    weight [M, H_l] (the configs keep H_l != M, so the proj GEMMs [n, H_l] x [H_l, M] never match); an
    expert that multiplies several row ranges of a buffer (consecutive GEMMs on the same weight) counts
    their rows together."""
    assert H_l != M
    rows: list = []
    last = None
    for name, a, b, weight in calls:
        if a[-1] != M or b[-2:] != (M, H_l):
            continue
        n = a[-2] if name in ("bmm", "baddbmm") else a[0]
        if weight == last and name not in ("bmm", "baddbmm"):
            rows[-1] += n
        else:
            rows.append(n)
        last = weight
    return rows


def config(schedule: str = "baseline"):
    """The tiny model's MoE layer (M=32) with H=128, top-2, capacity factor 1."""
    cfg = tiny_config(k=2, schedule=schedule, cf=1.0)
    cfg.model.ffn_hidden_size = 128
    return cfg


def layer_input(dp_rank: int, M: int, T: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(100 + dp_rank)
    return torch.randn(B, T, M, generator=g, device="cpu")


def _run(cfg, mp: int, ep: int, esp: int, record: bool, padded: bool = False):
    """One forward + backward of a bare MoE layer: output, input grad, expert grads, GEMM shapes, kept counts.
    `padded`: one rank computes the padded buffer instead of its kept rows (`padded_plan`)."""
    ps = initialize_model_parallel(mp, ep, esp) if mp * ep * esp > 1 else local_state()
    try:
        layer = MoELayer(cfg, ps, seed=7, name="moe", layer_idx=1)
        if padded:
            d = layer.dispatcher
            d.plan = d.padded_plan
        x = layer_input(ps.rank("dp"), cfg.model.hidden_size, cfg.model.seq_length).requires_grad_()
        mode = MatmulShapes()
        with mode if record else contextlib.nullcontext():
            y, aux = layer(x)
        (y.pow(2).sum() + aux).backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        return {
            "y": y.detach(),
            "dx": x.grad.clone(),
            "grads": grads,
            "calls": mode.calls,
            "counts": torch.stack([r.counts for r in layer.router.last_routes]).sum(0),  # this rank's tokens
            "ep": ps.rank("ep"),
            "mp": ps.rank("mp"),
            "esp_size": esp,
        }
    finally:
        if mp * ep * esp > 1:
            destroy_model_parallel()


def test_one_process_expert_gemms_see_exactly_the_kept_rows_and_match_the_padded_compute():
    cfg = config()
    M, H = cfg.model.hidden_size, cfg.model.ffn_hidden_size
    got = _run(cfg, 1, 1, 1, record=True)
    ref = _run(config(), 1, 1, 1, record=True, padded=True)
    counts = got["counts"].tolist()
    fc_rows = expert_fc_rows(got["calls"], M, H)
    assert fc_rows[: len(counts)] == counts  # forward: one fc GEMM per expert, kept rows only
    S, E = B * cfg.model.seq_length, cfg.moe.num_experts
    assert sum(counts) < E * expert_fc_rows(ref["calls"], M, H)[0]  # the padded bmm had padding to skip
    assert sum(counts) < 2 * S  # and tokens were dropped
    torch.testing.assert_close(got["y"], ref["y"], rtol=0, atol=1e-6)
    torch.testing.assert_close(got["dx"], ref["dx"], rtol=0, atol=1e-6)
    for n in ref["grads"]:
        torch.testing.assert_close(got["grads"][n], ref["grads"][n], rtol=0, atol=1e-6, msg=n)


LAYOUTS = [("s1", 1, 2, 1), ("s1", 2, 1, 1)]


def _ranks(rank, world):
    import torch.distributed as dist

    out = []
    for sched, mp, ep, esp in LAYOUTS:
        got = _run(config(sched), mp, ep, esp, record=True)
        every = [None] * world
        dist.all_gather_object(every, {"counts": got["counts"].tolist(), "ep": got["ep"], "mp": got["mp"]})
        got["sources"] = every
        out.append(got)
    return out


def test_s1_expert_gemms_see_exactly_the_kept_rows_of_every_source():
    results = spawn(_ranks, 2)
    for i, (sched, mp, ep, esp) in enumerate(LAYOUTS):
        tag = f"{sched} MP{mp} EP{ep} ESP{esp}"
        cfg = config(sched)
        M, H, E = cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.moe.num_experts
        E_l = E // ep
        for rank in range(2):
            got = results[rank][i]
            fc_rows = expert_fc_rows(got["calls"], M, H // esp)[:E_l]
            lo = got["ep"] * E_l
            # S1 routes MP slices; each source's counts are of its slice, all sources of the EP x ESP group
            # (MP2: the group is one rank; its own slice)
            srcs = [s for s in got["sources"] if mp == 1 or s["mp"] == got["mp"]]
            want = [sum(s["counts"][lo + e] for s in srcs) for e in range(E_l)]
            assert fc_rows == want, f"{tag} rank {rank}: expert GEMM rows {fc_rows} != kept {want}"
