"""Stopping cleanly before a Slurm time limit: SIGUSR1 and --exit-duration-in-mins save and exit 0,
all ranks stop at the same iteration, and a rerun with --load ends on the uninterrupted loss."""

import json
import os
import signal
import subprocess
import sys

import pytest

from megatron_moe.arguments import parse_args
from megatron_moe.testing import spawn
from megatron_moe.training import pretrain
from tiny_run import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = (
    "import sys; from megatron_moe.arguments import parse_args; "
    "from megatron_moe.training import pretrain; pretrain(parse_args(sys.argv[1:]))"
)
ITERS = 12


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1")


def _losses(path) -> dict[int, float]:
    recs = [json.loads(line) for line in open(path)]
    return {r["iteration"]: r["loss"] for r in recs if "split" not in r}


def _latest(ckpt) -> int:
    with open(os.path.join(ckpt, "latest")) as f:
        return int(f.read())


def test_sigusr1_saves_exits_zero_and_a_rerun_reaches_the_uninterrupted_loss(sample_data, tmp_path):
    ckpt, straight_log, cut_log = tmp_path / "ckpt", tmp_path / "straight.jsonl", tmp_path / "cut.jsonl"
    base = tiny_args(sample_data, ITERS, "--log-interval", "1")
    straight = subprocess.run(
        [sys.executable, "-c", TRAIN, *base, "--log-json", str(straight_log)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    cmd = [sys.executable, "-c", TRAIN, *base, "--save", str(ckpt), "--log-json", str(cut_log)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in proc.stdout:  # signal once iteration 2 is logged
        out.append(line)
        if f" iteration      2/{ITERS}" in line:
            proc.send_signal(signal.SIGUSR1)
    rc = proc.wait(timeout=300)
    text = "".join(out)
    assert rc == 0, text[-3000:]
    stopped = _latest(ckpt)
    assert 2 <= stopped < ITERS, text[-3000:]
    assert f"> SIGUSR1: stopping after iteration {stopped}, saving to {ckpt}" in text
    assert max(_losses(cut_log)) == stopped  # nothing ran past the saved iteration

    rerun = subprocess.run([*cmd, "--load", str(ckpt)], env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _latest(ckpt) == ITERS
    resumed, full = _losses(cut_log), _losses(straight_log)
    assert sorted(resumed) == list(range(1, ITERS + 1))
    assert resumed[ITERS] == full[ITERS]  # bitwise: the same final loss
    assert resumed == full


def test_exit_duration_saves_after_the_first_iteration(sample_data, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    hist = pretrain(parse_args(tiny_args(sample_data, 10, "--save", ckpt, "--exit-duration-in-mins", "1e-7")))
    assert len(hist) == 1
    assert _latest(ckpt) == 1
    assert "> exit duration (1e-07 min) reached: stopping after iteration 1" in capsys.readouterr().out
    # the SIGUSR1 handler is the one from before the trainer again
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_negative_exit_duration_names_the_flag():
    with pytest.raises(ValueError, match="--exit-duration-in-mins must be >= 0"):
        parse_args(["--exit-duration-in-mins", "-1"])


def _poll_on_rank(rank, world, flag_rank):
    from megatron_moe.parallel_state import initialize_model_parallel
    from megatron_moe.training import StopControl
    import torch

    ps = initialize_model_parallel(1, 1, 1, "gloo")
    stop = StopControl(0.0, handle_signal=True, ps=ps, device=torch.device("cpu"))
    first = stop.poll()
    if rank == flag_rank:  # as if only this rank had received SIGUSR1
        os.kill(os.getpid(), signal.SIGUSR1)
    second = stop.poll()
    stop.restore()
    return first, second


def test_all_ranks_stop_together_when_one_rank_gets_the_signal():
    assert spawn(_poll_on_rank, 2, 1, timeout=120) == [(None, "SIGUSR1"), (None, "SIGUSR1")]


def test_usr1_to_the_launch_wrapper_reaches_the_trainer_under_torchrun(sample_data, tmp_path):
    """The sbatch launch path: bash (mm_usr1_to_workers) -> torchrun -> trainer. Only the wrapper is
    signalled (as when Slurm signals the task's process group); torchrun must survive, the trainer save."""
    ckpt = tmp_path / "ckpt"
    common = os.path.join(ROOT, "scripts", "common.sh")
    cmd = [
        "bash",
        "-c",
        'source "$0" && mm_usr1_to_workers "$@"',
        common,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        "tests_launch_target",
        *tiny_args(sample_data, 60, "--log-interval", "1", "--save", str(ckpt)),
    ]
    (tmp_path / "tests_launch_target.py").write_text(TRAIN.replace("; ", "\n"))
    env = dict(_env(), PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if " iteration      2/60" in line:
            proc.send_signal(signal.SIGUSR1)  # the wrapper's pid only
    rc = proc.wait(timeout=300)
    text = "".join(out)
    assert rc == 0, text[-3000:]
    stopped = _latest(ckpt)
    assert 2 <= stopped < 60
    assert f"> SIGUSR1: stopping after iteration {stopped}" in text
