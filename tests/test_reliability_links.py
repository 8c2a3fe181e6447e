"""Symbolic links inside a checkpoint directory are never followed for writes, renames or
deletions: a link where `latest`, `latest.tmp` or an `iter_*` directory is expected is refused
before anything is written, naming the link, and whatever it points to is left untouched."""

import importlib.util
import os
import shutil

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


def tiny(*extra):
    """(cfg, model, optimizer) of the tiny model on one process (no data needed)."""
    cfg = parse_args(tiny_args("/nonexistent/data", 4, "--vocab-size", "512", *extra))
    validate(cfg, 1)
    torch.manual_seed(0)
    model = GPT2MoE(cfg, local_state()).to(CPU)
    opt, _ = build_optimizer(model, cfg.optim, CPU)
    return cfg, model, opt


def save(root, it, *extra):
    cfg, model, opt = tiny(*extra)
    return ck.save_checkpoint(str(root), it, it * 8, model, opt, cfg, local_state())


def tree(path) -> dict:
    """{relative path: bytes or '->target'} of everything under `path` (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, path)
            if os.path.islink(p):
                out[rel] = "->" + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = f.read()
    return out


def convert_tool():
    spec = importlib.util.spec_from_file_location("cc", os.path.join(ROOT, "tools", "convert_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_a_latest_tmp_link_is_refused_and_its_target_is_untouched(tmp_path):
    root = tmp_path / "run"
    save(root, 1)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, root / "latest.tmp")
    before = tree(root)
    with pytest.raises(ValueError, match=f"{root / 'latest.tmp'} is a symbolic link where a regular file is expected"):
        save(root, 2)
    assert victim.read_text() == "precious"
    assert not os.path.islink(root / "latest") and (root / "latest").read_text() == "1"
    assert tree(root) == before  # nothing written, renamed or deleted


@pytest.mark.parametrize("kind", ["keep-last", "resave", "latest"])
def test_a_linked_iteration_or_latest_is_refused_before_anything_is_written(tmp_path, kind):
    elsewhere = tmp_path / "elsewhere"
    save(elsewhere, 1)
    outside = tree(elsewhere)
    root = tmp_path / "run"
    save(root, 2)
    if kind == "latest":
        os.remove(root / "latest")
        os.symlink(elsewhere / "latest", root / "latest")
        link, expected = root / "latest", "regular file"
    else:
        os.symlink(elsewhere / "iter_0000001", root / "iter_0000001")
        link, expected = root / "iter_0000001", "directory"
    before = tree(root)
    with pytest.raises(ValueError, match=f"{link} is a symbolic link where a {expected} is expected"):
        if kind == "keep-last":  # retention would delete iteration 1 through the link
            save(root, 3, "--keep-last", "1")
        elif kind == "resave":  # a re-save moves the old copy aside and deletes it
            save(root, 1)
        else:
            save(root, 3)
    assert tree(elsewhere) == outside
    assert tree(root) == before  # no iter_*.tmp-*, no iter_*.old-*, latest unchanged
    os.remove(link)  # without the link the same save works
    if kind == "latest":
        (root / "latest").write_text("2")
    save(root, 3, "--keep-last", "1")
    assert sorted(os.listdir(root)) == ["iter_0000003", "latest"]


def test_reshard_refuses_a_latest_tmp_link_in_its_output_directory(tmp_path, capsys):
    src = tmp_path / "src"
    save(src, 1)
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, out / "latest.tmp")
    code = convert_tool().main(["reshard", "--no-progress", "--load", str(src), "--save", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"error: --save {out}: {out / 'latest.tmp'} is a symbolic link where a regular file is expected" in err[0]
    assert victim.read_text() == "precious"
    assert sorted(os.listdir(out)) == ["latest.tmp"]


def test_a_linked_save_root_itself_is_allowed(tmp_path):
    """--save may be a link to a directory elsewhere (a scratch file system); only entries inside are checked."""
    real = tmp_path / "scratch"
    real.mkdir()
    os.symlink(real, tmp_path / "run")
    save(tmp_path / "run", 1)
    save(tmp_path / "run", 2, "--keep-last", "1")
    assert sorted(os.listdir(real)) == ["iter_0000002", "latest"]
    shutil.rmtree(real)
