"""Hand-edited checkpoint metadata is validated (the types and ranges of every field that is read)
before anything is read: the trainer's load path and every convert_checkpoint.py subcommand either
load it correctly or end with one `error:` line naming metadata.json and the field, exit status 2;
never a traceback, an empty export or a reshard written under a negative iteration."""

import copy
import json
import os
import random
import shutil

import pytest
import torch

from megatron_moe import checkpointing as ck
from megatron_moe.parallel_state import local_state
from test_reliability_links import convert_tool, tiny

ITER = "iter_0000001"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A one-iteration tiny checkpoint with optimizer state, and its metadata."""
    root = str(tmp_path_factory.mktemp("meta") / "run")
    cfg, model, opt = tiny()
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    lm, aux = model(ids, ids)
    (lm + aux).backward()
    opt.step()
    ck.save_checkpoint(root, 1, 8, model, opt, cfg, local_state())
    with open(os.path.join(root, ITER, "metadata.json")) as f:
        return root, json.load(f)


def edited(source, tmp_path, meta, name="run") -> str:
    """A copy of the source checkpoint whose metadata.json is `meta`."""
    root = str(tmp_path / name)
    shutil.copytree(source[0], root)
    with open(os.path.join(root, ITER, "metadata.json"), "w") as f:
        json.dump(meta, f)
    return root


def with_field(meta: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(meta)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def trainer_load(root):
    """What the trainer does with --load (the checks before any tensor, then the tensors)."""
    cfg, model, opt = tiny()
    return ck.load_checkpoint(root, model, opt, local_state(), cfg)


BAD = [
    (("layout", "world_size"), 0, "layout.world_size must be an integer >= 1, got 0"),
    (("layout", "world_size"), -2, "layout.world_size must be an integer >= 1, got -2"),
    (("layout", "world_size"), "1", "layout.world_size must be an integer >= 1, got '1'"),
    (("layout", "expert_model_parallel_size"), 0, "layout.expert_model_parallel_size must be an integer >= 1"),
    (("checksums",), [], "checksums must be an object"),
    (("checksums",), {"sha256": "abc"}, "checksums.sha256 must be an object"),
    (("iteration",), -1, "iteration must be an integer >= 0, got -1"),
    (("iteration",), 1.5, "iteration must be an integer >= 0, got 1.5"),
    (("consumed_samples",), -8, "consumed_samples must be an integer >= 0, got -8"),
    (("router_calls",), "many", "router_calls must be a list of integers >= 0"),
    (("shard_specs",), [], "shard_specs must be an object"),
    (("config", "model"), [], "config.model must be an object"),
    (("config", "model", "num_layers"), "2", "config.model.num_layers must be an integer, got '2'"),
]


@pytest.mark.parametrize("field,value,message", BAD, ids=[f"{'.'.join(f)}={v!r}" for f, v, _ in BAD])
def test_a_bad_field_is_refused_naming_the_file_and_the_field(source, tmp_path, capsys, field, value, message):
    root = edited(source, tmp_path, with_field(source[1], field, value))
    meta_path = os.path.join(root, ITER, "metadata.json")
    cc = convert_tool()
    for argv in (
        ["export", "--load", root, "--output", str(tmp_path / "out" / "m.safetensors")],
        ["export", "--load", root, "--iteration", "1", "--output", str(tmp_path / "out" / "m.safetensors")],
        ["reshard", "--load", root, "--save", str(tmp_path / "out" / "ck")],
        ["reshard", "--load", root, "--iteration", "1", "--save", str(tmp_path / "out" / "ck")],
    ):
        code = cc.main([argv[0], "--no-progress", *argv[1:]])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (argv, err)
        assert "error: " in err[0] and f"{meta_path}: {message}" in err[0], (argv, err)
        assert not (tmp_path / "out").exists()
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        trainer_load(root)
    assert f"{meta_path}: {message}" in str(e.value)


def test_null_optional_fields_load_like_absent_ones(source, tmp_path, capsys):
    meta = dict(source[1], router_calls=None, checksums=None, optimizer=None, wandb_run_id=None)
    root = edited(source, tmp_path, meta)
    assert trainer_load(root)["iteration"] == 1
    out = tmp_path / "out" / "m.safetensors"
    assert convert_tool().main(["export", "--no-progress", "--load", root, "--output", str(out)]) == 0
    assert out.exists()


# ----------------------------------------------------------------------------- fuzz
POOL = [None, True, False, 0, 1, -1, 2, 7, -(2**40), 2**40, 1.5, -0.5, "", "x", "1", [], [1, -1], {}, {"a": 1}]


def paths_of(node, prefix=()) -> list:
    """Every (key path) of a JSON tree, containers included."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths_of(v, (*prefix, i))
    return out


def mutate(meta: dict, rng: random.Random) -> dict:
    """1-3 random edits: a field set to a value of the pool, deleted, or an integer nudged."""
    out = copy.deepcopy(meta)
    for _ in range(rng.randint(1, 3)):
        paths = paths_of(out)
        top = [p for p in paths if p[0] != "config" and p[0] != "shard_specs"]
        path = rng.choice(top if top and rng.random() < 0.6 else paths)
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        old, r = parent[path[-1]], rng.random()
        if r < 0.15 and isinstance(parent, dict):
            del parent[path[-1]]
        elif r < 0.35 and isinstance(old, int) and not isinstance(old, bool):
            parent[path[-1]] = old + rng.choice([-2, -1, 1, 2])
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(POOL))
    return out


def snapshot(path) -> set:
    return set(os.listdir(path))


def test_fuzzed_metadata_loads_correctly_or_exits_2_with_one_error_line(source, tmp_path, capsys, monkeypatch):
    rng = random.Random(0)  # this seed's 30th copy has `router_calls: null`, once a TypeError
    cc = convert_tool()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    watched = {p: snapshot(p) for p in (repo, os.path.dirname(str(tmp_path)), os.path.dirname(source[0]))}
    monkeypatch.chdir(tmp_path)
    outcomes = {0: 0, 2: 0}
    for i in range(100):
        meta = mutate(source[1], rng)
        root = edited(source, tmp_path, meta, name=f"run{i}")
        for argv in (
            ["export", "--load", root, "--output", str(tmp_path / f"out{i}" / "m.safetensors")],
            ["reshard", "--load", root, "--save", str(tmp_path / f"out{i}" / "ck")],
        ):
            code = cc.main([argv[0], "--no-progress", *argv[1:]])
            err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln]
            assert code in (0, 2), (i, argv, meta)
            outcomes[code] += 1
            if code == 2:
                assert len(err) == 1 and ": error: " in err[0], (i, argv, err)
        try:
            trainer_load(root)
        except (ValueError, FileNotFoundError) as e:  # what the trainer prints as `error: ...`, exit 2
            assert str(e), i
        shutil.rmtree(root)
        shutil.rmtree(tmp_path / f"out{i}", ignore_errors=True)
    assert outcomes[0] and outcomes[2]  # both outcomes were exercised
    assert {p: snapshot(p) for p in watched} == watched  # nothing written outside tmp_path
