"""Inference engine (megatron_moe/inference/): KV-cache decode equals full recomputation, greedy
generation under MP2, EP2, ESP2 and MP2 x EP2 equals the one-process model token for token, bad input is
refused; Lina's estimation (eq. 1, first-fit-decreasing packing) on a hand-made profile, the
profile round trip and refusal; scheduled inference on EP4 keeps the logits and triggers phase 2
exactly when the actual top-2k experts differ from the estimate."""

import copy
import json
import os

import pytest
import torch

from megatron_moe import convert as cv
from megatron_moe.config import Config
from megatron_moe.generation import generate
from megatron_moe.inference.engine import InferenceEngine, inference_config, load_engine, load_weights, serve
from megatron_moe.inference.popularity import (
    PathProfile,
    check_profile,
    collect_profile,
    device_rows,
    devices_per_expert,
    first_fit_decreasing,
    load_profile,
    plan_placement,
    save_profile,
    top_experts,
)
from megatron_moe.inference.fallback import use_lina
from megatron_moe.inference.scheduled import ScheduledMoE, gate_fingerprint
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel, local_state
from megatron_moe.testing import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, MAX_POS, NEW = 100, 24, 6
PROMPTS = [[5, 17, 3, 99, 42], [1, 2], [7, 8, 9, 10, 11, 12, 13], [64], [30, 31, 32, 33], [88, 3, 9]]


def tiny_config(num_experts: int = 8) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 4, 32, 4, 64
    m.seq_length = m.max_position_embeddings = MAX_POS
    m.vocab_size, m.init_method_std = VOCAB, 0.2  # a large init: varied greedy continuations
    cfg.moe.num_experts, cfg.moe.moe_router_topk, cfg.moe.moe_layer_freq, cfg.train.seed = num_experts, 2, 1, 7
    return cfg


def reference_model(cfg: Config) -> GPT2MoE:
    """The one-process dropless model (full recomputation through `generation.generate`)."""
    return GPT2MoE(inference_config(cfg, local_state()), local_state()).eval()


def full_state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- one process


def test_kv_cache_decode_equals_full_recomputation_and_greedy_equals_generate():
    model = reference_model(tiny_config())
    out = InferenceEngine(model).generate(PROMPTS, NEW, keep_logits=True)  # one padded batch
    varied = set()
    for p, o in zip(PROMPTS, out):
        assert o.tokens == generate(model, p, NEW, temperature=0)
        ids = list(p)
        with torch.no_grad():
            for tok, logits in zip(o.tokens, o.logits):
                full = model(torch.tensor([ids]))[0, -1, :VOCAB]
                assert torch.allclose(logits, full, atol=1e-5, rtol=0), float((logits - full).abs().max())
                ids.append(tok)
        varied |= set(o.tokens)
    assert len(varied) > 4  # the continuations are not one repeated token


def test_sampling_with_seeds_equals_one_process_generate_and_eod_stops():
    model = reference_model(tiny_config())
    eng = InferenceEngine(model)
    out = eng.generate(PROMPTS[:3], NEW, temperature=1.3, top_k=20, seeds=[3, 4, 5])
    for p, s, o in zip(PROMPTS[:3], [3, 4, 5], out):
        assert o.tokens == generate(model, p, NEW, temperature=1.3, top_k=20, seed=s)
    first = eng.generate([PROMPTS[0]], NEW)[0].tokens
    stop = eng.generate([PROMPTS[0]], NEW, eod=first[1])[0].tokens
    assert stop == first[: first.index(first[1]) + 1]


def test_generation_stops_when_the_context_is_full():
    model = reference_model(tiny_config())
    prompt = list(range(1, MAX_POS - 2))  # 21 tokens: room for 3 more positions
    out = InferenceEngine(model).generate([prompt], 10)[0].tokens
    assert len(out) == 3 and out == generate(model, prompt, 3, temperature=0)


def test_bad_input_is_refused_with_a_clear_error():
    model = reference_model(tiny_config())
    eng = InferenceEngine(model)
    with pytest.raises(ValueError, match="prompt list is empty"):
        serve(eng, [], 4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        serve(eng, [[1], []], 4)
    with pytest.raises(
        ValueError, match=f"prompt 0 has {MAX_POS + 1} tokens, longer than the model's context of {MAX_POS}"
    ):
        serve(eng, [[1] * (MAX_POS + 1)], 4)
    with pytest.raises(ValueError, match="tokenizer does not match"):
        serve(eng, [[VOCAB]], 4)
    other = copy.deepcopy(tiny_config())
    other.model.hidden_size = 48
    with pytest.raises(
        ValueError,
        match=r"ckpt-x holds the parameters of another model: wpe is \(24, 48\), the model of its config needs \(24, 32\)",
    ):
        load_weights(reference_model(tiny_config()), full_state(reference_model(other)), "ckpt-x")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The model sharded EP4 (a layout none of the tests runs) with a tokenizer, and a consolidated copy."""
    from megatron_moe.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("inf")
    save_tokenizer(train_tokenizer([open(os.path.join(ROOT, "README.md")).read()] * 2, 300), root / "corpus_tokenizer")
    tok = load_tokenizer(root / "corpus_tokenizer")
    cfg = tiny_config()
    cfg.model.vocab_size = tok.vocab_size
    cfg.data.data_path = str(root / "corpus")
    model = GPT2MoE(cfg, local_state()).eval()
    ckpt = cv.FullCheckpoint(cfg, full_state(model), cv.structure_specs(cfg), meta={"iteration": 3})
    target, world = cv.target_config(cfg, 1, 4, 1)
    cv.write_sharded(ckpt, str(root / "ckpt"), target, world, progress=False)
    cv.export_file(ckpt, str(root / "model.safetensors"))
    return root, tok, cfg


def _cli(argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_tool", os.path.join(ROOT, "tools", "generate.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.main(argv)


def test_cli_generates_a_batch_and_refuses_bad_input(saved, capsys, tmp_path):
    root, tok, cfg = saved
    ref = reference_model(cfg)
    load_weights(ref, cv.read_any(str(root / "ckpt"), progress=False).model, "ckpt")
    texts = ["The tests", "Inference with"]
    expect = "".join(t + tok.decode(generate(ref, tok.encode(t), 5, temperature=0, eod=tok.eod)) + "\n" for t in texts)
    argv = ["--load", str(root / "ckpt"), "--greedy", "--max-new-tokens", "5"]
    assert _cli(argv + ["--prompt", texts[0], "--prompt", texts[1]]) == 0
    assert capsys.readouterr().out == expect
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert _cli(argv + ["--prompts-file", str(empty)]) == 2
    assert capsys.readouterr().err == f"generate.py: error: --prompts-file {empty} holds no prompt\n"
    assert _cli(argv + ["--prompt", "word " * 40]) == 2
    assert "longer than the model's context of 24 positions" in capsys.readouterr().err
    # a consolidated file whose config describes another model (hidden 48)
    other = tmp_path / "other.safetensors"
    (tmp_path / "other.safetensors").write_bytes((root / "model.safetensors").read_bytes())
    meta = json.loads((root / "model.json").read_text())
    meta_txt = json.dumps(meta).replace('"hidden_size": 32', '"hidden_size": 48')
    assert meta_txt != json.dumps(meta)
    (tmp_path / "other.json").write_text(meta_txt)
    assert _cli(["--load", str(other), "--greedy", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"generate.py: error: {other} holds the parameters of another model"), err


# ----------------------------------------------------------------------------- estimation


def hand_profile() -> PathProfile:
    """E = 4, top-1, paths of length 1: layer 0 overall, layer 1 by the layer-0 expert."""
    prof = PathProfile({"gates_sha256": "abc"}, 1, 4, 1)
    prof.tokens = [{(): 10}, {(0,): 8, (1,): 2}]
    prof.counts = [{(): [5, 3, 1, 1]}, {(0,): [6, 2, 0, 0], (1,): [0, 1, 0, 3]}]  # path (1,): top-1 expert 3
    return prof


def test_eq1_and_first_fit_decreasing_on_a_hand_made_profile():
    prof = hand_profile()
    # 3 tokens came through expert 0, one through expert 1, one through expert 2 (path never seen)
    paths = torch.tensor([[0], [0], [0], [1], [2]])
    pop = prof.token_popularity(1, paths)
    # path (2,) was never seen: layer 1 overall [6, 3, 0, 3] / 12, top-1 expert 0 with 0.5
    assert pop.tolist() == [[0.75, 0, 0, 0]] * 3 + [[0, 0, 0, 0.75], [0.5, 0, 0, 0]]
    n_e = devices_per_expert(pop.sum(dim=0), 5, 4)
    assert n_e == pytest.approx([4 * 2.75 / 5, 0, 0, 4 * 0.75 / 5])  # [2.2, 0, 0, 0.6]
    # 2.2 -> 2 replicas on devices 0, 1; 0.6 packed on device 2; experts 1, 2 (no estimate) on the free device 3
    assert plan_placement(n_e, 4, 4).hosts == [[0, 1], [3], [3], [2]]
    # first-fit-decreasing: 0.9 opens bin 0, 0.5 bin 1, 0.2 joins bin 1 (0.9 + 0.2 > 1)
    assert first_fit_decreasing([(1, 0.9), (2, 0.5), (3, 0.2)], 1.0, 4) == [[1], [2, 3]]
    assert plan_placement([2.4, 0.9, 0.5, 0.2], 4, 4).hosts == [[0, 1], [2], [3], [3]]
    assert first_fit_decreasing([(0, 0.1), (1, 0.1), (2, 0.1)], 1.0, 2) == [[0, 1], [2]]  # at most 2 per bin
    # two devices: 1.6 rounds to 2 replicas, the bin {1, 2} makes 3 > 2 devices, so expert 0 keeps one
    # replica; expert 3 (no estimate) joins the device of least estimated load (device 1: 0.4 < 1.6)
    assert plan_placement([1.6, 0.3, 0.1, 0.0], 2, 4).hosts == [[0], [1], [1], [1]]
    assert top_experts([1.0, 3.0, 2.0, 3.0], 2) == {1, 3}
    # expert 0's 5 choices split 2 + 3 over its replicas on devices 0, 1; device 3 runs experts 1 and 2
    assert device_rows(plan_placement(n_e, 4, 4), [5, 2, 1, 4], 4) == [2, 3, 4, 3]


def test_profile_round_trip_and_refusal(tmp_path):
    prof = hand_profile()
    path = str(tmp_path / "p.json")
    save_profile(prof, path)
    back = load_profile(path)
    assert (back.fingerprint, back.path_length, back.num_experts, back.top_k) == ({"gates_sha256": "abc"}, 1, 4, 1)
    assert back.counts == prof.counts and back.tokens == prof.tokens
    assert not os.path.exists(path + ".tmp")
    check_profile(back, {"gates_sha256": "abc"}, path, 2)
    with pytest.raises(
        ValueError,
        match=rf"--lina-inference {path} was profiled on another model \(differs in "
        r"\['gates_sha256'\]\)",
    ):
        check_profile(back, {"gates_sha256": "abd"}, path, 2)
    (tmp_path / "bad.json").write_text('{"format": "pickle"}')
    with pytest.raises(ValueError, match="is not a megatron_moe.expert_paths v1 file"):
        load_profile(str(tmp_path / "bad.json"))


def test_collected_profile_counts_paths_like_a_brute_force_count():
    cfg = tiny_config()
    model = reference_model(cfg)
    ids = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(1))
    prof = collect_profile(model, [ids], 3, gate_fingerprint(InferenceEngine(model)))
    with torch.no_grad():
        model(ids)
    ex = [layer.router.last_routes[0].expert for layer in model.moe_layers()]  # [24, 2] each
    for m in range(4):
        p = min(3, m)
        brute: dict = {}
        for t in range(24):
            key = tuple(int(ex[j][t, 0]) for j in range(m - p, m))
            c = brute.setdefault(key, [0] * 8)
            for e in ex[m][t].tolist():
                c[e] += 1
        assert prof.counts[m] == brute
        assert sum(prof.tokens[m].values()) == 24


def test_lina_refuses_a_profile_of_another_model(tmp_path):
    model = reference_model(tiny_config())
    other = GPT2MoE(inference_config(tiny_config(), local_state()), local_state(), seed=8).eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / "other.json")
    save_profile(collect_profile(other, [ids], 3, gate_fingerprint(InferenceEngine(other))), path)
    with pytest.raises(ValueError, match=f"--lina-inference {path} was profiled on another model"):
        use_lina(InferenceEngine(model), path)


# ----------------------------------------------------------------------------- layouts (multiprocess)


def _layouts(rank, world, ckpt, layouts, lina_profile):
    """Greedy generation of PROMPTS under each layout (loaded from the EP4 checkpoint); with a profile,
    also EP4 plain vs Lina-scheduled logits and the phase-2 decisions."""
    out = {}
    for mp, ep, esp in layouts:
        ps = initialize_model_parallel(mp, ep, esp)
        try:
            out[(mp, ep, esp)] = serve(load_engine(ckpt, ps), PROMPTS, NEW)
        finally:
            destroy_model_parallel()
    if lina_profile:
        ps = initialize_model_parallel(1, 4, 1)
        try:
            eng = load_engine(ckpt, ps)
            mine = PROMPTS[rank::4]
            plain = eng.generate(mine, NEW, keep_logits=True)
            runs = {}
            for mode in ("phase1", "phase1_2"):
                runner = ScheduledMoE(eng, load_profile(lina_profile), mode, 4)
                eng.set_ffn_runner(runner)
                res = eng.generate(mine, NEW, keep_logits=True)
                runs[mode] = (
                    [o.tokens for o in res],
                    [torch.stack(o.logits) for o in res],
                    runner.estimated,
                    runner.actual,
                    runner.phase2_triggered,
                    runner.phase2_choice,
                )
            eng.set_ffn_runner(ScheduledMoE(eng, None, "none"))
            none = eng.generate(mine, NEW, keep_logits=True)
            out["lina"] = (
                [o.tokens for o in plain],
                [torch.stack(o.logits) for o in plain],
                runs,
                [torch.stack(o.logits) for o in none],
            )
        finally:
            destroy_model_parallel()
    return out


def test_greedy_under_mp2_ep2_and_mp2xep2_equals_one_process_and_lina_keeps_the_logits(saved):
    root, _, cfg = saved
    ckpt = str(root / "ckpt")
    ref = reference_model(cfg)
    load_weights(ref, cv.read_any(ckpt, progress=False).model, ckpt)
    expect = [generate(ref, p, NEW, temperature=0) for p in PROMPTS]
    prof = str(root / "profile.json")
    ids = torch.randint(0, cfg.model.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
    save_profile(collect_profile(ref, [ids], 3, gate_fingerprint(InferenceEngine(ref))), prof)
    two = spawn(_layouts, 2, ckpt, [(2, 1, 1), (1, 2, 1), (1, 1, 2)], None, timeout=600)
    four = spawn(_layouts, 4, ckpt, [(2, 2, 1)], prof, timeout=600)
    for res in two + four:
        for layout, got in res.items():
            if layout != "lina":
                assert got == expect, f"layout {layout}: {got} != {expect}"
    triggered = untriggered = 0
    for rank, res in enumerate(four):
        tokens, logits, runs, none = res["lina"]
        assert tokens == expect[rank::4]
        for mode, (t, lg, estimated, actual, fired, choices) in runs.items():
            assert t == tokens
            for a, b in zip(lg, logits):  # replicas run GEMMs of other row counts: fp32 round-off only
                assert torch.allclose(a, b, atol=1e-5, rtol=0), f"{mode}: logits differ by {float((a - b).abs().max())}"
            for est, act, f, choice in zip(estimated, actual, fired, choices):
                differs = est is not None and top_experts(est, 4) != top_experts(act, 4)
                assert f == (differs and mode == "phase1_2")
                assert (choice is not None) == f  # a triggered phase 2 priced its options
                triggered += f
                untriggered += (not f) and est is not None and mode == "phase1_2"
        for a, b in zip(none, logits):  # the trained placement: the same GEMMs, the same bits
            assert torch.equal(a, b), f"none: logits differ by {float((a - b).abs().max())}"
        # every rank saw the same global counts, estimates and decisions
        assert runs["phase1_2"][2:] == four[0]["lina"][2]["phase1_2"][2:]
    assert triggered > 0 and untriggered > 0, (triggered, untriggered)


def _tool(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_profile_tool_then_generate_with_lina_gives_the_same_text(saved, capsys, tmp_path):
    root, tok, cfg = saved
    prof = str(tmp_path / "paths.json")
    calib = os.path.join(ROOT, "data", "wikitext-sample", "wiki.valid.tokens")
    base = ["--load", str(root / "ckpt"), "--input", calib, "--batch-size", "4", "--max-batches", "2"]
    assert _tool("profile_expert_paths").main(base + ["--output", prof, "--path-length", "5"]) == 0
    assert "profiled 192 tokens, 4 MoE layers" in capsys.readouterr().out
    back = load_profile(prof)
    doc = json.loads(open(prof).read())
    assert [layer["path_length"] for layer in doc["layers"]] == [0, 1, 2, 3]  # 4 MoE layers: at most 3
    assert [sum(back.tokens[m].values()) for m in range(4)] == [192] * 4
    assert [sum(sum(c) for c in back.counts[m].values()) for m in range(4)] == [2 * 192] * 4  # top-2
    argv = ["--load", str(root / "ckpt"), "--greedy", "--max-new-tokens", "5", "--prompt", "The tests"]
    assert _cli(argv) == 0
    plain = capsys.readouterr().out
    assert _cli(argv + ["--lina-inference", prof]) == 0
    assert capsys.readouterr().out == plain
    assert _tool("profile_expert_paths").main(base + ["--output", prof, "--path-length", "-1"]) == 2
    assert capsys.readouterr().err == "profile_expert_paths.py: error: --path-length must be >= 0, got -1\n"
    other = hand_profile()
    save_profile(other, str(tmp_path / "other.json"))
    assert _cli(argv + ["--lina-inference", str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"generate.py: error: --lina-inference {tmp_path / 'other.json'} was profiled on another "
        f"model (differs in ['gates_sha256', 'hidden_size'"
    ), err
