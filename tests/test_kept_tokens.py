"""Kept-token compute: the expert GEMMs see exactly the rows that hold a kept token, and
computing only those gives the values and gradients of multiplying the whole padded buffer.

The GEMMs' operands are recorded with a TorchDispatchMode (every aten matmul the layer runs,
with its shapes; a grouped GEMM as one GEMM per expert over its offsets): the forward's first
expert GEMM of each local expert has exactly as many
rows as tokens routed and kept for that expert (from the router's own counts, gathered
over the sources), never the padded capacity.
"""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from equivalence import MICRO_BATCH, run_layout, tiny_config
from megatron_moe.moe.kept import (
    header_int,
    header_rows,
    padded_kept_rows,
    read_header,
    received_kept_rows,
    write_header,
)
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
        self.outputs: list[tuple[str, tuple]] = []  # (op name, output shape) of every op

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
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.outputs.append((name, tuple(out.shape)))
        return out


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


def graph_nodes(fn) -> set:
    """The type names of every autograd node reachable from `fn`."""
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if f is not None and f not in seen:
            seen.add(f)
            todo += [n for n, _ in f.next_functions]
    return {type(f).__name__ for f in seen}


def config(schedule: str = "baseline"):
    """The tiny model's MoE layer (M=32) with H=128, top-2, capacity factor 1."""
    cfg = tiny_config(k=2, schedule=schedule, cf=1.0, moe_expert_path="kept")  # auto would pick padded at cf 1
    cfg.model.ffn_hidden_size = 128
    return cfg


def layer_input(dp_rank: int, M: int, T: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(100 + dp_rank)
    return torch.randn(B, T, M, generator=g, device="cpu")


def _run(cfg, mp: int, ep: int, esp: int, kept_only: bool, record: bool):
    """One forward + backward of a bare MoE layer: output, input grad, expert grads, GEMM shapes, kept counts."""
    ps = initialize_model_parallel(mp, ep, esp) if mp * ep * esp > 1 else local_state()
    try:
        cfg.moe.moe_kept_only = kept_only
        layer = MoELayer(cfg, ps, seed=7, name="moe", layer_idx=1)
        x = layer_input(ps.rank("dp"), cfg.model.hidden_size, cfg.model.seq_length).requires_grad_()
        mode = MatmulShapes()
        with mode if record else contextlib.nullcontext():
            y, aux = layer(x)
        nodes = graph_nodes(y.grad_fn)
        (y.pow(2).sum() + aux).backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        return {
            "y": y.detach(),
            "dx": x.grad.clone(),
            "grads": grads,
            "calls": mode.calls,
            "outputs": mode.outputs,
            "nodes": nodes,
            "counts": torch.stack([r.counts for r in layer.router.last_routes]).sum(0),  # this rank's tokens
            "ep": ps.rank("ep"),
            "mp": ps.rank("mp"),
            "esp_size": esp,
        }
    finally:
        if mp * ep * esp > 1:
            destroy_model_parallel()


def test_padded_kept_rows_are_each_blocks_leading_rows():
    # 2 sources, 1 group, 4 experts, 2 local on EP rank 1, blocks of 3 slots
    rows_DGE = torch.tensor([[[1, 0, 2, 3]], [[0, 1, 0, 2]]])
    kept = padded_kept_rows(rows_DGE, ep_rank=1, num_local=2, block=3, device=torch.device("cpu"))
    # expert 2: source 0 rows 0,1; source 1 none; expert 3 (row base 6): source 0 rows 6,7,8; source 1 rows 9,10
    assert kept.rows.tolist() == [0, 1, 6, 7, 8, 9, 10]
    assert kept.counts == [2, 5]


def test_received_kept_rows_follow_the_source_blocks_and_skip_their_header_rows():
    g = torch.Generator(device="cpu").manual_seed(3)
    D, G, E, L, block = 2, 2, 4, 2, 5  # 2 sources, 2 groups, EP rank 1 holds experts 2, 3
    rows_DGE = torch.randint(0, block + 1, (D, G, E), generator=g, device="cpu")
    ref = padded_kept_rows(rows_DGE, ep_rank=1, num_local=L, block=block, device=torch.device("cpu"), n_esp=1)
    body = L * G * block
    got = received_kept_rows(rows_DGE[:, :, L:], block, body, torch.device("cpu"))  # no header: the same layout
    assert (got.rows.tolist(), got.counts) == (ref.rows.tolist(), ref.counts)
    # with h header rows after each source's block, source d's rows move by d * h
    h = 3
    shifted = received_kept_rows(rows_DGE[:, :, L:], block, body + h, torch.device("cpu"))
    assert shifted.rows.tolist() == [r + (r // body) * h for r in ref.rows.tolist()]
    assert shifted.counts == ref.counts


def test_counts_written_into_a_buffers_header_rows_read_back_exactly():
    counts = torch.tensor([[0, 7, 300, 5], [1000, 2, 0, 33]], dtype=torch.int64, device="cpu")  # [D=2, 4]
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        itype = header_int(dtype, 1000)
        assert itype is not None and torch.iinfo(itype).bits == 8 * dtype.itemsize
        body, M = 3, 3  # 4 counts in rows of 3: two header rows
        h = header_rows(counts.size(1), M)
        buf = torch.randn(2, body + h, M, device="cpu").to(dtype)
        before = buf[:, :body].clone()
        write_header(buf, counts, body, itype)
        assert h == 2 and torch.equal(read_header(buf, body, 4, itype), counts), dtype
        assert torch.equal(buf[:, :body], before), dtype  # the slots are untouched
    assert header_int(torch.bfloat16, 40000) is None and header_int(torch.float32, 40000) is torch.int32


def test_one_process_expert_gemms_see_exactly_the_kept_rows_and_match_the_padded_compute():
    cfg = config()
    M, H = cfg.model.hidden_size, cfg.model.ffn_hidden_size
    got = _run(cfg, 1, 1, 1, kept_only=True, record=True)
    ref = _run(config(), 1, 1, 1, kept_only=False, record=True)
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


LAYOUTS = [
    ("baseline", 1, 2, 1),
    ("baseline", 1, 1, 2),
    ("s2", 1, 2, 1),
    ("s2", 2, 1, 1),
    ("s1", 1, 2, 1),
    ("s1", 2, 1, 1),
]


def _ranks(rank, world):
    import torch.distributed as dist

    out = []
    for sched, mp, ep, esp in LAYOUTS:
        cfg = config(sched)
        got = _run(cfg, mp, ep, esp, kept_only=True, record=True)
        ref = _run(config(sched), mp, ep, esp, kept_only=False, record=False)
        every = [None] * world
        dist.all_gather_object(every, {"counts": got["counts"].tolist(), "ep": got["ep"], "mp": got["mp"]})
        got["sources"] = every
        out.append((got, ref))
    return out


def test_two_process_expert_gemms_see_exactly_the_kept_rows_of_every_source():
    results = spawn(_ranks, 2)
    for i, (sched, mp, ep, esp) in enumerate(LAYOUTS):
        tag = f"{sched} MP{mp} EP{ep} ESP{esp}"
        cfg = config(sched)
        M, H, E = cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.moe.num_experts
        E_l = E // ep
        S = B * cfg.model.seq_length
        C = -(-2 * S // E)  # capacity: ceil(k * cf * S / E), cf = 1
        C_mp = -(-C // mp)
        for rank in range(2):
            got, ref = results[rank][i]
            fc_rows = expert_fc_rows(got["calls"], M, H // esp)[:E_l]
            lo = got["ep"] * E_l
            if sched == "s1":
                # S1 routes MP slices; each source's counts are of its slice, all sources of the EP x ESP group
                # (MP2: the group is one rank; its own slice)
                srcs = [s for s in got["sources"] if mp == 1 or s["mp"] == got["mp"]]
                want = [sum(s["counts"][lo + e] for s in srcs) for e in range(E_l)]
            elif sched == "s2":
                # each source sends its MP rank's share of every expert's slots: [r*C_mp, (r+1)*C_mp)
                srcs = [s for s in got["sources"] if mp == 1 or s["mp"] == got["mp"]]
                want = [sum(min(max(s["counts"][lo + e] - s["mp"] * C_mp, 0), C_mp) for s in srcs) for e in range(E_l)]
            else:
                srcs = got["sources"] if ep * esp > 1 else [got["sources"][rank]]
                want = [sum(s["counts"][lo + e] for s in srcs) for e in range(E_l)]
            assert fc_rows == want, f"{tag} rank {rank}: expert GEMM rows {fc_rows} != kept {want}"
            if (sched, esp) == ("baseline", 1) and ep > 1:  # the send buffer with header rows is the only one
                # `dispatch`'s zero-filled [E*C, M] buffer (the kept rows may have its shape: fills only)
                fills = ("new_zeros", "zeros", "index_copy_", "index_copy")
                padded = [op for op, shape in got["outputs"] if shape == (E * C, M) and op in fills]
                assert not padded, f"{tag}: the forward also built the unused padded buffer {padded}"
                # the counts written into the send buffer leave its backward a plain view (no as_strided copy)
                assert "AsStridedBackward0" not in got["nodes"] and "_PackRowsBackward" in got["nodes"], tag
            torch.testing.assert_close(got["y"], ref["y"], rtol=0, atol=1e-6, msg=tag)
            torch.testing.assert_close(got["dx"], ref["dx"], rtol=0, atol=1e-6, msg=tag)
            for n in ref["grads"]:
                torch.testing.assert_close(got["grads"][n], ref["grads"][n], rtol=0, atol=1e-6, msg=f"{tag} {n}")


def _header_records(rank, world):
    res = run_layout(tiny_config(k=2, moe_expert_path="kept"), 1, 2, 1)
    return [(r.op, r.group, r.sent) for r in res["records"]]


def test_baseline_with_one_esp_rank_sends_the_counts_in_its_dispatch_all_to_all():
    cfg = tiny_config(k=2, moe_expert_path="kept")
    S, E, M = MICRO_BATCH * cfg.model.seq_length, cfg.moe.num_experts, cfg.model.hidden_size
    C = max(-(-2 * int(cfg.moe.moe_expert_capacity_factor * S) // E), cfg.moe.moe_min_capacity)
    ep, E_l = 2, E // 2
    h = header_rows(E_l, M)  # one routing group: E_l counts per destination
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.model.num_layers))
    for recs in spawn(_header_records, 2):
        a2a = sorted(s for o, g, s in recs if o == "all_to_all" and g == "ep")
        # 4 all-to-alls per layer, each of every destination's E_l * C slots plus its header rows
        assert a2a == [ep * (E_l * C + h) * M * 4] * (4 * moe_layers)
        assert not [r for r in recs if r[0] == "all_gather"]  # no count exchange of its own


# ----------------------------------------------------------------------------- the experts' path


def test_auto_takes_kept_rows_on_one_rank_and_the_padded_buffer_on_several():
    from megatron_moe.fake_world import fake_world

    def path(cfg, ps):
        layer = MoELayer(cfg, ps, seed=7, name="moe", layer_idx=1)
        return layer.expert_path(layer.dispatcher)

    assert path(tiny_config(k=2, cf=1.25), local_state()) == "kept"  # no buffer, no host sync
    assert path(tiny_config(k=2, cf=1.25, moe_kept_only=False), local_state()) == "padded"
    assert path(tiny_config(k=2, cf=1.25, moe_dropless=True), local_state()) == "kept"  # the one-rank plan
    with fake_world(0, 2):
        ps = initialize_model_parallel(1, 2, 1)
        assert path(tiny_config(k=2, cf=1.25), ps) == "padded"  # kept rows would need the counts on the host
        for forced in ("kept", "overlap", "padded"):
            assert path(tiny_config(k=2, cf=1.25, moe_expert_path=forced), ps) == forced


def _path_ranks(rank, world):
    """EP2 baseline, capacity factor 1.25: a layer on each expert path against a --no-moe-kept-only
    layer, forward + backward on the same inputs (different on each rank)."""
    ps = initialize_model_parallel(1, 2, 1)
    try:
        out = {}
        for path in ("auto", "kept", "overlap"):
            cfg, ref_cfg = config(), config()
            for c in (cfg, ref_cfg):
                c.moe.moe_expert_capacity_factor, c.moe.moe_expert_path = 1.25, path
            cfg.moe.moe_kept_only, ref_cfg.moe.moe_kept_only = True, False
            layer = MoELayer(cfg, ps, seed=7, name="moe", layer_idx=1)
            ref = MoELayer(ref_cfg, ps, seed=7, name="moe", layer_idx=1)
            for call in range(2):
                g = torch.Generator(device="cpu").manual_seed(1000 * call + 13 * rank)
                x = torch.randn(B, cfg.model.seq_length, cfg.model.hidden_size, generator=g, device="cpu")
                got = []
                for lay in (layer, ref):
                    xi = x.clone().requires_grad_()
                    y, aux = lay(xi)
                    (y.pow(2).sum() + aux).backward()
                    got.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in lay.named_parameters()}))
                    lay.zero_grad(set_to_none=True)
                out[(path, call)] = (got, layer.path_last)
        return out
    finally:
        destroy_model_parallel()


def test_every_expert_path_equals_the_padded_layer_on_ep2():
    for rank, calls in enumerate(spawn(_path_ranks, 2)):
        for (path, call), ((got, ref), taken) in calls.items():
            assert taken == ("padded" if path == "auto" else path)
            tag = f"rank {rank} path {path} call {call}"
            torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-6, msg=tag)
            torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-6, msg=tag)
            for n in ref[2]:
                torch.testing.assert_close(got[2][n], ref[2][n], rtol=0, atol=1e-6, msg=f"{tag} {n}")
