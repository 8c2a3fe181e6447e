"""Hugging Face GPT-2 <-> our full (unsharded) state dict.

HF's GPT-2 stores Conv1D weights as [in, out] (y = x W + b); ours are
torch Linear layout [out, in]. The fused c_attn [M, 3M] is [q | k | v] along
its output, which is exactly our qkv weight transposed. Our embedding table is
padded to a multiple of --make-vocab-size-divisible-by with zero rows (those
columns are masked out of the softmax, so logits of real tokens are equal).

MoE blocks are "upcycled": every expert starts as a copy of the block's MLP
and the gate is small and random (seeded), as in sparse upcycling.
"""
from __future__ import annotations

import torch

from megatron_moe.config import Config
from megatron_moe.model.sharding import seeded_generator


def config_from_hf(hf_config, num_experts: int = 0, moe_layer_freq: int = 2, topk: int = 1) -> Config:
    """Our Config for a transformers GPT2Config (dense unless num_experts > 0)."""
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = hf_config.n_layer, hf_config.n_embd, hf_config.n_head
    m.ffn_hidden_size = hf_config.n_inner or 4 * hf_config.n_embd
    m.max_position_embeddings = hf_config.n_positions
    m.seq_length = min(m.seq_length, m.max_position_embeddings) if m.seq_length else m.max_position_embeddings
    m.vocab_size, m.layernorm_epsilon = hf_config.vocab_size, hf_config.layer_norm_epsilon
    m.dropout = 0.0
    cfg.moe.num_experts, cfg.moe.moe_layer_freq, cfg.moe.moe_router_topk = num_experts, moe_layer_freq, topk
    return cfg


def full_state_from_hf(hf_sd: dict, cfg: Config, seed: int = 0, gate_std: float = 1e-3) -> dict:
    """Map a GPT2LMHeadModel state dict onto our parameter names (full shapes)."""
    sd = {k.removeprefix("transformer."): v.detach().float() for k, v in hf_sd.items()}
    m = cfg.model
    out = {}
    wte = sd["wte.weight"]
    pad = cfg.padded_vocab_size - wte.size(0)
    out["wte.weight"] = torch.cat([wte, wte.new_zeros(pad, wte.size(1))]) if pad else wte.clone()
    out["wpe"] = sd["wpe.weight"].clone()
    for i in range(m.num_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[b + ours + ".weight"] = sd[h + theirs + ".weight"].clone()
            out[b + ours + ".bias"] = sd[h + theirs + ".bias"].clone()
        out[b + "attn.qkv.weight"] = sd[h + "attn.c_attn.weight"].t().contiguous()
        out[b + "attn.qkv.bias"] = sd[h + "attn.c_attn.bias"].clone()
        out[b + "attn.proj.weight"] = sd[h + "attn.c_proj.weight"].t().contiguous()
        out[b + "attn.proj.bias"] = sd[h + "attn.c_proj.bias"].clone()
        fc_w, fc_b = sd[h + "mlp.c_fc.weight"].t().contiguous(), sd[h + "mlp.c_fc.bias"]
        pr_w, pr_b = sd[h + "mlp.c_proj.weight"].t().contiguous(), sd[h + "mlp.c_proj.bias"]
        if cfg.is_moe_layer(i):
            E = cfg.moe.num_experts
            out[b + "moe.gate_w"] = torch.randn((E, m.hidden_size), generator=seeded_generator(seed, b)) * gate_std
            out[b + "moe.experts.fc_w"] = fc_w[None].repeat(E, 1, 1)
            out[b + "moe.experts.fc_b"] = fc_b[None].repeat(E, 1)
            out[b + "moe.experts.proj_w"] = pr_w[None].repeat(E, 1, 1)
            out[b + "moe.experts.proj_b"] = pr_b[None].repeat(E, 1)
        else:
            out[b + "mlp.fc.weight"], out[b + "mlp.fc.bias"] = fc_w, fc_b.clone()
            out[b + "mlp.proj.weight"], out[b + "mlp.proj.bias"] = pr_w, pr_b.clone()
    out["ln_f.weight"], out["ln_f.bias"] = sd["ln_f.weight"].clone(), sd["ln_f.bias"].clone()
    return out


def hf_state_from_full(full: dict, cfg: Config) -> dict:
    """Inverse of `full_state_from_hf` for a dense model: a GPT2LMHeadModel state dict."""
    if cfg.moe.num_experts and any(cfg.is_moe_layer(i) for i in range(cfg.model.num_layers)):
        raise ValueError("a model with MoE layers cannot be exported as GPT2LMHeadModel")
    m = cfg.model
    sd = {"transformer.wte.weight": full["wte.weight"][: m.vocab_size].clone(),
          "transformer.wpe.weight": full["wpe"].clone()}
    for i in range(m.num_layers):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            sd[h + theirs + ".weight"] = full[b + ours + ".weight"].clone()
            sd[h + theirs + ".bias"] = full[b + ours + ".bias"].clone()
        sd[h + "attn.c_attn.weight"] = full[b + "attn.qkv.weight"].t().contiguous()
        sd[h + "attn.c_attn.bias"] = full[b + "attn.qkv.bias"].clone()
        sd[h + "attn.c_proj.weight"] = full[b + "attn.proj.weight"].t().contiguous()
        sd[h + "attn.c_proj.bias"] = full[b + "attn.proj.bias"].clone()
        sd[h + "mlp.c_fc.weight"] = full[b + "mlp.fc.weight"].t().contiguous()
        sd[h + "mlp.c_fc.bias"] = full[b + "mlp.fc.bias"].clone()
        sd[h + "mlp.c_proj.weight"] = full[b + "mlp.proj.weight"].t().contiguous()
        sd[h + "mlp.c_proj.bias"] = full[b + "mlp.proj.bias"].clone()
    sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"] = full["ln_f.weight"].clone(), full["ln_f.bias"].clone()
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd
