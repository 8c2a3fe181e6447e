"""The mutation list of tools/mutation_check.py stays current: every snippet is in the tree exactly
once, applying it gives the replacement, and every mapped test exists (fast: no test is run)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("mutation_check_tool", os.path.join(ROOT, "tools", "mutation_check.py"))
mc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mc  # dataclasses look their module up there
_spec.loader.exec_module(mc)

# test files mapped by mutations before they were merged: run once present
PENDING_FILES = {
    "tests/test_saa_overlap.py",
    "tests/test_lina_gate.py",
    "tests/test_random_routing.py",
    "tests/test_bf16.py",
    "tests/test_clipping.py",
}
ISSUE_FIVE = {"saa_sequential", "lina_imminent_ignored", "random_seed_drops_group", "gate_under_bf16", "clip_inverted"}


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def test_the_list_has_the_issue_five_and_at_least_twenty_in_all():
    names = [m.name for m in mc.MUTATIONS]
    assert len(names) == len(set(names)) == len(mc.by_name())
    assert ISSUE_FIVE <= set(names)
    assert len(names) >= 20
    for m in mc.MUTATIONS:
        assert re.fullmatch(r"[a-z0-9_]+", m.name), m.name
        assert m.doc and m.tests and m.original != m.replacement, m.name


@pytest.mark.parametrize("m", mc.MUTATIONS, ids=lambda m: m.name)
def test_snippet_occurs_once_and_applies(m):
    text = _read(m.path)
    assert text.count(m.original) == 1, f"{m.name}: update its snippet in tools/mutation_check.py"
    mutated = mc.apply_to_text(text, m)
    assert mutated != text
    i = text.index(m.original)
    assert mutated == text[:i] + m.replacement + text[i + len(m.original) :]


@pytest.mark.parametrize("m", mc.MUTATIONS, ids=lambda m: m.name)
def test_mapped_tests_exist(m):
    ready = 0
    for entry in m.tests:
        path = mc.entry_file(entry)
        if not os.path.isfile(os.path.join(ROOT, path)):
            assert path in PENDING_FILES, f"{m.name}: {path} does not exist"
            continue
        ready += 1
        args = mc.entry_args(entry)
        if "::" in args[0]:
            func = args[0].split("::")[1].split("[")[0]
        elif "-k" in args:
            func = args[args.index("-k") + 1]
        else:  # a whole test file: it must hold tests
            assert re.search(r"^def test_", _read(path), re.MULTILINE), f"{m.name}: no test in {path}"
            continue
        assert re.search(rf"^def {re.escape(func)}\(", _read(path), re.MULTILINE), f"{m.name}: no test {func} in {path}"
    assert ready, f"{m.name}: none of its tests exists yet"


def test_apply_fails_loudly_when_the_snippet_is_missing_or_repeated(tmp_path):
    m = mc.Mutation("x", "doc", "f.py", "a = 1", "a = 2", ("tests/t.py::test_t",))
    (tmp_path / "f.py").write_text("a = 1\nb = 3\n")
    assert mc.apply(str(tmp_path), m) == "a = 1\nb = 3\n"
    assert (tmp_path / "f.py").read_text() == "a = 2\nb = 3\n"
    with pytest.raises(mc.NotApplicable, match="found 0 times"):
        mc.apply(str(tmp_path), m)
    (tmp_path / "f.py").write_text("a = 1\na = 1\n")
    with pytest.raises(mc.NotApplicable, match="found 2 times"):
        mc.apply(str(tmp_path), m)
    assert (tmp_path / "f.py").read_text() == "a = 1\na = 1\n"  # nothing written
    with pytest.raises(mc.NotApplicable, match="does not exist"):
        mc.apply(str(tmp_path), mc.Mutation("y", "d", "g.py", "a", "b", ("t",)))


def test_k_entries_get_their_own_pytest_call():
    calls = mc._group_args(["tests/a.py::t1", "tests/b.py -k 'x and not y'", "tests/a.py::t1"])
    assert calls == [["tests/a.py::t1"], ["tests/b.py", "-k", "x and not y"]]


def test_unknown_names_and_bad_flags_exit_2(capsys):
    assert mc.main(["--only", "clip_inverted,no_such_mutation"]) == 2
    assert "error: --only: unknown mutation(s) no_such_mutation" in capsys.readouterr().err
    assert mc.main(["--timeout", "0", "--list"]) == 2
    assert "error: --timeout must be positive" in capsys.readouterr().err
    assert mc.main(["--list", "--only", "clip_inverted"]) == 0
    assert capsys.readouterr().out.startswith("clip_inverted  [megatron_moe/optim.py]")
