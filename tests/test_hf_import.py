"""GPT-2 import: our dense model equals transformers' GPT2LMHeadModel; upcycled MoE relations."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.model.hf_import import config_from_hf, full_state_from_hf, hf_state_from_full
from megatron_moe.layers.sharding import load_full_state
from megatron_moe.parallel_state import local_state


def small_hf(seed=0):
    torch.manual_seed(seed)
    hf_cfg = GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=100, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():  # non-zero biases so the mapping of every tensor is exercised
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.02)
    return model


def build_ours(hf, **moe):
    cfg = config_from_hf(hf.config, **moe)
    cfg.model.seq_length = 16
    model = GPT2MoE(cfg, local_state()).eval()
    load_full_state(model, full_state_from_hf(hf.state_dict(), cfg, seed=1), local_state())
    return model


def test_dense_logits_equal_transformers():
    hf = small_hf()
    ours = build_ours(hf)
    ids = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)[..., :100]
        assert (got - ref).abs().max().item() < 1e-5
        # and the loss (padded vocab columns are masked out of the softmax)
        lm, _ = ours(ids[:, :-1], ids[:, 1:])
        ref_loss = torch.nn.functional.cross_entropy(hf(ids[:, :-1]).logits.reshape(-1, 100), ids[:, 1:].reshape(-1))
        assert abs(lm.item() - ref_loss.item()) < 1e-5


def test_upcycled_top2_moe_equals_dense_without_drops():
    hf = small_hf()
    moe = build_ours(hf, num_experts=4, topk=2)
    moe.cfg.moe.moe_expert_capacity_factor = 4.0
    for layer in moe.moe_layers():
        layer.router.cf = 4.0
    dense = build_ours(hf)
    ids = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        d = dense(ids)
        m = moe(ids)
        assert moe.moe_layers()[0].last_stats["dropped"] == 0
        assert (m - d).abs().max().item() < 1e-5


def test_upcycled_top1_moe_output_is_gate_value_times_dense_mlp():
    """Top-1 combine weight is the gate probability (DeepSpeed semantics), so an upcycled
    top-1 layer computes g(x) * MLP(x) rather than MLP(x)."""
    hf = small_hf()
    moe = build_ours(hf, num_experts=4, topk=1)
    dense = build_ours(hf)
    layer, mlp = moe.blocks[1].moe, dense.blocks[1].mlp
    layer.router.cf = 4.0
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        y, _ = layer(x)
        gates = torch.softmax(x.reshape(-1, 32) @ layer.router.gate_w.t(), -1).max(-1).values
        expect = mlp(x).reshape(-1, 32) * gates[:, None]
        assert (y.reshape(-1, 32) - expect).abs().max().item() < 1e-5


def test_export_back_to_hf_roundtrip():
    hf = small_hf()
    ours = build_ours(hf)
    full = {n: p.detach() for n, p in ours.named_parameters()}
    sd = hf_state_from_full(full, ours.cfg)
    hf2 = GPT2LMHeadModel(hf.config).eval()
    missing, unexpected = hf2.load_state_dict(sd, strict=False)
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf2(ids).logits - hf(ids).logits).abs().max().item() < 1e-6
