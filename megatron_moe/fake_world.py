"""Every layout's code path in one process: torch's fake process group plays rank r of a world.

Collectives of the "fake" backend return at once without moving data, but every op runs for real
with the shapes, dtypes and devices rank r would see. Values mean nothing; a run shows which GEMMs
run in which dtype and how often device data is read on the host (`opspy.OpSpy`). `step_report`
runs one training step under a layout of `LAYOUTS` (`tools/check_layouts.py` prints them all).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_moe import choose
from megatron_moe.opspy import OpSpy


@dataclass(frozen=True)
class Layout:
    mp: int = 1
    ep: int = 1
    esp: int = 1
    moe: dict = field(default_factory=dict)  # MoEConfig overrides
    lina_chunks: int = 1  # Lina's pipelined all-to-all chunks (`MoELayer.set_pipeline_chunks`)
    opts: dict = field(default_factory=dict)  # OptimizationsConfig overrides, applied by `optimizations.apply`
    rank: int = 3  # the rank played (Lancet's planner runs on rank 0 and broadcasts its plan: rank 0 there)
    dp_world: bool = False  # MP = EP = ESP = 1 in a world of WORLD ranks (data parallel only)
    forced: dict = field(default_factory=dict)  # `choose.override` picks, e.g. {"lancet partitions": "2"}
    plan: Optional[dict] = None  # Pro-Prophet's fixed placement {expert: EP ranks} (`optimizations.apply`)


WORLD = 8
LAYOUTS: dict[str, Layout] = {
    "one-process": Layout(),
    "one-process-top1": Layout(moe={"moe_router_topk": 1}),
    "one-process-dropless": Layout(moe={"moe_dropless": True}),
    "DP8": Layout(dp_world=True),
    "MP2": Layout(mp=2),
    "EP2": Layout(ep=2),
    "ESP2": Layout(esp=2),
    "MP2xESP2": Layout(mp=2, esp=2),
    "MP2xEP2": Layout(mp=2, ep=2),
    "EP8": Layout(ep=8),
    "MP2xEP4": Layout(mp=2, ep=4),
    "MP4xEP2": Layout(mp=4, ep=2),
    "EP4xESP2": Layout(ep=4, esp=2),
    "MP2xEP2xESP2": Layout(mp=2, ep=2, esp=2),
    "MP2xEP4-S1": Layout(mp=2, ep=4, moe={"moe_schedule": "s1"}),
    "MP2xEP4-S2": Layout(mp=2, ep=4, moe={"moe_schedule": "s2"}),
    "EP4-dropless": Layout(ep=4, moe={"moe_dropless": True}),
    "MP2xEP4-dropless-S1": Layout(mp=2, ep=4, moe={"moe_dropless": True, "moe_schedule": "s1"}),
    "EP4-lina-chunks": Layout(ep=4, lina_chunks=2),
    "EP4-lancet-parts": Layout(
        ep=4, opts={"lancet_partition": True, "measure_iters": 0}, forced={"lancet partitions": "2"}, rank=0
    ),
    "EP4-lancet-wgrad": Layout(ep=4, opts={"lancet_wgrad": True, "measure_iters": 0}, rank=0),
    "EP4-dropless-pro-prophet": Layout(
        ep=4,
        moe={"moe_dropless": True},
        opts={"pro_prophet": True},
        plan={0: [1], 2: [2], 4: [3], 6: [0]},
    ),
}
# uneven all-to-alls need their split sizes on the host: one read per layer forward, none in backward
UNEVEN = {"MP2xEP4-S1", "EP4-dropless", "MP2xEP4-dropless-S1", "EP4-lancet-parts", "EP4-dropless-pro-prophet"}


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """torch.distributed on the fake backend as `rank` of `world_size` (nothing else may be initialized)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        from megatron_moe.parallel_state import destroy_model_parallel

        destroy_model_parallel()
        dist.destroy_process_group()


def small_config(**moe):
    """A 2-block GPT-2 MoE (block 1 MoE): M=64, 4 heads, H=128, T=32, vocab 128, E=8, top-2, capacity 1.25."""
    from megatron_moe.config import Config

    cfg = Config()
    m = cfg.model
    m.vocab_size, m.num_layers, m.hidden_size, m.num_attention_heads = 128, 2, 64, 4
    m.ffn_hidden_size, m.seq_length, m.max_position_embeddings = 128, 32, 32
    c = cfg.moe
    c.num_experts, c.moe_router_topk, c.moe_expert_capacity_factor, c.moe_min_capacity = 8, 2, 1.25, 1
    c.moe_schedule = "baseline"
    for k, v in moe.items():
        setattr(c, k, v)
    cfg.train.seed = 3
    return cfg


def step_report(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """One forward + backward of `small_config` under layout `name` on `device` and `dtype` autocast:
    {layout, gemms, high_precision_gemms, moe_syncs, syncs, moe_layers, ...} of the second step."""
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.parallel_state import initialize_model_parallel, local_state

    from megatron_moe.distributed.grad_sync import GradSync
    from megatron_moe.optimizations import apply

    lay = LAYOUTS[name]
    one = lay.mp * lay.ep * lay.esp == 1 and not lay.dp_world
    cfg = small_config(**lay.moe)
    for k, v in lay.opts.items():
        setattr(cfg.opts, k, v)
    par = cfg.parallel
    par.tensor_model_parallel_size, par.expert_model_parallel_size = lay.mp, lay.ep
    par.expert_sharding_parallel_size = lay.esp
    with contextlib.ExitStack() as stack:
        for decision, pick in lay.forced.items():
            stack.enter_context(choose.override(decision, pick=pick))
        if one:
            ps = local_state(device)
        else:
            stack.enter_context(fake_world(lay.rank, WORLD))
            ps = initialize_model_parallel(lay.mp, lay.ep, lay.esp, device=device)
        model = GPT2MoE(cfg, ps).to(device)
        for layer in model.moe_layers():
            layer.set_pipeline_chunks(lay.lina_chunks)
        applied = apply(model, ps, cfg, GradSync(model, ps), lay.plan) if lay.opts else None
        lancet = applied.lancet if applied is not None else None
        B, T = 2, cfg.model.seq_length
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g, device="cpu").to(device)
        spy = OpSpy()
        for measured in (False, True):
            with spy if measured else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=dtype):
                    lm, aux = model(ids[:, :-1], ids[:, 1:])
                if lancet is not None:
                    lancet.backward(lm + aux)  # deferred dW under the all-to-alls, then flushed
                else:
                    (lm + aux).backward()
            model.zero_grad(set_to_none=True)
        return {
            "layout": name,
            "device": str(device),
            "moe_layers": len(model.moe_layers()),
            "gemms": len(spy.gemms),
            **_spied(spy, cfg.moe.num_experts),
            "out_gemms": [f"{g.op} at {g.where}" for g in spy.gemms if g.out_arg],
        }


def _spied(spy: OpSpy, num_experts: int) -> dict:
    """The GEMM and sync counts of a report. The router's gate runs in fp32 by design: its GEMMs
    are counted apart (`router_gemms`), the other high-precision ones are listed."""
    high = spy.high_precision_gemms()
    return {
        "router_gemms": sum(1 for g in high if _is_router(g.shapes, num_experts)),
        "high_precision_gemms": [
            f"{g.op} {g.dtypes} {g.shapes} at {g.where}" for g in high if not _is_router(g.shapes, num_experts)
        ],
        "moe_syncs": [f"{what} at {where}" for what, where in spy.syncs_in("megatron_moe/moe/")],
        "syncs": len(spy.syncs),
    }


def _is_router(shapes: tuple, num_experts: int) -> bool:
    """A GEMM of the gate (x W_g^T and its two gradients): an operand has a dimension of E (no other GEMM
    of `small_config` does)."""
    return any(num_experts in s for s in shapes)


INFERENCE_LAYOUTS = {"infer-EP4": Layout(ep=4), "infer-MP2xEP2xESP2": Layout(mp=2, ep=2, esp=2)}


def generate_report(name: str, device: torch.device, new_tokens: int = 4, dtype: torch.dtype = torch.bfloat16) -> dict:
    """`step_report` of the inference engine under layout `name` of INFERENCE_LAYOUTS: two prompts,
    `new_tokens` greedy tokens each."""
    from megatron_moe.inference.engine import InferenceEngine, inference_config
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.parallel_state import initialize_model_parallel

    lay = INFERENCE_LAYOUTS[name]
    with fake_world(lay.rank, WORLD):
        ps = initialize_model_parallel(lay.mp, lay.ep, lay.esp, device=device)
        cfg = small_config()
        model = GPT2MoE(inference_config(cfg, ps), ps).to(device).eval()
        engine = InferenceEngine(model)
        spy = OpSpy()
        with spy, torch.autocast(device.type, dtype=dtype):
            engine.generate([[1, 2, 3], [4, 5]], new_tokens)
        return {
            "layout": name,
            "device": str(device),
            "forwards": new_tokens,  # the prompt's forward, then one per new token but the last
            "moe_layers": len(model.moe_layers()),
            **_spied(spy, cfg.moe.num_experts),
        }
