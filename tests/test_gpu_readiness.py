"""What a GPU would show, checked without one: every layout's code path in one process (torch's fake
process group, `megatron_moe.fake_world`) under bf16 autocast, with a dispatch-level spy
(`megatron_moe.opspy.OpSpy`) that sees every GEMM's dtype and every read of device data on the host.

- every GEMM runs in bf16 except the router's gate (fp32 by design: three GEMMs per MoE layer, its
  forward and two gradients), and none writes into an `out=` tensor (autocast never reaches those);
- the MoE layers make no host sync at one process and in the padded-buffer layouts, and one per layer
  (the uneven all-to-all's split sizes, read once for the forward and reused by the backward) where
  tokens travel unevenly;
- both checks fail when the hot path is mutated back: an fp32 `out=` expert GEMM, an added `.tolist()`.

The same report runs on CUDA when a GPU is present (there the dtype and the device of every op are real).
"""

import pytest
import torch

import megatron_moe.moe.dispatcher as dispatcher_mod
import megatron_moe.moe.grouped as grouped_mod
from megatron_moe.fake_world import INFERENCE_LAYOUTS, LAYOUTS, UNEVEN, generate_report, step_report


def expected_syncs(name: str) -> int:
    """Host syncs in the MoE layers of one forward + backward, per MoE layer: zero unless tokens travel unevenly."""
    return 1 if name in UNEVEN else 0


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_gemm_but_the_routers_runs_in_bf16_and_the_host_syncs_are_pinned(name, device):
    r = step_report(name, torch.device(device))
    assert r["high_precision_gemms"] == [], r["high_precision_gemms"]
    assert r["out_gemms"] == [], r["out_gemms"]
    assert r["router_gemms"] == 3 * r["moe_layers"]  # the gate's fp32 GEMMs: there and nowhere else
    assert len(r["moe_syncs"]) == expected_syncs(name) * r["moe_layers"], r["moe_syncs"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(INFERENCE_LAYOUTS))
def test_the_inference_engine_runs_bf16_experts_and_one_host_sync_per_moe_forward(name, device):
    r = generate_report(name, torch.device(device))
    assert r["high_precision_gemms"] == [], r["high_precision_gemms"]
    assert r["router_gemms"] == r["forwards"] * r["moe_layers"]  # the gate's forward GEMM, fp32
    # dropless routing: the uneven all-to-all's split sizes, once per MoE layer forward
    assert len(r["moe_syncs"]) == r["forwards"] * r["moe_layers"], r["moe_syncs"]


def test_an_fp32_out_gemm_in_the_experts_fails_the_dtype_check(monkeypatch):
    def fp32_out_gmm(a, b, offs):  # what the experts did before: per expert, torch.mm(..., out=fp32 buffer)
        a32, b32 = a.float(), b.float()
        ends = [0] + offs.tolist()
        if b.dim() == 3:
            out = torch.empty(a.size(0), b.size(2))
            for e in range(b.size(0)):
                torch.mm(a32[ends[e] : ends[e + 1]], b32[e], out=out[ends[e] : ends[e + 1]])
            return out.to(a.dtype)
        out = torch.zeros(len(ends) - 1, a.size(0), b.size(1))
        for e in range(len(ends) - 1):
            torch.mm(a32[:, ends[e] : ends[e + 1]], b32[ends[e] : ends[e + 1]], out=out[e])
        return out.to(a.dtype)

    monkeypatch.setattr(grouped_mod, "gmm", fp32_out_gmm)
    r = step_report("one-process", torch.device("cpu"))
    assert r["high_precision_gemms"] and r["out_gemms"]
    assert len(r["moe_syncs"]) > 0  # and its per-expert loop read the offsets on the host


def test_a_host_read_added_to_the_one_rank_plan_fails_the_sync_check(monkeypatch):
    plain = dispatcher_mod.local_plan

    def reading_plan(routes, num_experts, Cs):
        plan = plain(routes, num_experts, Cs)
        plan.offs.tolist()  # e.g. a per-expert loop over host counts
        return plan

    monkeypatch.setattr(dispatcher_mod, "local_plan", reading_plan)
    assert len(step_report("one-process", torch.device("cpu"))["moe_syncs"]) == 1
