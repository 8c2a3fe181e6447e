"""Text generation: greedy equals an argmax loop with context cropping, top-k=1 equals greedy, top-p
keeps the nucleus, padded vocabulary ids are never produced, tools/generate.py on any layout."""

import copy
import importlib.util
import os

import pytest
import torch

from megatron_moe import convert as cv
from megatron_moe.config import Config
from megatron_moe.generation import filter_logits, generate, tokenizer_path
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import local_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("generate_tool", os.path.join(ROOT, "tools", "generate.py"))
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

VOCAB, MAX_POS = 100, 16  # padded to 128 by --make-vocab-size-divisible-by


def tiny_config(vocab=VOCAB) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 2, 32, 4, 64
    m.seq_length = m.max_position_embeddings = MAX_POS
    m.vocab_size = vocab
    cfg.moe.num_experts, cfg.moe.moe_router_topk, cfg.train.seed = 4, 2, 7
    return cfg


def tiny_model() -> GPT2MoE:
    return GPT2MoE(tiny_config(), local_state()).eval()


def argmax_loop(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids[-MAX_POS:]]))[0, -1, :VOCAB]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_greedy_is_deterministic_and_equals_an_argmax_loop_past_max_positions():
    model = tiny_model()
    prompt = [5, 17, 3, 99, 42]
    out = generate(model, prompt, 20, temperature=0)  # 25 tokens > 16 positions: cropped
    assert len(out) == 20
    assert out == argmax_loop(model, prompt, 20)
    assert out == generate(model, prompt, 20, temperature=0)


def test_top_k_1_sampling_equals_greedy_and_seeds_are_reproducible():
    model = tiny_model()
    prompt = [1, 2, 3]
    assert generate(model, prompt, 12, temperature=1.0, top_k=1, seed=4) == generate(model, prompt, 12, temperature=0)
    a = generate(model, prompt, 12, temperature=1.5, top_p=0.9, seed=4)
    assert a == generate(model, prompt, 12, temperature=1.5, top_p=0.9, seed=4)


def test_filter_logits_keeps_the_top_k_and_the_top_p_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    inf = float("-inf")
    assert filter_logits(logits, top_k=3).tolist()[3] == inf
    assert torch.isfinite(filter_logits(logits, top_k=3)[:3]).all()
    kept = torch.isfinite(filter_logits(logits, top_p=0.75)).tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.75 <= 0.5 + 0.3
    assert torch.isfinite(filter_logits(logits, top_p=0.4)).tolist() == [True, False, False, False]
    assert torch.isfinite(filter_logits(logits, top_p=1.0)).all()


def test_padded_vocabulary_ids_are_never_generated():
    model = tiny_model()
    with torch.no_grad():  # make every padded id's logit far larger than any real one
        model.ln_f.weight.zero_()
        model.ln_f.bias.fill_(1.0)
        model.wte.weight[VOCAB:] = 1.0
        logits = model(torch.tensor([[1, 2, 3]]))[0, -1]
    assert model.padded_vocab == 128 and logits[VOCAB:].min() > logits[:VOCAB].max() + 20
    for kw in (dict(temperature=0), dict(temperature=1.0), dict(temperature=2.0, top_k=50, top_p=0.99)):
        out = generate(model, [1, 2, 3], 30, seed=1, **kw)
        assert len(out) == 30 and max(out) < VOCAB, kw


def test_bad_sampling_flags_are_named():
    model = tiny_model()
    for kw, flag in (
        (dict(temperature=-1), "--temperature"),
        (dict(top_k=-2), "--top-k"),
        (dict(top_p=0.0), "--top-p"),
    ):
        with pytest.raises(ValueError, match=flag):
            generate(model, [1], 2, **kw)
    with pytest.raises(ValueError, match="tokenizer does not match"):
        generate(model, [VOCAB + 3], 2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tokenizer saved beside a (fake) data prefix, and a model checkpoint sharded MP2xEP2 that
    records that prefix; returns (checkpoint dir, consolidated file, tokenizer, one-process model)."""
    from megatron_moe.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("gen")
    texts = [open(os.path.join(ROOT, "data", "wikitext-sample", "wiki.train.tokens")).read()]  # bundled, fixed
    save_tokenizer(train_tokenizer(texts, 300), root / "corpus_tokenizer")
    tok = load_tokenizer(root / "corpus_tokenizer")
    cfg = tiny_config(tok.vocab_size)
    cfg.data.data_path = str(root / "corpus")
    model = GPT2MoE(cfg, local_state()).eval()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt = cv.FullCheckpoint(cfg, full, cv.structure_specs(cfg), meta={"iteration": 7})
    target, world = cv.target_config(cfg, 2, 2, 1)
    cv.write_sharded(ckpt, str(root / "ckpt"), target, world, progress=False)
    cv.export_file(ckpt, str(root / "model.safetensors"))
    return str(root / "ckpt"), str(root / "model.safetensors"), tok, model


def test_generate_tool_on_a_sharded_checkpoint_and_a_consolidated_file(saved, capsys):
    ckpt, file, tok, model = saved
    assert tokenizer_path(cv.read_sharded(ckpt, progress=False).cfg) == ckpt.replace("ckpt", "corpus_tokenizer")
    prompt = "The tests"
    # The tool serves through the inference engine, which routes dropless (docs/DESIGN.md, Inference): the
    # reference is the same weights with --moe-dropless, not the capacity-1.0 model they were saved from.
    dropless_cfg = copy.deepcopy(model.cfg)
    dropless_cfg.moe.moe_dropless = True
    dropless = GPT2MoE(dropless_cfg, local_state()).eval()
    dropless.load_state_dict(model.state_dict())
    expect = prompt + tok.decode(generate(dropless, tok.encode(prompt), 10, temperature=0, eod=tok.eod))
    for load in (ckpt, file):
        assert tool.main(["--load", load, "--prompt", prompt, "--greedy", "--max-new-tokens", "10"]) == 0
        assert capsys.readouterr().out == expect + "\n"
    assert tool.main(["--load", ckpt, "--prompt", prompt, "--top-k", "1", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == expect + "\n"
    assert tool.main(["--load", ckpt, "--top-p", "1.5"]) == 2
    assert "--top-p" in capsys.readouterr().err
