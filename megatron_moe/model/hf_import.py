"""Hugging Face GPT-2 <-> our full (unsharded) state dict.

HF's Conv1D weights are [in, out] (y = x W + b), ours torch Linear [out, in]; the fused c_attn
[M, 3M] is [q | k | v] along its output, exactly our qkv weight transposed. Our embedding table
is padded to a multiple of --make-vocab-size-divisible-by with zero rows (masked out of the
softmax). MoE blocks are upcycled: every expert starts as the block's MLP, the gate small and
random (seeded).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_moe.config import Config, MoEConfig
from megatron_moe.layers.sharding import seeded_generator


def moe_config(num_experts: int, moe_layer_freq: int, topk: int, capacity_factor: float = 1.0) -> MoEConfig:
    """The MoE section of an imported model, validated by the trainer's own rules (MoEConfig raises
    ValueError naming the flag)."""
    return replace(
        MoEConfig(),
        num_experts=num_experts,
        moe_layer_freq=moe_layer_freq,
        moe_router_topk=topk,
        moe_expert_capacity_factor=capacity_factor,
    )


def config_from_hf(
    hf_config, num_experts: int = 0, moe_layer_freq: int = 2, topk: int = 1, capacity_factor: float = 1.0
) -> Config:
    """Our Config for a transformers GPT2Config (dense unless num_experts > 0)."""
    cfg = Config()
    cfg.moe = moe_config(num_experts, moe_layer_freq, topk, capacity_factor)
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = hf_config.n_layer, hf_config.n_embd, hf_config.n_head
    m.ffn_hidden_size = hf_config.n_inner or 4 * hf_config.n_embd
    m.max_position_embeddings = hf_config.n_positions
    m.seq_length = min(m.seq_length, m.max_position_embeddings) if m.seq_length else m.max_position_embeddings
    m.vocab_size, m.layernorm_epsilon = hf_config.vocab_size, hf_config.layer_norm_epsilon
    m.dropout = 0.0
    return cfg


def _block_map(i: int) -> list[tuple[str, str, bool]]:
    """(our name, HF name, transpose?) of every dense tensor of block i (MLP included)."""
    b, h = f"blocks.{i}.", f"h.{i}."
    pairs = [
        ("ln1", "ln_1", False),
        ("ln2", "ln_2", False),
        ("attn.qkv", "attn.c_attn", True),
        ("attn.proj", "attn.c_proj", True),
        ("mlp.fc", "mlp.c_fc", True),
        ("mlp.proj", "mlp.c_proj", True),
    ]
    out = []
    for ours, theirs, conv1d in pairs:
        out.append((f"{b}{ours}.weight", f"{h}{theirs}.weight", conv1d))
        out.append((f"{b}{ours}.bias", f"{h}{theirs}.bias", False))
    return out


_TOP = [("wpe", "wpe.weight"), ("ln_f.weight", "ln_f.weight"), ("ln_f.bias", "ln_f.bias")]
_EXPERT = [("fc_w", "fc.weight"), ("fc_b", "fc.bias"), ("proj_w", "proj.weight"), ("proj_b", "proj.bias")]


def full_state_from_hf(hf_sd: dict, cfg: Config, seed: int = 0, gate_std: float = 1e-3) -> dict:
    """Map a GPT2LMHeadModel state dict onto our parameter names (full shapes)."""
    sd = {k.removeprefix("transformer."): v.detach().float() for k, v in hf_sd.items()}
    m = cfg.model
    wte = sd["wte.weight"]
    pad = cfg.padded_vocab_size - wte.size(0)
    out = {"wte.weight": torch.cat([wte, wte.new_zeros(pad, wte.size(1))]) if pad else wte.clone()}
    out.update({ours: sd[theirs].clone() for ours, theirs in _TOP})
    for i in range(m.num_layers):
        for ours, theirs, conv1d in _block_map(i):
            out[ours] = sd[theirs].t().contiguous() if conv1d else sd[theirs].clone()
        if cfg.is_moe_layer(i):
            # upcycling: every expert starts as the block's MLP; the gate is small and random
            b, E = f"blocks.{i}.", cfg.moe.num_experts
            gen = seeded_generator(seed, b)
            out[b + "moe.router.gate_w"] = torch.randn((E, m.hidden_size), generator=gen, device="cpu") * gate_std
            for ours, mlp in _EXPERT:
                t = out.pop(f"{b}mlp.{mlp}")
                out[f"{b}moe.experts.{ours}"] = t[None].repeat(E, *([1] * t.dim()))
    return out


def hf_state_from_full(full: dict, cfg: Config) -> dict:
    """Inverse of `full_state_from_hf` for a dense model: a GPT2LMHeadModel state dict."""
    if cfg.moe.num_experts and any(cfg.is_moe_layer(i) for i in range(cfg.model.num_layers)):
        raise ValueError("a model with MoE layers cannot be exported as GPT2LMHeadModel")
    m = cfg.model
    sd = {"transformer.wte.weight": full["wte.weight"][: m.vocab_size].clone()}
    sd.update({"transformer." + theirs: full[ours].clone() for ours, theirs in _TOP})
    for i in range(m.num_layers):
        for ours, theirs, conv1d in _block_map(i):
            sd["transformer." + theirs] = full[ours].t().contiguous() if conv1d else full[ours].clone()
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd
