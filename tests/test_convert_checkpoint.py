"""tools/convert_checkpoint.py: exact resharding (model + optimizer), resume after a reshard,
Hugging Face import/export, consolidated-file round trip, and clear errors with no partial output."""

import importlib.util
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from megatron_moe import convert as cv
from megatron_moe.testing import spawn
from tiny_run import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "convert_checkpoint_tool", os.path.join(ROOT, "tools", "convert_checkpoint.py")
)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

LAYOUTS = {"MP2xEP2": ("2", "2", "1"), "EP2xESP2": ("1", "2", "2"), "one": ("1", "1", "1")}


def run_tool(command, *argv) -> int:
    """tools/convert_checkpoint.py COMMAND ARGV... in this process; returns its exit status."""
    return tool.main([command, "--no-progress", *argv])


def target(layout):
    mp, ep, esp = LAYOUTS[layout]
    return [
        "--target-tensor-model-parallel-size",
        mp,
        "--target-expert-model-parallel-size",
        ep,
        "--target-expert-sharding-parallel-size",
        esp,
        "--target-world-size",
        "1" if layout == "one" else "4",
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data prefix, checkpoint root, per-iteration losses) of a 4-iteration one-process run that
    saved at iterations 3 and 4."""
    from megatron_moe.arguments import parse_args
    from megatron_moe.data.preprocess import prepare_sample_data
    from megatron_moe.training import pretrain

    root = tmp_path_factory.mktemp("convert")
    data = str(root / "sample")
    prepare_sample_data(data, vocab_size=512)
    ckpt = str(root / "ckpt")
    hist = pretrain(parse_args(tiny_args(data, 4, "--save", ckpt, "--save-interval", "3")))
    return data, ckpt, [h["loss"] for h in hist]


@pytest.fixture(scope="module")
def resharded(trained, tmp_path_factory):
    """Iteration 3 resharded 1 process -> MP2xEP2 -> EP2xESP2 -> 1 process, each with --verify."""
    root = tmp_path_factory.mktemp("resharded")
    paths, src = {}, trained[1]
    for i, layout in enumerate(["MP2xEP2", "EP2xESP2", "one"]):
        paths[layout] = str(root / layout)
        extra = ["--iteration", "3"] if i == 0 else []
        assert run_tool("reshard", "--load", src, *extra, "--save", paths[layout], *target(layout), "--verify") == 0
        src = paths[layout]
    return paths


def test_reshard_round_trip_keeps_logits_and_optimizer_state(trained, resharded, capsys):
    src = cv.read_sharded(trained[1], iteration=3)
    assert {k for k in src.optim["wte.weight"]} == {"exp_avg", "exp_avg_sq", "step"}
    for layout, path in resharded.items():
        back = cv.read_sharded(path)
        assert back.meta["iteration"] == 3 and back.meta["consumed_samples"] == 24
        assert back.meta["router_calls"] == src.meta["router_calls"]
        assert cv.max_logit_diff(src, back) <= 1e-5
        assert cv.optimizer_mismatches(src, back) == []
        assert all(torch.equal(src.model[n], back.model[n]) for n in src.model)
    # the shards really have the target layout: rank 3 of MP2xEP2 holds the 2nd vocab half, experts 2-3
    r3 = load_file(os.path.join(resharded["MP2xEP2"], "iter_0000003", "rank_00003.safetensors"))
    assert torch.equal(r3["model/wte.weight"], src.model["wte.weight"][256:])
    fc_w = "blocks.1.moe.experts.fc_w"
    assert torch.equal(r3[f"optim/{fc_w}/exp_avg"], src.optim[fc_w]["exp_avg"][2:])
    # rank 1 of EP2xESP2: expert 0-1, second half of the expert hidden dim
    r1 = load_file(os.path.join(resharded["EP2xESP2"], "iter_0000003", "rank_00001.safetensors"))
    assert torch.equal(r1["model/blocks.1.moe.experts.proj_w"], src.model["blocks.1.moe.experts.proj_w"][:2, :, 64:])
    meta = json.load(open(os.path.join(resharded["EP2xESP2"], "iter_0000003", "metadata.json")))
    assert meta["layout"] == {
        "world_size": 4,
        "tensor_model_parallel_size": 1,
        "expert_model_parallel_size": 2,
        "expert_sharding_parallel_size": 2,
    }
    assert meta["config"]["parallel"]["expert_sharding_parallel_size"] == 2
    # back on one process, the shard is bit-identical to the original (model, optimizer, RNG)
    a = load_file(os.path.join(trained[1], "iter_0000003", "rank_00000.safetensors"))
    b = load_file(os.path.join(resharded["one"], "iter_0000003", "rank_00000.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert open(os.path.join(resharded["one"], "latest")).read() == "3"


def test_structure_specs_equal_the_saved_specs(trained):
    src = cv.read_sharded(trained[1], with_optimizer=False)
    assert cv.structure_specs(src.cfg) == src.specs


def _load_and_resume(rank, world, data, ckpt, paths):
    """On the target layouts: logits and optimizer state of the loaded shards; then resume training."""
    from megatron_moe.arguments import config_from_dict, parse_args
    from megatron_moe.checkpointing import load_checkpoint, read_metadata, resolve
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.layers.sharding import rank_coords, shard_tensor
    from megatron_moe.optim import build_optimizer
    from megatron_moe.parallel_state import initialize_model_parallel
    from megatron_moe.training import pretrain

    src = cv.read_sharded(ckpt, iteration=3, progress=False)
    out = {}
    for layout in ("MP2xEP2", "EP2xESP2"):
        mp, ep, esp = (int(x) for x in LAYOUTS[layout])
        ps = initialize_model_parallel(mp, ep, esp, "gloo")
        cfg = config_from_dict(read_metadata(resolve(paths[layout]))["config"])
        model = GPT2MoE(cfg, ps).eval()
        opt, _ = build_optimizer(model, cfg.optim, torch.device("cpu"))
        load_checkpoint(paths[layout], model, opt, ps)
        coords = rank_coords(ps)
        expect = {
            (n, k): t if t.dim() == 0 else shard_tensor(t, p._shard, coords)
            for n, p in model.named_parameters()
            for k, t in src.optim[n].items()
        }
        got = {(n, k): v for n, p in model.named_parameters() for k, v in opt.state[p].items()}
        bad = sorted(
            k
            for k in expect.keys() | got.keys()
            if k not in got or k not in expect or not torch.equal(got[k], expect[k])
        )
        with torch.no_grad():  # every rank routes the whole batch as one group
            logits = model(cv.fixed_batch(cfg))
        out[layout] = (ps.rank("mp"), logits, bad)
    mp, ep, esp = LAYOUTS["MP2xEP2"]
    hist = pretrain(
        parse_args(
            tiny_args(
                data,
                4,
                "--load",
                paths["MP2xEP2"],
                "--tensor-model-parallel-size",
                mp,
                "--expert-model-parallel-size",
                ep,
            )
        )
    )
    out["resumed"] = [(h["iteration"], h["loss"]) for h in hist]
    return out


def test_resharded_checkpoints_load_on_their_layouts_and_resume_with_the_same_loss(trained, resharded):
    data, ckpt, losses = trained
    src = cv.read_sharded(ckpt, iteration=3)
    with torch.no_grad():
        ref = cv.build_model(src.cfg, src.model)(cv.fixed_batch(src.cfg))  # [B, T, padded V]
    results = spawn(_load_and_resume, 4, data, ckpt, resharded, timeout=300)
    for res in results:
        for layout in ("MP2xEP2", "EP2xESP2"):
            mp_rank, logits, bad = res[layout]
            width = logits.size(-1)
            assert width == ref.size(-1) // int(LAYOUTS[layout][0])
            assert (logits - ref[..., mp_rank * width : (mp_rank + 1) * width]).abs().max().item() <= 1e-5
            assert bad == [], f"{layout}: optimizer state differs for {bad}"
        # the uninterrupted run's 4th iteration, continued on MP2xEP2 from the reshard of iteration 3
        [(it, loss)] = res["resumed"]
        assert it == 4 and abs(loss - losses[3]) < 1e-4, (loss, losses[3])


# ----------------------------------------------------------------------------- Hugging Face
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small randomly initialized GPT2LMHeadModel saved with save_pretrained (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=16,
            vocab_size=100,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ).eval()
    with torch.no_grad():  # non-zero biases so every tensor's mapping matters
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.02)
    path = str(tmp_path_factory.mktemp("hf") / "gpt2-tiny")
    model.save_pretrained(path)
    return path


def hf_logits(path, ids):
    """Logits [B, T, V] of the GPT2LMHeadModel saved at `path`."""
    from transformers import GPT2LMHeadModel  # imported here: spawned ranks import this module too

    with torch.no_grad():
        return GPT2LMHeadModel.from_pretrained(path).eval()(ids).logits


IDS = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(5))


def test_import_hf_dense_logits_equal_and_the_trainer_loads_it(hf_dir, tmp_path, capsys):
    from megatron_moe.checkpointing import load_checkpoint
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.optim import build_optimizer
    from megatron_moe.parallel_state import local_state

    out = str(tmp_path / "dense")
    assert run_tool("import-hf", "--hf", hf_dir, "--save", out, "--verify") == 0
    assert "verify Hugging Face vs imported: max |logit difference|" in capsys.readouterr().out
    ck = cv.read_sharded(out)
    assert ck.meta["iteration"] == 0 and ck.optim == {} and ck.cfg.moe.num_experts == 0
    got = cv.model_logits(ck.cfg, ck.model, IDS)
    assert (got - hf_logits(hf_dir, IDS)).abs().max().item() < 1e-5
    # the trainer's load_checkpoint takes it: weights in, empty optimizer state, a step works
    model = GPT2MoE(ck.cfg, local_state())
    opt, _ = build_optimizer(model, ck.cfg.optim, torch.device("cpu"))
    meta = load_checkpoint(out, model, opt, local_state())
    assert meta["iteration"] == 0 and len(opt.state) == 0
    assert torch.equal(model.wte.weight, ck.model["wte.weight"])
    lm, _ = model(IDS[:, :-1], IDS[:, 1:])
    lm.backward()
    opt.step()
    assert len(opt.state) == len(list(model.parameters()))


def test_import_hf_upcycled_top2_without_drops_equals_dense(hf_dir, tmp_path, capsys):
    out = str(tmp_path / "moe")
    assert (
        run_tool(
            "import-hf",
            "--hf",
            hf_dir,
            "--save",
            out,
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--moe-expert-capacity-factor",
            "4",
            "--seed",
            "3",
            "--target-expert-model-parallel-size",
            "2",
            "--verify",
        )
        == 0
    )
    assert "(top-k >= 2, no drops)" in capsys.readouterr().out
    ck = cv.read_sharded(out)
    assert ck.cfg.is_moe_layer(1) and not ck.cfg.is_moe_layer(0)
    assert torch.equal(ck.model["blocks.1.moe.experts.fc_w"][3], ck.model["blocks.1.moe.experts.fc_w"][0])
    model = cv.build_model(ck.cfg, ck.model)
    with torch.no_grad():
        got = model(IDS)[..., :100]
    assert model.moe_layers()[0].last_stats["dropped"] == 0
    assert (got - hf_logits(hf_dir, IDS)).abs().max().item() < 1e-5
    # top-1 upcycling scales each expert output by its gate probability (DeepSpeed semantics): not equal
    out1 = str(tmp_path / "moe_top1")
    assert run_tool("import-hf", "--hf", hf_dir, "--save", out1, "--num-experts", "4", "--verify") == 0
    assert "not checked" in capsys.readouterr().out
    ck1 = cv.read_sharded(out1)
    assert (cv.model_logits(ck1.cfg, ck1.model, IDS, no_drop=True) - hf_logits(hf_dir, IDS)).abs().max() > 1e-3


def test_export_hf_reloads_in_transformers_with_equal_logits(hf_dir, tmp_path, capsys):
    ours = str(tmp_path / "ours")
    assert run_tool("import-hf", "--hf", hf_dir, "--save", ours, "--target-tensor-model-parallel-size", "2") == 0
    out = str(tmp_path / "exported")
    assert run_tool("export-hf", "--load", ours, "--output", out, "--verify") == 0
    assert "verify source vs Hugging Face export" in capsys.readouterr().out
    assert (hf_logits(out, IDS) - hf_logits(hf_dir, IDS)).abs().max().item() < 1e-5
    # a model with MoE layers cannot be a GPT2LMHeadModel: clear error, nothing written
    moe = str(tmp_path / "moe")
    assert run_tool("import-hf", "--hf", hf_dir, "--save", moe, "--num-experts", "2") == 0
    assert run_tool("export-hf", "--load", moe, "--output", str(tmp_path / "no")) == 2
    assert "MoE layers" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["exported", "moe", "ours"]


def test_export_import_consolidated_file_round_trip(trained, tmp_path, capsys):
    f = str(tmp_path / "model.safetensors")
    assert run_tool("export", "--load", trained[1], "--iteration", "3", "--output", f, "--verify") == 0
    info = json.load(open(tmp_path / "model.json"))
    assert info["format"] == "megatron_moe.consolidated" and info["iteration"] == 3
    src = cv.read_sharded(trained[1], iteration=3)
    tensors = load_file(f)
    assert sorted(tensors) == sorted(src.model) and all(torch.equal(tensors[n], src.model[n]) for n in tensors)
    out = str(tmp_path / "back")
    assert run_tool("import", "--input", f, "--save", out, *target("MP2xEP2"), "--verify") == 0
    assert "max |logit difference| = 0.000e+00" in capsys.readouterr().out
    back = cv.read_sharded(out)
    assert back.meta["iteration"] == 0 and back.optim == {} and cv.max_logit_diff(src, back) == 0.0


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "flags,named",
    [
        (["--target-expert-model-parallel-size", "3"], "--target-expert-model-parallel-size"),
        (["--target-tensor-model-parallel-size", "3"], "--target-tensor-model-parallel-size"),
        (["--target-expert-sharding-parallel-size", "3"], "--target-expert-sharding-parallel-size"),
        (["--target-tensor-model-parallel-size", "2", "--target-world-size", "3"], "--target-world-size"),
    ],
)
def test_a_layout_the_model_cannot_take_names_the_flag(trained, tmp_path, capsys, flags, named):
    out = str(tmp_path / "out")
    assert run_tool("reshard", "--load", trained[1], "--save", out, *flags) == 2
    assert named in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_corrupt_or_missing_inputs_name_the_file_and_leave_no_output(resharded, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(resharded["MP2xEP2"], bad)
    shard = bad / "iter_0000003" / "rank_00002.safetensors"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    assert run_tool("reshard", "--load", str(bad), "--save", str(tmp_path / "out")) == 2
    assert "rank_00002.safetensors" in capsys.readouterr().err
    os.remove(shard)
    assert run_tool("reshard", "--load", str(bad), "--save", str(tmp_path / "out")) == 2
    assert f"{shard} is missing" in capsys.readouterr().err
    (bad / "iter_0000003" / "metadata.json").write_text('{"layout": ')
    assert run_tool("export", "--load", str(bad), "--output", str(tmp_path / "m.safetensors")) == 2
    assert "metadata.json is corrupt" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_a_failed_verify_leaves_no_output(resharded, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cv, "max_logit_diff", lambda a, b: 1.0)
    assert run_tool("reshard", "--load", resharded["one"], "--save", str(tmp_path / "out"), "--verify") == 2
    assert "--verify failed" in capsys.readouterr().err
    existing = tmp_path / "existing"  # into an existing root: no iteration dir, latest unchanged
    shutil.copytree(resharded["one"], existing)
    shutil.rmtree(existing / "iter_0000003")
    (existing / "latest").write_text("1")
    assert run_tool("reshard", "--load", resharded["one"], "--save", str(existing), "--verify") == 2
    assert sorted(os.listdir(tmp_path)) == ["existing"]
    assert os.listdir(existing) == ["latest"] and (existing / "latest").read_text() == "1"


def test_a_config_saved_with_a_flag_since_removed_still_builds():
    """Checkpoint metadata names every field of its version; a field this version no longer has (here
    `parallel.cpu_allocator`, written by every checkpoint before the flag was removed) is skipped."""
    from megatron_moe.arguments import config_from_dict, config_to_dict
    from megatron_moe.config import Config

    saved = config_to_dict(Config())
    saved["parallel"]["cpu_allocator"] = "keep"
    saved["retired_section"] = {"anything": 1}
    assert config_from_dict(saved) == Config()
