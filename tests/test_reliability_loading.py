"""Loading what a checkpoint names or carries: a carried tokenizer never runs code (an `auto_map` is
refused, transformers never prompts), a relative tokenizer path recorded in the metadata is resolved
from the checkpoint and may not leave it, and links inside a carried tokenizer are refused (never
copied into a new checkpoint as regular files). Each error names the file, field or link, exits 2
and prints nothing on stdout."""

import builtins
import json
import os
import shutil

import pytest
import torch

from megatron_moe import checkpointing as ck
from megatron_moe import convert as cv
from megatron_moe.cli import convert as convert_cli
from megatron_moe.cli import generate as generate_cli
from megatron_moe.config import Config
from megatron_moe.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import local_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITER = "iter_0000007"
GEN = ["--prompt", "The", "--greedy", "--max-new-tokens", "2"]


def tiny_config(vocab: int) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 2, 32, 4, 64
    m.seq_length = m.max_position_embeddings = 16
    m.vocab_size = vocab
    cfg.moe.num_experts, cfg.moe.moe_router_topk, cfg.train.seed = 4, 2, 7
    return cfg


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(tokenizer directory, one-process checkpoint that carries a copy of it, one that carries none)."""
    root = tmp_path_factory.mktemp("loading")
    text = open(os.path.join(ROOT, "data", "wikitext-sample", "wiki.train.tokens")).read()
    save_tokenizer(train_tokenizer([text], 300), root / "tok")
    vocab = load_tokenizer(root / "tok").vocab_size
    out = {}
    for name, tok in (("carrying", str(root / "tok")), ("bare", None)):
        cfg = tiny_config(vocab)
        cfg.data.tokenizer_name_or_path = tok
        model = GPT2MoE(cfg, local_state())
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        ckpt = cv.FullCheckpoint(cfg, full, cv.structure_specs(cfg), meta={"iteration": 7})
        target, world = cv.target_config(cfg, 1, 1, 1)
        cv.write_sharded(ckpt, str(root / name), target, world, progress=False)
        out[name] = str(root / name)
    assert os.path.isdir(os.path.join(out["carrying"], ITER, "tokenizer"))
    assert not os.path.exists(os.path.join(out["bare"], ITER, "tokenizer"))
    return str(root / "tok"), out["carrying"], out["bare"]


def resume_args(ckpt: str) -> Config:
    """--use-checkpoint-args from `ckpt` (the trainer's path), no flag given on the command line."""
    cfg = Config()
    cfg.train.load = ckpt
    ck.apply_checkpoint_args(cfg, ck.read_metadata(ck.resolve(ckpt)))
    return cfg


def copy_ckpt(src: str, dest) -> str:
    shutil.copytree(src, dest, symlinks=True)
    return str(dest)


def generate(capsys, *argv) -> tuple:
    rc = generate_cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def set_recorded_tokenizer(ckpt: str, value: str) -> str:
    path = os.path.join(ckpt, ITER, "metadata.json")
    with open(path) as f:
        meta = json.load(f)
    meta["config"]["data"]["tokenizer_name_or_path"] = value
    with open(path, "w") as f:
        json.dump(meta, f)
    return path


# ----------------------------------------------------------------------------- custom code
def plant_custom_code(tok_dir: str, ran: str) -> str:
    """Make `tok_dir` an HF tokenizer whose tokenizer_config.json maps AutoTokenizer to a .py file
    in it that writes `ran` when imported; returns the config's path."""
    os.remove(os.path.join(tok_dir, "megatron_moe_tokenizer.json"))  # the `tokenizers` fast path
    code = (
        f"open({ran!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class PlantedTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n"
    )
    with open(os.path.join(tok_dir, "planted.py"), "w") as f:
        f.write(code)
    path = os.path.join(tok_dir, "tokenizer_config.json")
    config = {"eos_token": "<|endoftext|>", "auto_map": {"AutoTokenizer": [None, "planted.PlantedTokenizer"]}}
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def test_a_carried_tokenizer_with_an_auto_map_is_refused_without_a_prompt_or_running_it(
    made, tmp_path, capsys, monkeypatch
):
    ckpt = copy_ckpt(made[1], tmp_path / "ckpt")
    ran = str(tmp_path / "ran")
    config = plant_custom_code(os.path.join(ckpt, ITER, "tokenizer"), ran)
    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a: asked.append(a) or "y")  # a user who says yes
    rc, out, err = generate(capsys, "--load", ckpt, *GEN)
    assert rc == 2 and out == ""
    assert err.startswith("generate.py: error: ") and config in err and "auto_map" in err
    assert not os.path.exists(ran) and asked == []
    with pytest.raises(ValueError, match="auto_map"):
        load_tokenizer(os.path.join(ckpt, ITER, "tokenizer"))
    assert not os.path.exists(ran) and asked == []


def test_custom_code_in_a_tokenizer_directory_is_never_run_even_without_an_auto_map_check(tmp_path, monkeypatch):
    """The loader passes trust_remote_code=False: transformers itself refuses, it never asks."""
    tok_dir = str(tmp_path / "tok")
    save_tokenizer(train_tokenizer(["a b c d e f"], 260), tok_dir)
    ran = str(tmp_path / "ran")
    plant_custom_code(tok_dir, ran)
    from megatron_moe.data import tokenizer as tk

    monkeypatch.setattr(tk, "refuse_custom_code", lambda d: None, raising=False)
    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a: asked.append(a) or "y")
    with pytest.raises(ValueError, match="--tokenizer-name-or-path"):
        tk.load_tokenizer(tok_dir)
    assert not os.path.exists(ran) and asked == []


# ----------------------------------------------------------------------------- recorded relative paths
def test_a_relative_recorded_tokenizer_is_resolved_from_the_checkpoint_not_the_current_directory(
    made, tmp_path, capsys, monkeypatch
):
    tok, _, bare = made
    ckpt = copy_ckpt(bare, tmp_path / "ckpt")
    shutil.copytree(tok, os.path.join(ckpt, ITER, "mytok"))
    set_recorded_tokenizer(ckpt, "mytok")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rc, out, err = generate(capsys, "--load", ckpt, *GEN)
    assert rc == 0 and out.startswith("The"), err
    got = cv.read_sharded(ckpt, progress=False).cfg.data.tokenizer_name_or_path
    assert got == os.path.realpath(os.path.join(ckpt, ITER, "mytok"))


@pytest.mark.parametrize("value", ["../../tok", "tok"])
def test_a_relative_recorded_tokenizer_outside_the_checkpoint_is_refused(made, tmp_path, capsys, monkeypatch, value):
    """'../../tok' leaves the checkpoint; 'tok' exists only in the current directory."""
    tok, _, bare = made
    ckpt = copy_ckpt(bare, tmp_path / "ckpt")
    meta = set_recorded_tokenizer(ckpt, value)
    shutil.copytree(tok, tmp_path / "tok")
    monkeypatch.chdir(tmp_path)
    rc, out, err = generate(capsys, "--load", ckpt, *GEN)
    assert rc == 2 and out == ""
    assert "config.data.tokenizer_name_or_path" in err and meta in err and value in err
    save = str(tmp_path / "resharded")
    assert convert_cli.main(["reshard", "--no-progress", "--load", ckpt, "--save", save]) == 2
    assert "config.data.tokenizer_name_or_path" in capsys.readouterr().err
    assert not os.path.exists(save)
    with pytest.raises(ValueError, match="config.data.tokenizer_name_or_path"):
        resume_args(ckpt)


def test_a_hub_name_recorded_in_the_metadata_stays_a_hub_name(made, tmp_path, monkeypatch):
    ckpt = copy_ckpt(made[2], tmp_path / "ckpt")
    set_recorded_tokenizer(ckpt, "openai-community/gpt2")
    monkeypatch.chdir(tmp_path)
    assert cv.read_sharded(ckpt, progress=False).cfg.data.tokenizer_name_or_path == "openai-community/gpt2"


# ----------------------------------------------------------------------------- links
def test_a_link_inside_a_carried_tokenizer_is_refused_and_never_copied(made, tmp_path, capsys):
    ckpt = copy_ckpt(made[1], tmp_path / "ckpt")
    tok_dir = os.path.join(ckpt, ITER, "tokenizer")
    outside = tmp_path / "outside.json"
    shutil.move(os.path.join(tok_dir, "tokenizer.json"), outside)
    link = os.path.join(tok_dir, "tokenizer.json")
    os.symlink(outside, link)
    rc, out, err = generate(capsys, "--load", ckpt, *GEN)
    assert rc == 2 and out == "" and link in err and "symbolic link" in err
    save = str(tmp_path / "resharded")
    assert convert_cli.main(["reshard", "--no-progress", "--load", ckpt, "--save", save]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_checkpoint.py reshard: error: ") and link in err
    assert not os.path.exists(save)
    with pytest.raises(ValueError, match="symbolic link"):
        resume_args(ckpt)


def test_a_carried_tokenizer_directory_that_is_a_link_is_refused(made, tmp_path, capsys):
    ckpt = copy_ckpt(made[1], tmp_path / "ckpt")
    tok_dir = os.path.join(ckpt, ITER, "tokenizer")
    shutil.move(tok_dir, tmp_path / "real_tok")
    os.symlink(tmp_path / "real_tok", tok_dir)
    rc, out, err = generate(capsys, "--load", ckpt, *GEN)
    assert rc == 2 and out == "" and tok_dir in err


def test_a_plain_carried_tokenizer_still_loads_and_is_copied_on_reshard(made, tmp_path, capsys):
    ckpt = made[1]
    rc, out, err = generate(capsys, "--load", ckpt, *GEN)
    assert rc == 0 and out.startswith("The"), err
    save = str(tmp_path / "resharded")
    assert convert_cli.main(["reshard", "--no-progress", "--load", ckpt, "--save", save]) == 0
    assert os.path.isfile(os.path.join(save, ITER, "tokenizer", "tokenizer.json"))
    assert resume_args(ckpt).data.tokenizer_name_or_path == os.path.join(ckpt, ITER, "tokenizer")


# ----------------------------------------------------------------------------- import-hf
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A 2-block GPT2LMHeadModel `save_pretrained` directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("hf") / "gpt2"
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=100, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return str(path)


def import_hf(capsys, hf: str, save: str, *flags) -> tuple:
    rc = convert_cli.main(["import-hf", "--no-progress", "--hf", hf, "--save", save, *flags])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def edited_config(hf_dir: str, dest, **changes) -> str:
    shutil.copytree(hf_dir, dest)
    path = os.path.join(dest, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return str(dest)


@pytest.mark.parametrize(
    "changes, tensor",
    [
        (dict(n_layer=3), "transformer.h.2."),  # a block the weights lack: was random, and --verify said OK
        (dict(n_layer=1), "transformer.h.1."),  # a block the config lacks: was dropped
        (dict(n_inner=256), "mlp.c_fc."),  # a wider MLP than the weights
    ],
)
def test_import_hf_refuses_weights_that_do_not_match_the_config(hf_dir, tmp_path, capsys, changes, tensor):
    hf = edited_config(hf_dir, tmp_path / "hf", **changes)
    save = str(tmp_path / "out")
    rc, out, err = import_hf(capsys, hf, save, "--verify")
    assert rc == 2 and out == "" and not os.path.exists(save)
    assert err.startswith("convert_checkpoint.py import-hf: error: --hf ") and tensor in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--num-experts", "-1"], "--num-experts"),
        (["--num-experts", "2", "--moe-router-topk", "3"], "--moe-router-topk"),
        (["--num-experts", "2", "--moe-router-topk", "0"], "--moe-router-topk"),
        (["--num-experts", "2", "--moe-layer-freq", "0"], "--moe-layer-freq"),
        (["--num-experts", "2", "--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor"),
    ],
)
def test_import_hf_validates_its_moe_flags_like_the_trainer(hf_dir, tmp_path, capsys, flags, named):
    save = str(tmp_path / "out")
    rc, out, err = import_hf(capsys, hf_dir, save, *flags)
    assert rc == 2 and out == "" and not os.path.exists(save)
    assert err.startswith("convert_checkpoint.py import-hf: error: ") and named in err, err


def test_import_hf_accepts_any_topk_up_to_the_expert_count(hf_dir, tmp_path, capsys):
    save = str(tmp_path / "out")
    rc, out, err = import_hf(capsys, hf_dir, save, "--num-experts", "3", "--moe-router-topk", "3", "--verify")
    assert rc == 0, err
    assert "OK" in out
    assert cv.read_sharded(save, progress=False).cfg.moe.moe_router_topk == 3
