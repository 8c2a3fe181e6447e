"""Developer tooling and command-line help: each flag's default is stated once (never "None"),
--eval-iters counts global batches, convert's subcommands show their defaults, the markers of
tests/conftest.py name real tests and cover every test that spawns processes, and no tool or
test edits sys.path."""

import ast
import dataclasses
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

import conftest
from megatron_moe.arguments import build_parser
from megatron_moe.cli import convert
from megatron_moe.config import Config
from megatron_moe.testing import run_command

ROOT = Path(__file__).resolve().parents[1]


def help_entries(text: str) -> dict[str, str]:
    """Option help text by its first flag (`--eval-iters`), wrapped lines joined."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        m = re.match(r"  (-[-\w]+)", line)
        if m:
            flag = m.group(1)
            entries[flag] = line
        elif flag and line.startswith("     "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return {k: re.sub(r"\s+", " ", v) for k, v in entries.items()}


def test_pretrain_help_states_every_default_once_and_never_none():
    entries = help_entries(build_parser().format_help())
    defaults = Config()
    checked = 0
    for section in ("model", "moe", "parallel", "optim", "data", "train", "logging", "opts"):
        sub = getattr(defaults, section)
        for f in dataclasses.fields(sub):
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            if not f.metadata.get("cli", True):
                assert flag not in entries  # a setting for tests, benchmarks and ablations
                continue
            entry = entries[flag]
            stated = "(default" in f.metadata.get("help", "")
            value = None if f.name in ("ffn_hidden_size", "max_position_embeddings") else getattr(sub, f.name)
            assert entry.count("(default") == (1 if stated or value is not None else 0), entry
            if value is not None and not stated:
                assert f"(default: {value})" in entry, entry
            checked += 1
    assert "(default: None)" not in build_parser().format_help()
    assert checked == len(entries) - 1  # every flag but -h
    assert entries["--ffn-hidden-size"].endswith("MLP hidden size H (default 4 * hidden size)")


def test_eval_iters_help_counts_global_batches():
    entry = help_entries(build_parser().format_help())["--eval-iters"]
    assert "global batches" in entry and "micro-batch" not in entry


@pytest.mark.parametrize(
    "command,flag,default",
    [
        ("import-hf", "--moe-layer-freq", "2"),
        ("import-hf", "--seed", "1234"),
        ("import-hf", "--moe-expert-capacity-factor", "1.0"),
        ("reshard", "--target-expert-model-parallel-size", "1"),
        ("import", "--target-tensor-model-parallel-size", "1"),
    ],
)
def test_convert_subcommand_help_shows_defaults(command, flag, default, capsys):
    with pytest.raises(SystemExit) as exit_:
        convert.build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0
    entries = help_entries(capsys.readouterr().out)
    assert entries[flag].endswith(f"(default: {default})"), entries[flag]
    assert "(default: None)" not in entries["--iteration" if command == "reshard" else flag]


def _test_functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text(), str(path))
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_marker_tables_name_existing_test_files_and_functions():
    for marker, files in conftest.MARKS.items():
        for filename, names in files.items():
            path = ROOT / "tests" / filename
            assert path.is_file(), (marker, filename)
            if names != conftest.ALL:
                missing = set(names) - set(_test_functions(path))
                assert not missing, (marker, filename, missing)


def _spawns(fn: ast.FunctionDef, functions: dict[str, ast.FunctionDef], seen: set[str]) -> bool:
    """Whether `fn` calls megatron_moe.testing.spawn, directly or through functions of its module."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name == "spawn":
                return True
            if name in functions and name not in seen:
                seen.add(name)
                if _spawns(functions[name], functions, seen):
                    return True
    return False


def test_every_test_that_spawns_ranks_is_marked_multiprocess():
    unmarked = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        functions = _test_functions(path)
        for name, fn in functions.items():
            if not name.startswith("test_"):
                continue
            fixtures = [functions[a.arg] for a in fn.args.args if a.arg in functions]
            if any(_spawns(f, functions, set()) for f in [fn, *fixtures]):
                if not conftest.marked("multiprocess", path.name, name):
                    unmarked.append(f"{path.name}::{name}")
    assert not unmarked, unmarked


def test_no_tool_or_test_edits_sys_path():
    offenders = []
    for path in [*(ROOT / "tools").glob("*.py"), *(ROOT / "tests").glob("*.py"), ROOT / "pretrain_gpt_moe.py"]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                offenders.append(path.name)
    assert not offenders, offenders


def test_run_command_kills_the_whole_group_on_timeout(tmp_path):
    """A launcher's workers must not outlive a timed-out test (an orphaned busy worker slows every later test)."""
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_command(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout=2)
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is delivered at once; give the kernel a moment to reap
        if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the launched command's child {child} outlived the timeout")
