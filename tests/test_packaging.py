"""Packaging: pyproject.toml agrees with requirements*.txt and lists every package; the wheel holds
the library, the sample corpus and the four console scripts, and once installed (into a target
directory, away from the checkout) each script's --help and a 2-iteration main job run from
another working directory."""

import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from megatron_moe.data.preprocess import SPLITS, sample_corpus_dir

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "mmoe-pretrain": "megatron_moe.cli.pretrain:main",
    "mmoe-preprocess": "megatron_moe.cli.preprocess:main",
    "mmoe-convert": "megatron_moe.cli.convert:main",
    "mmoe-generate": "megatron_moe.cli.generate:main",
    "mmoe-plan": "megatron_moe.cli.plan:main",
}
USAGE = {
    "mmoe-pretrain": "Pretrain a GPT-2 Mixture-of-Experts model.",
    "mmoe-preprocess": "Tokenize WikiText or jsonl into Megatron indexed datasets",
    "mmoe-convert": "{reshard,import-hf,export,import,export-hf}",
    "mmoe-generate": "Sample text from a checkpoint",
    "mmoe-plan": "Choose the layout and the optimizations for a cluster",
}


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def requirement_lines(path: Path) -> list[str]:
    lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("-r ")]


def test_requirements_files_repeat_the_pyproject_pins():
    project = pyproject()["project"]
    assert requirement_lines(ROOT / "requirements.txt") == project["dependencies"]
    assert requirement_lines(ROOT / "requirements-dev.txt") == project["optional-dependencies"]["dev"]
    assert "-r requirements.txt" in (ROOT / "requirements-dev.txt").read_text().splitlines()
    assert not any(d.startswith("pytest") for d in project["dependencies"])


def test_every_package_of_the_tree_is_listed_and_nothing_else():
    tree = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "megatron_moe").rglob("__init__.py")}
    cfg = pyproject()["tool"]["setuptools"]
    assert set(cfg["packages"]) == tree | {"megatron_moe.sample_corpus"}
    assert cfg["package-dir"] == {"megatron_moe.sample_corpus": "data/wikitext-sample"}
    assert pyproject()["project"]["scripts"] == SCRIPTS


def test_sample_corpus_of_a_checkout_is_the_repository_copy():
    assert sample_corpus_dir() == ROOT / "data" / "wikitext-sample"


def _build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the sources (setuptools writes build/ and *.egg-info beside them)."""
    pytest.importorskip("setuptools", minversion="77")
    src = tmp / "src"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes((ROOT / name).read_bytes())
    for sub in ("megatron_moe", "data/wikitext-sample"):
        for path in (ROOT / sub).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                out = src / path.relative_to(ROOT)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(path.read_bytes())
    wheels = tmp / "wheels"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--wheel-dir",
            str(wheels),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = wheels.glob("megatron_moe-*.whl")
    return wheel


def _check_wheel_contents(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        modules = {str(p.relative_to(ROOT)) for p in (ROOT / "megatron_moe").rglob("*.py")}
        assert modules <= names, sorted(modules - names)
        assert {n.split("/")[0] for n in names} == {"megatron_moe", wheel.name.split("-py3")[0] + ".dist-info"}
        for split in SPLITS:
            packed = z.read(f"megatron_moe/sample_corpus/wiki.{split}.tokens")
            assert packed == (ROOT / "data" / "wikitext-sample" / f"wiki.{split}.tokens").read_bytes()
        info = wheel.name.split("-py3")[0] + ".dist-info"
        entry = z.read(f"{info}/entry_points.txt").decode()
        meta = z.read(f"{info}/METADATA").decode()
        license_files = [n for n in names if n.startswith(info) and n.endswith("LICENSE")]
    scripts = dict(
        line.replace(" ", "").split("=", 1) for line in entry.splitlines() if "=" in line and not line.startswith("[")
    )
    assert scripts == SCRIPTS
    requires = [ln.split(": ", 1)[1] for ln in meta.splitlines() if ln.startswith("Requires-Dist: ")]
    deps = pyproject()["project"]["dependencies"]
    assert [r for r in requires if "extra ==" not in r] == [str(Requirement(d)) for d in deps]
    assert license_files, "LICENSE in the wheel"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel installed with pip into a target directory (no dependencies: this env has them)."""
    tmp = tmp_path_factory.mktemp("pkg")
    wheel = _build_wheel(tmp)
    _check_wheel_contents(wheel)
    target = tmp / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return target


def _run(target: Path, cwd: Path, argv: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """Run with the installed package only: PYTHONPATH is the target, cwd is not the checkout."""
    env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="1", WANDB_MODE="offline")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_wheel_installs_and_every_console_script_runs_from_another_directory(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = _run(
        installed,
        elsewhere,
        [
            sys.executable,
            "-c",
            "import megatron_moe; from megatron_moe.data.preprocess "
            "import sample_corpus_dir; print(megatron_moe.__file__, sample_corpus_dir())",
        ],
    )
    assert probe.returncode == 0, probe.stderr
    module_file, corpus = probe.stdout.split()
    assert Path(module_file).is_relative_to(installed), module_file
    assert Path(corpus) == installed / "megatron_moe" / "sample_corpus"

    for script, usage in USAGE.items():
        for argv in (
            [str(installed / "bin" / script), "--help"],
            [sys.executable, "-m", SCRIPTS[script].split(":")[0], "--help"],
        ):
            proc = _run(installed, elsewhere, argv)
            assert proc.returncode == 0, (argv, proc.stderr[-2000:])
            assert proc.stdout.startswith("usage: ") and usage in proc.stdout, (argv, proc.stdout[:500])

    log = tmp_path / "log.jsonl"
    job = _run(
        installed,
        elsewhere,
        [
            str(installed / "bin" / "mmoe-pretrain"),
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "32",
            "--num-experts",
            "4",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--train-iters",
            "2",
            "--eval-interval",
            "0",
            "--eval-iters",
            "1",
            "--log-interval",
            "1",
            "--log-json",
            str(log),
        ],
    )
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    train = [r for r in map(json.loads, log.read_text().splitlines()) if "split" not in r]
    assert [r["iteration"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in train)
