"""Peak memory per GPU of a candidate: what the model shards to a rank, and what a step keeps alive.

Every term follows what the trainer's code allocates (`Trainer.train_step`: forward and backward of
each micro-batch, `GradSync.finish`, clipping, the optimizer step), checked against the profiled
peak of real CPU runs (`tools/validate_plan_memory.py`) and, for the activations, against the tensors
autograd saves (`torch.autograd.graph.saved_tensors_hooks` plus the tensors custom Functions keep on
their ctx, `tests/test_planner_memory.py`):

  parameters    4 bytes per element this rank holds (`params_per_rank`, fp32 master weights).
  gradients     `GRAD_BYTES` (fp32) per element: autocast's weight gradients are cast back to fp32.
  optimizer     `optimizer_bytes_per_param`: AdamW's exp_avg and exp_avg_sq, SGD's momentum buffer.
  grad_buckets  `GradSync` all-reduces flat fp32 copies of the gradients (`torch.cat` per bucket) and
                keeps every bucket until `finish()` copies them back: a second copy of all gradients
                at the end of the last backward (none under Lina, whose scheduler reduces each
                gradient in place).
  bf16_weights  under bf16 autocast the bf16 cast of every weight a GEMM uses is saved for backward
                (autocast's cached casts, the grouped experts' `.to(dtype)`): 2 bytes per parameter,
                alive from the forward until the backward has used it.
  activations   `activation_bytes`: what one micro-batch's graph keeps for backward.
  workspace     at the start of backward the cross entropy's gradient of the logits (fp32, t x V/MP)
                exists next to the saved logits, and under bf16 its bf16 cast for the head's GEMM: the
                largest transient; the profiled peak sits there when activations dominate.

The peak is not the sum of all terms: `train_step` sets the gradients to None before the first
micro-batch and the backward frees activations as it makes gradients, so the two candidate peaks are
  (a) the start of the last micro-batch's backward: parameters + optimizer + bf16 weights +
      activations + workspace (+ gradients when earlier micro-batches accumulated some), and
  (b) the end of the last backward, in `GradSync.finish`: parameters + optimizer + gradients +
      grad buckets (the first iteration's optimizer step allocates the state next to the same
      gradients, without buckets: never above (b)).
(a) rises further while the last MoE layer's backward runs if its transients (the gradients of the
experts' GELU input and output, 2 R H / ESP, and the layer's expert weight gradients) outweigh the
loss head's saved tensors and workspace freed before it. `memory()["total"]` is the larger.
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
    M, E = m.hidden_size, moe.num_experts
    H = m.ffn_hidden_size or 4 * M
    dense = cfg.padded_vocab_size * M // mp + (m.max_position_embeddings or m.seq_length) * M + 2 * M
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


def activation_bytes(
    cfg: Config, mp: int, ep: int, esp: int, load: float, act_bytes: int, attention_probs: bool = False
) -> dict:
    """Bytes one micro-batch's graph keeps for backward on one rank: {"dense", "moe"} (the loss head
    is in "dense"). `load`: the most loaded expert rank's rows over the mean (the capacity factor
    for capacity buffers, the skew's maximum dropless); `act_bytes`: bytes of an activation element
    (2 under bf16 autocast, else 4). `attention_probs`: the attention runs the math path, which
    keeps the t x a x s probabilities; torch's SDPA on CPU (flash for CPU) and on CUDA
    (flash / memory-efficient) keeps only the fp32 log-sum-exp per row and head.

    t tokens of a micro-batch, M model dim, H FFN dim, a heads, V padded vocabulary, k top-k;
    "fp32" tensors stay 4 bytes under autocast, the others take `act_bytes`:
      every block   the residual stream into ln1 and ln2 (fp32, 2 t M); ln1's output as the qkv
                    GEMM's input (t M, replicated over MP); q, k, v (one 3 t M / MP buffer) and
                    the attention output into proj (t M / MP); the log-sum-exp (fp32, t a / MP)
      dense MLP     ln2's output as fc's input (t M), fc's output and GELU's output (2 t H / MP)
      MoE layer     the router's input, ln2's output (fp32, t M: the gate runs in fp32), the
                    routing tensors (logits, probabilities, top-k indices and weights: fp32 /
                    int64, t (8 E + 32 k) bytes), the combine's expert outputs per choice
                    (k t M), the dispatcher's gather per choice before the expert buffer (k t M;
                    one rank holding every expert uses that gather as the experts' input), and
                    the experts' input, fc output and GELU output (R M + 2 R H / ESP), with R the
                    rows this rank's experts compute: k t (one rank, every choice), else
                    k t x ESP x load (capacity: the padded buffer of C = cf k t / E per expert and
                    routing group; dropless: the most loaded rank's rows)
      loss head     ln_f's input (fp32, t M), the head GEMM's input (t M) and the logits kept by the
                    vocabulary-parallel cross entropy (fp32, t V / MP)
    """
    m, moe = cfg.model, cfg.moe
    t = cfg.train.micro_batch_size * m.seq_length
    M, a, s = m.hidden_size, m.num_attention_heads, m.seq_length
    H = m.ffn_hidden_size or 4 * M
    A, F = act_bytes, 4
    attn = F * 2 * t * M + A * (t * M + 4 * t * M // mp) + F * t * a // mp
    if attention_probs:
        attn += A * t * a * s // mp
    dense_block = attn + A * (t * M + 2 * t * H // mp)
    E, k = moe.num_experts, moe.moe_router_topk
    one_rank = ep * esp == 1  # every expert here: the grouped rows are the gather itself
    rows = k * t if one_rank else k * t * esp * load
    routing = t * (8 * E + 32 * k)
    gather = 0 if one_rank else k * t * M
    moe_block = attn + F * t * M + routing + A * (k * t * M + gather + rows * M + 2 * rows * H // esp) if E else 0
    n_moe = sum(cfg.is_moe_layer(i) for i in range(m.num_layers))
    n_dense = m.num_layers - n_moe
    head = F * t * M + A * t * M + F * t * cfg.padded_vocab_size // mp
    return {"dense": int(n_dense * dense_block + head), "moe": int(n_moe * moe_block)}


def memory(cfg: Config, c: "Candidate", load: float) -> dict:
    """Bytes per rank of each term (module docstring) and "total", the larger of the two peaks."""
    dense, expert = params_per_rank(cfg, c.mp, c.ep, c.esp)
    n = dense + expert
    bf16 = cfg.optim.bf16
    A = 2 if bf16 else 4
    # SDPA keeps no probabilities on either device the trainer runs on: flash on CPU, flash or
    # memory-efficient on CUDA (both save the output and the per-row log-sum-exp only)
    act = activation_bytes(cfg, c.mp, c.ep, c.esp, load, A, attention_probs=False)
    t, vp = cfg.train.micro_batch_size * cfg.model.seq_length, cfg.padded_vocab_size // c.mp
    gb = cfg.train.global_batch_size or cfg.train.micro_batch_size * c.dp
    micro_batches = max(1, gb // (cfg.train.micro_batch_size * c.dp))
    out = {
        "parameters": 4 * n,
        "gradients": GRAD_BYTES * n,
        "optimizer": optimizer_bytes_per_param(cfg) * n,
        "grad_buckets": 0 if c.opts.get("lina") else GRAD_BYTES * n,
        "bf16_weights": 2 * n if bf16 else 0,
        "activations": act["dense"] + act["moe"],
        "workspace": 4 * t * vp + (A * t * vp if bf16 else 0),
    }
    backward_start = (
        out["parameters"]
        + out["optimizer"]
        + out["bf16_weights"]
        + out["activations"]
        + out["workspace"]
        + (out["gradients"] if micro_batches > 1 else 0)
    )
    # (c) the last MoE layer's backward: the head's saved tensors are freed, the experts' gradients
    # of the GELU input and output (2 R H / ESP) and that layer's expert weight gradients exist
    m, moe = cfg.model, cfg.moe
    n_moe = sum(cfg.is_moe_layer(i) for i in range(m.num_layers))
    expert_backward = 0
    if n_moe:
        H, k = m.ffn_hidden_size or 4 * m.hidden_size, moe.moe_router_topk
        rows = k * t if c.ep * c.esp == 1 else k * t * c.esp * load
        head = (4 + A) * t * m.hidden_size + 4 * t * vp
        expert_backward = int(2 * A * rows * H // c.esp + GRAD_BYTES * expert // n_moe - head - out["workspace"])
    backward_end = out["parameters"] + out["optimizer"] + out["gradients"] + out["grad_buckets"]
    out["total"] = max(backward_start + max(expert_backward, 0), backward_end)
    return out
