"""Memory per GPU of a candidate: what the model shards to a rank, and what a micro-batch keeps.

Parameters, gradients and optimizer state are counted like the model shards them (`params_per_rank`
follows `model.gpt2`, `moe.experts` and `layers.tensor_parallel`); bf16 autocast adds a bf16 copy of
each weight; activations are what one micro-batch keeps for backward (`activation_bytes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_moe.config import Config

if TYPE_CHECKING:
    from megatron_moe.planner.predict import Candidate

GRAD_BYTES = 4  # gradients and master weights stay fp32 (bf16 is autocast)


def params_per_rank(cfg: Config, mp: int, ep: int, esp: int) -> tuple[int, int]:
    """(dense, expert) parameter elements one rank holds, as the model shards them."""
    m, moe = cfg.model, cfg.moe
    M, H, E = m.hidden_size, m.ffn_hidden_size, moe.num_experts
    dense = cfg.padded_vocab_size * M // mp + m.max_position_embeddings * M + 2 * M
    expert = 0
    for i in range(m.num_layers):
        dense += 4 * M + 3 * M * M // mp + 3 * M // mp + M * M // mp + M
        if cfg.is_moe_layer(i):
            dense += E * M
            expert += (E // ep) * (2 * M * H // esp + H // esp + M // esp)
        else:
            dense += 2 * M * H // mp + H // mp + M
    return dense, expert


def optimizer_bytes_per_param(cfg: Config) -> int:
    """fp32 state per parameter: AdamW's two moments, SGD's momentum (none without momentum)."""
    if cfg.optim.optimizer == "adamw":
        return 8
    return 4 if cfg.optim.sgd_momentum else 0


def activation_bytes(cfg: Config, mp: int, ep: int, esp: int, load: float, act_bytes: int) -> dict:
    """Bytes one micro-batch keeps for backward on one rank: {"dense", "moe"}. `load`: the most
    loaded expert's share over the mean (the capacity factor for capacity runs, the skew's maximum
    dropless); `act_bytes`: bytes per activation element (2 under bf16 autocast, else 4).

    Per block (t tokens, M model dim, H FFN dim, a heads, s sequence): the two LayerNorm inputs and
    outputs and the residual, 5 t M replicated over MP; attention's q, k, v, output and the
    projection input, 5 t M / MP, and the attention probabilities t a s / MP kept by the math
    kernel (the CPU path; flash attention on a GPU keeps only the per-row log-sum-exp); a dense MLP's
    fc1 output and GELU output, 2 t H / MP. An MoE layer instead keeps the routing (t x E logits
    and probabilities), the dispatch buffer in and out of the all-to-all and the expert input,
    4 x rows x M / ESP-shared, and the experts' fc1 and GELU outputs, 2 x rows x H / ESP, where
    rows = k t x load x E_local / E x EP (the tokens this rank's experts receive).
    """
    m, moe = cfg.model, cfg.moe
    t = cfg.train.micro_batch_size * m.seq_length
    M, H, a, s = m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.seq_length
    on_gpu = cfg.parallel.device == "cuda"
    attn = 5 * t * M // mp + (0 if on_gpu else t * a * s // mp * 2)
    dense_block = 5 * t * M + attn + 2 * t * H // mp
    E, k = moe.num_experts, moe.moe_router_topk
    rows = k * t * load * esp  # tokens (all ESP ranks' routing groups) this rank's experts compute
    moe_block = 5 * t * M + attn + 2 * t * E + 4 * rows * M + 2 * rows * H // esp if E else 0
    n_moe = sum(cfg.is_moe_layer(i) for i in range(m.num_layers))
    n_dense = m.num_layers - n_moe
    logits = t * cfg.padded_vocab_size // mp * 2  # logits and their softmax for the loss
    return {
        "dense": act_bytes * (n_dense * dense_block + logits),
        "moe": act_bytes * n_moe * moe_block,
    }


def memory(cfg: Config, c: "Candidate", load: float) -> dict:
    """Bytes per rank: parameters, gradients, optimizer, bf16 weight copies, activations, total."""
    dense, expert = params_per_rank(cfg, c.mp, c.ep, c.esp)
    n = dense + expert
    bf16 = cfg.optim.bf16
    act = activation_bytes(cfg, c.mp, c.ep, c.esp, load, 2 if bf16 else 4)
    out = {
        "parameters": 4 * n,
        "gradients": GRAD_BYTES * n,
        "optimizer": optimizer_bytes_per_param(cfg) * n,
        "bf16_weights": 2 * n if bf16 else 0,
        "activations": act["dense"] + act["moe"],
    }
    out["total"] = sum(out.values())
    return out
