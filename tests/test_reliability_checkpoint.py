"""Checkpoints that cannot be lost or poisoned: crash injection at every
step of the save sequence, retention and leftovers, `latest` fallback, SHA-256 per shard, the
config compared before any tensor is read, --use-checkpoint-args and the tokenizer a checkpoint carries."""

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from megatron_moe import checkpointing as ck
from megatron_moe.arguments import parse_args, validate
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.optim import build_optimizer
from megatron_moe.parallel_state import local_state
from tiny_run import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


def tiny(*extra, iters=4):
    """(cfg, model, optimizer) of the tiny run on one process; no data needed (vocab given)."""
    cfg = parse_args(tiny_args("/nonexistent/data", iters, "--vocab-size", "512", *extra))
    validate(cfg, 1)
    torch.manual_seed(0)
    model = GPT2MoE(cfg, local_state()).to(CPU)
    opt, _ = build_optimizer(model, cfg.optim, CPU)
    return cfg, model, opt


def step(model, opt) -> None:
    """One optimizer step on random tokens (so the optimizer has state)."""
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1), device=CPU)
    lm, aux = model(ids, ids)
    (lm + aux).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def save(root, it, cfg, model, opt):
    return ck.save_checkpoint(root, it, it * 8, model, opt, cfg, local_state())


def load_params(root, cfg=None) -> tuple:
    """(params, metadata) of `root` loaded into a fresh model of the same config."""
    cfg2, model, opt = tiny()
    meta = ck.load_checkpoint(root, model, opt, local_state(), cfg or cfg2)
    return params(model), meta


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory):
    """A checkpoint root with iterations 1 and 2 (latest 2) and the parameters of each."""
    root = str(tmp_path_factory.mktemp("ck") / "run")
    cfg, model, opt = tiny()
    states = {}
    for it in (1, 2):
        step(model, opt)
        save(root, it, cfg, model, opt)
        states[it] = params(model)
    return root, states


# ----------------------------------------------------------------------------- crash injection
REACHED = [(p, "resave") for p in ck.FAULT_POINTS] + [
    (p, "new") for p in ck.FAULT_POINTS if p not in ("after_old_aside", "after_old_removed")
]


@pytest.mark.parametrize("point,kind", REACHED, ids=[f"{p}-{k}" for p, k in REACHED])
def test_a_crash_at_any_step_of_a_save_leaves_a_loadable_latest(two_iterations, tmp_path, monkeypatch, point, kind):
    src, states = two_iterations
    root = str(tmp_path / "run")
    shutil.copytree(src, root)
    cfg, model, opt = tiny()
    ck.load_checkpoint(root, model, opt, local_state(), cfg)
    step(model, opt)  # a state different from both saved ones
    new_state = params(model)
    it = 2 if kind == "resave" else 3  # re-running a finished job saves iter 2 again
    monkeypatch.setenv(ck.FAULT_ENV, point)
    with pytest.raises(ck.CheckpointFault, match=point):
        save(root, it, cfg, model, opt)
    monkeypatch.delenv(ck.FAULT_ENV)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, meta = load_params(root)
    fell_back = [w for w in caught if "newest complete iteration" in str(w.message)]
    assert len(fell_back) == (point == "after_old_aside")  # latest names the directory moved aside
    committed = point in ("after_latest", "after_old_removed") or (point == "after_new_in" and kind == "resave")
    assert meta["iteration"] == (it if committed else 2)
    expect = new_state if committed else states[2]
    assert all(torch.equal(got[n], expect[n]) for n in got), f"{point}: loaded neither the old nor the new state"
    # the next save cleans every leftover and the result loads
    save(root, 4, cfg, model, opt)
    assert sorted(os.listdir(root)) == sorted(
        ["latest", "iter_0000001", "iter_0000002", "iter_0000004"]
        + (["iter_0000003"] if kind == "new" and point != "after_shards" and point != "after_metadata" else [])
    )
    got, meta = load_params(root)
    assert meta["iteration"] == 4 and all(torch.equal(got[n], new_state[n]) for n in got)


def test_leftover_temporaries_are_removed_by_the_next_save_unless_a_live_process_writes_them(two_iterations, tmp_path):
    root = str(tmp_path / "run")
    shutil.copytree(two_iterations[0], root)
    dead, live = "iter_0000005.tmp-999999999", f"iter_0000006.tmp-{os.getppid()}"
    for d in (dead, live):
        os.makedirs(os.path.join(root, d))
    cfg, model, opt = tiny()
    save(root, 3, cfg, model, opt)
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "iter_0000003", live, "latest"]


def test_keep_last_retains_only_the_newest_iterations(tmp_path):
    cfg, model, opt = tiny("--keep-last", "2")
    root = str(tmp_path / "run")
    for it in (1, 2, 3, 4):
        save(root, it, cfg, model, opt)
    assert sorted(os.listdir(root)) == ["iter_0000003", "iter_0000004", "latest"]


def test_dangling_or_garbage_latest_falls_back_to_the_newest_complete_iteration(two_iterations, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(two_iterations[0], root)
    os.remove(root / "iter_0000002" / "rank_00000.safetensors")  # newest is incomplete
    (root / "latest").write_text("garbage")
    with pytest.warns(UserWarning, match=r"latest is unreadable: 'garbage'.*newest complete iteration 1"):
        got, meta = load_params(str(root))
    assert meta["iteration"] == 1 and all(torch.equal(got[n], two_iterations[1][1][n]) for n in got)
    (root / "latest").write_text("2")
    with pytest.warns(UserWarning, match=r"iter_0000002/rank_00000.safetensors is missing\).*iteration 1"):
        assert load_params(str(root))[1]["iteration"] == 1
    shutil.rmtree(root / "iter_0000001")
    with pytest.raises(FileNotFoundError, match="no complete iteration exists under --load"):
        load_params(str(root))


# ----------------------------------------------------------------------------- checksums, bad files
def test_flipped_bytes_in_a_shard_are_refused_naming_the_file(two_iterations, tmp_path, capsys):
    root = tmp_path / "run"
    shutil.copytree(two_iterations[0], root)
    shard = root / "iter_0000002" / "rank_00000.safetensors"
    meta = json.loads((root / "iter_0000002" / "metadata.json").read_text())
    assert meta["checksums"]["sha256"]["rank_00000.safetensors"] == ck.sha256_file(str(shard))
    data = bytearray(shard.read_bytes())
    data[-100:-96] = bytes(b ^ 0xFF for b in data[-100:-96])  # inside the tensor data
    shard.write_bytes(bytes(data))
    cfg, model, opt = tiny()
    before = params(model)
    with pytest.raises(ValueError, match=f"{shard} is corrupt: its SHA-256 does not match"):
        ck.load_checkpoint(str(root), model, opt, local_state(), cfg)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    out = tmp_path / "out"
    assert convert_tool().main(["reshard", "--no-progress", "--verify", "--load", str(root), "--save", str(out)]) == 2
    assert f"{shard} is corrupt: its SHA-256" in capsys.readouterr().err
    assert not out.exists()


def test_garbage_metadata_names_the_file(two_iterations, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(two_iterations[0], root)
    shutil.rmtree(root / "iter_0000001")
    (root / "iter_0000002" / "metadata.json").write_text('{"layout": ')
    with pytest.raises(FileNotFoundError, match=r"iter_0000002/metadata.json is corrupt \(not valid JSON"):
        load_params(str(root))


def test_a_non_finite_state_is_never_saved(tmp_path):
    cfg, model, opt = tiny()
    with torch.no_grad():
        next(model.parameters())[0].fill_(float("nan"))
    with pytest.raises(ck.NonFiniteError, match="iteration 3: not saved, non-finite values in"):
        save(str(tmp_path / "run"), 3, cfg, model, opt)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- config before tensors
@pytest.mark.parametrize(
    "flags,named,with_optimizer",
    [
        (["--num-layers", "4"], "--num-layers: checkpoint 2, this run 4", True),
        (["--num-layers", "4"], "--num-layers: checkpoint 2, this run 4", False),
        (["--optimizer", "sgd"], "--optimizer: checkpoint adamw (its optimizer state), this run sgd", True),
        (["--num-experts", "8"], "--num-experts: checkpoint 4, this run 8", True),
    ],
    ids=["layers-optim", "layers-no-optim", "adamw-sgd", "experts-4-8"],
)
def test_a_config_mismatch_is_refused_before_any_tensor_is_read(tmp_path, flags, named, with_optimizer):
    cfg, model, opt = tiny()
    if with_optimizer:
        step(model, opt)
    root = str(tmp_path / "run")
    save(root, 1, cfg, model, opt)
    shard = os.path.join(root, "iter_0000001", "rank_00000.safetensors")
    assert any(k.startswith("optim/") for k in ck.read_shard(shard, {})) == with_optimizer
    with open(shard, "wb") as f:  # reading any tensor would fail differently
        f.write(b"garbage")
    cfg2, model2, opt2 = tiny(*flags)
    before = params(model2)
    with pytest.raises(ValueError, match="does not match this run") as e:
        ck.load_checkpoint(root, model2, opt2, local_state(), cfg2)
    assert named in str(e.value) and "--use-checkpoint-args" in str(e.value)
    assert len(str(e.value).splitlines()) == 3  # header, exactly one differing field, advice
    assert all(torch.equal(before[n], p) for n, p in model2.named_parameters())
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest"]


# ----------------------------------------------------------------------------- end to end
MODEL_FLAGS = {
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--seq-length",
    "--num-experts",
    "--moe-router-topk",
    "--moe-expert-capacity-factor",
    "--moe-min-capacity",
    "--moe-schedule",
}


def without_model_flags(argv: list) -> list:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in MODEL_FLAGS:
            skip = True
        else:
            out.append(a)
    return out


def test_resume_with_use_checkpoint_args_and_no_model_flags_equals_the_uninterrupted_curve(
    sample_data, tmp_path, monkeypatch
):
    from megatron_moe.generation import carried_tokenizer, tokenizer_path
    from megatron_moe.training import pretrain

    ckpt = str(tmp_path / "ckpt")
    straight = pretrain(parse_args(tiny_args(sample_data, 8)))
    first = pretrain(parse_args(tiny_args(sample_data, 8, "--save", ckpt, "--exit-interval", "4")))
    monkeypatch.chdir(tmp_path)  # nothing may depend on the working directory
    argv = without_model_flags(tiny_args(sample_data, 8, "--load", ckpt, "--use-checkpoint-args"))
    assert "--num-layers" not in argv and "--num-experts" not in argv
    second = pretrain(parse_args(argv))
    assert [h["loss"] for h in straight] == [h["loss"] for h in first + second]
    it_dir = os.path.join(ckpt, "iter_0000004")
    meta = ck.read_metadata(it_dir)
    assert meta["tokenizer"] == "tokenizer" and os.path.isabs(meta["config"]["data"]["data_path"])
    assert sorted(os.listdir(os.path.join(it_dir, "tokenizer"))) == sorted(os.listdir(f"{sample_data}_tokenizer"))
    cfg = parse_args(tiny_args(sample_data, 1))
    assert tokenizer_path(cfg, carried=carried_tokenizer(ckpt)) == os.path.join(it_dir, "tokenizer")
    # generate from another directory while the tokenizer beside the data is gone: the carried one is used
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen", os.path.join(ROOT, "tools", "generate.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    os.rename(f"{sample_data}_tokenizer", f"{sample_data}_hidden")
    try:
        assert gen.main(["--load", ckpt, "--prompt", "The", "--greedy", "--max-new-tokens", "3"]) == 0
    finally:
        os.rename(f"{sample_data}_hidden", f"{sample_data}_tokenizer")


def test_lr_1e30_stops_with_the_nan_error_and_latest_loads_finite(sample_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "pretrain_gpt_moe.py"),
        *tiny_args(sample_data, 20, "--lr", "1e30", "--save", ckpt, "--save-interval", "1"),
    ]
    out = subprocess.run(
        cmd,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 1, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "Traceback" not in out.stderr
    latest = int(open(os.path.join(ckpt, "latest")).read())
    assert f"error: iteration {latest + 1}: non-finite lm loss" in errors[0]
    assert sorted(os.listdir(ckpt)) == [f"iter_{i:07d}" for i in range(1, latest + 1)] + ["latest"]
    tensors = ck.read_shard(os.path.join(ck.resolve(ckpt), "rank_00000.safetensors"), {})
    assert all(torch.isfinite(t).all() for k, t in tensors.items() if t.is_floating_point())


# ----------------------------------------------------------------------------- convert_checkpoint.py (item 10)
def convert_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cc", os.path.join(ROOT, "tools", "convert_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_import_hf_of_a_missing_directory_says_no_such_directory(tmp_path, capsys):
    missing, out = tmp_path / "no" / "gpt2", tmp_path / "out"
    assert convert_tool().main(["import-hf", "--no-progress", "--hf", str(missing), "--save", str(out)]) == 2
    assert (
        capsys.readouterr().err.strip() == f"convert_checkpoint.py import-hf: error: --hf {missing}: no such directory"
    )
    assert os.listdir(tmp_path) == []


def test_reshard_into_the_root_of_another_run_is_refused_and_moves_nothing(two_iterations, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(two_iterations[0], other)
    (other / "latest").write_text("1")
    before = sorted(os.listdir(other))
    code = convert_tool().main(["reshard", "--no-progress", "--load", two_iterations[0], "--save", str(other)])
    assert code == 2
    assert f"--save {other} is the checkpoint directory of another run" in capsys.readouterr().err
    assert sorted(os.listdir(other)) == before and (other / "latest").read_text() == "1"


def test_another_optimizer_may_start_from_a_checkpoint_without_optimizer_state(tmp_path):
    cfg, model, opt = tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # differs from a fresh model's init
    root = str(tmp_path / "run")
    save(root, 1, cfg, model, opt)  # no step yet: no optimizer state saved
    cfg2, model2, opt2 = tiny("--optimizer", "sgd")
    ck.load_checkpoint(root, model2, opt2, local_state(), cfg2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    assert not opt2.state


# ----------------------------------------------------------------------------- --use-checkpoint-args: merged values
@pytest.mark.parametrize(
    "ckpt_flags, flags, message",
    [
        # the default --hidden-size is 128 (128 % 4 == 0): the message must quote the checkpoint's 32
        ([], ["--num-attention-heads", "3"], "--hidden-size 32 must be divisible by --num-attention-heads 3"),
        # the default --num-experts is 4: the checkpoint's 8 is what the run would use
        (["--num-experts", "8"], ["--moe-router-topk", "9"], "--moe-router-topk 9 exceeds --num-experts 8"),
        (["--num-experts", "8"], ["--moe-router-topk", "6"], None),  # valid with the checkpoint's 8 experts
    ],
    ids=["heads-vs-hidden", "topk-vs-experts", "topk-fits"],
)
def test_use_checkpoint_args_validates_and_quotes_the_checkpoints_values(tmp_path, capsys, ckpt_flags, flags, message):
    from megatron_moe.cli.pretrain import main

    cfg, model, opt = tiny(*ckpt_flags)
    root = str(tmp_path / "run")
    save(root, 1, cfg, model, opt)
    argv = ["--load", root, "--use-checkpoint-args", "--vocab-size", "512", *flags]
    if message is None:
        got = parse_args(argv)
        assert (got.moe.num_experts, got.moe.moe_router_topk, got.model.hidden_size) == (8, 6, 32)
        return
    assert main([*argv, "--save", str(tmp_path / "out")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and not os.path.exists(tmp_path / "out")
    assert f"error: {message} (--use-checkpoint-args: " in cap.err and root in cap.err, cap.err
