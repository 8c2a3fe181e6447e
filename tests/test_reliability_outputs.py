"""Output paths are checked at start-up, before any iteration and before anything is written:
--save, --tensorboard-dir, --wandb-save-dir, --log-json, --lancet-report and --profile-dir must be
creatable, writable and of the right kind (directory or file); a bad one ends the trainer with one
`error:` line naming the flag and the path, exit status 2. One writer per --save: a lock held
for the run, and a run without --load refuses a --save that already holds checkpoints. Ctrl-C
(SIGINT) ends a run with one line and exit status 130, no traceback and no temporary checkpoint."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_moe import checkpointing as ck
from megatron_moe.cli.pretrain import main as pretrain_main
from tiny_run import tiny_args

# a directory nobody can create entries in, whatever the user (root included): sysfs refuses mkdir
UNWRITABLE = "/sys"


def run(sample_data, capsys, *extra, iters=2):
    """(exit status, stdout, stderr lines) of the trainer run in this process."""
    code = pretrain_main(tiny_args(sample_data, iters, *extra))
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def trained(stdout: str) -> bool:
    return " iteration " in stdout


def bad_output_cases(tmp_path):
    """name -> (flags, the message after `error: `, paths that must not exist afterwards)."""
    afile = tmp_path / "a_file"
    afile.write_text("x")
    adir = tmp_path / "a_dir"
    adir.mkdir()
    no = f"{UNWRITABLE}/mmoe-no-such-dir"
    return {
        "save-unwritable": (["--save", no], f"--save {no} cannot be created in {UNWRITABLE} (", [no]),
        "save-is-a-file": (["--save", str(afile)], f"--save {afile} exists and is not a directory", []),
        "save-under-a-file": (
            ["--save", f"{afile}/ckpt"],
            f"--save {afile}/ckpt cannot be created: {afile} is not a directory",
            [],
        ),
        "tensorboard-unwritable": (
            ["--tensorboard-dir", no],
            f"--tensorboard-dir {no} cannot be created in {UNWRITABLE} (",
            [no],
        ),
        "wandb-save-dir-unwritable": (
            ["--wandb-project", "p", "--wandb-save-dir", no],
            f"--wandb-save-dir {no} cannot be created in {UNWRITABLE} (",
            [no],
        ),
        "log-json-unwritable": (
            ["--log-json", f"{UNWRITABLE}/mmoe.jsonl"],
            f"--log-json {UNWRITABLE}/mmoe.jsonl cannot be created in {UNWRITABLE} (",
            [],
        ),
        "log-json-is-a-directory": (["--log-json", str(adir)], f"--log-json {adir} is a directory, not a file", []),
        "lancet-report-under-a-file": (
            ["--lancet-report", f"{afile}/r.json"],
            f"--lancet-report {afile}/r.json cannot be created: {afile} is not a directory",
            [],
        ),
        "profile-dir-is-a-file": (
            ["--profile", "--profile-step-start", "1", "--profile-step-end", "2", "--profile-dir", str(afile)],
            f"--profile-dir {afile} exists and is not a directory",
            [],
        ),
    }


CASES = [
    "save-unwritable",
    "save-is-a-file",
    "save-under-a-file",
    "tensorboard-unwritable",
    "wandb-save-dir-unwritable",
    "log-json-unwritable",
    "log-json-is-a-directory",
    "lancet-report-under-a-file",
    "profile-dir-is-a-file",
]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_output_path_is_refused_before_any_iteration_naming_the_flag(sample_data, tmp_path, capsys, case):
    flags, message, absent = bad_output_cases(tmp_path)[case]
    before = sorted(os.listdir(tmp_path))
    code, stdout, err = run(sample_data, capsys, *flags)
    assert code == 2, err
    assert len(err) == 1 and f": error: {message}" in err[0], err
    assert not trained(stdout)
    assert sorted(os.listdir(tmp_path)) == before  # nothing written
    assert not any(os.path.lexists(p) for p in absent)
    assert not any(n.startswith(".write-check") for n in os.listdir(UNWRITABLE))


def test_creatable_output_paths_leave_nothing_but_the_outputs(sample_data, tmp_path, capsys):
    out = tmp_path / "out"
    flags = [
        "--save",
        str(out / "a" / "ckpt"),
        "--tensorboard-dir",
        str(out / "b" / "tb"),
        "--log-json",
        str(out / "c" / "log.jsonl"),
        "--lancet-report",
        str(out / "d" / "lancet.json"),  # no Lancet in this run: only checked, never written
    ]
    code, stdout, err = run(sample_data, capsys, *flags)
    assert code == 0, err
    assert sorted(os.listdir(out)) == ["a", "b", "c"]
    assert sorted(os.listdir(out / "a" / "ckpt")) == ["iter_0000002", "latest"]
    assert os.listdir(out / "c") == ["log.jsonl"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".write-check")]


def test_a_link_inside_save_is_refused_at_start_up_and_its_target_untouched(sample_data, tmp_path, capsys):
    save = tmp_path / "ckpt"
    save.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, save / "latest.tmp")
    code, stdout, err = run(sample_data, capsys, "--save", str(save))
    assert code == 2 and len(err) == 1, err
    assert (
        f": error: --save {save}: {save / 'latest.tmp'} is a symbolic link where a regular file is expected" in err[0]
    )
    assert not trained(stdout)
    assert victim.read_text() == "precious" and os.listdir(save) == ["latest.tmp"]


# ----------------------------------------------------------------------------- one writer per --save
def test_a_second_trainer_on_the_same_save_is_refused_naming_the_directory_and_the_holder(
    sample_data, tmp_path, capsys
):
    from megatron_moe.arguments import parse_args
    from megatron_moe.training import Trainer

    save = tmp_path / "ckpt"
    first = Trainer(parse_args(tiny_args(sample_data, 2, "--save", str(save))))  # started, not yet trained
    try:
        capsys.readouterr()
        code, stdout, err = run(sample_data, capsys, "--save", str(save), iters=3)
        assert code == 2 and len(err) == 1, err
        assert f": error: --save {save} is being written by another process (PID {os.getpid()} holds" in err[0]
        assert not trained(stdout)
        first.train()
    finally:
        first.stop.restore()
        first.release_save_dir()
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest"]  # the first run's, lock file removed
    assert (save / "latest").read_text() == "2"


def test_reshard_into_a_directory_a_trainer_is_writing_is_refused(sample_data, tmp_path, capsys):
    from megatron_moe.arguments import parse_args
    from megatron_moe.training import Trainer
    from test_reliability_links import convert_tool

    src = tmp_path / "src"
    assert run(sample_data, capsys, "--save", str(src))[0] == 0
    save = tmp_path / "ckpt"
    trainer = Trainer(parse_args(tiny_args(sample_data, 2, "--save", str(save))))
    try:
        capsys.readouterr()
        code = convert_tool().main(["reshard", "--no-progress", "--load", str(src), "--save", str(save)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert f"reshard: error: --save {save} is being written by another process (PID {os.getpid()}" in err[0]
        assert os.listdir(save) == [".writer.lock"]
    finally:
        trainer.stop.restore()
        trainer.release_save_dir()
    assert os.listdir(save) == []


def test_a_fresh_run_on_a_save_holding_checkpoints_is_refused_and_resuming_works(sample_data, tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert run(sample_data, capsys, "--save", str(save), iters=4)[0] == 0
    before = sorted(os.listdir(save))
    code, stdout, err = run(sample_data, capsys, "--save", str(save), "--save-interval", "1", iters=2)
    assert code == 2 and len(err) == 1, err
    assert (
        f": error: --save {save} already holds checkpoints (iter_0000004, latest) and this run has no --load" in err[0]
    )
    assert f"pass --load {save} to resume" in err[0] and not trained(stdout)
    assert sorted(os.listdir(save)) == before and (save / "latest").read_text() == "4"
    # a failed start (the checkpoint does not match) releases the lock: the next run resumes
    code, _, err = run(sample_data, capsys, "--load", str(save), "--save", str(save), "--num-layers", "3", iters=6)
    assert code == 2 and "does not match this run" in err[0]
    code, stdout, err = run(sample_data, capsys, "--load", str(save), "--save", str(save), iters=6)
    assert code == 0, err
    assert " iteration      5/6" in stdout or "iteration      6/6" in stdout
    assert sorted(os.listdir(save)) == ["iter_0000004", "iter_0000006", "latest"]


# ----------------------------------------------------------------------------- Ctrl-C
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERRUPTED = (
    "pretrain_gpt_moe.py: interrupted (SIGINT): stopped without saving; the checkpoints in --save are complete "
    "(to save and stop, send SIGUSR1 to a run started with --exit-signal-handler)"
)


@pytest.mark.parametrize("point", ["after_shards", "after_metadata"])
def test_an_interrupted_save_removes_its_temporary_directory(sample_data, tmp_path, monkeypatch, point):
    from megatron_moe.arguments import parse_args, validate
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.optim import build_optimizer
    from megatron_moe.parallel_state import local_state

    cfg = parse_args(tiny_args(sample_data, 2, "--vocab-size", "512"))
    validate(cfg, 1)
    model = GPT2MoE(cfg, local_state())
    opt, _ = build_optimizer(model, cfg.optim, torch.device("cpu"))
    root = str(tmp_path / "ckpt")
    ck.save_checkpoint(root, 1, 8, model, opt, cfg, local_state())

    def fault(name):
        if name == point:
            raise KeyboardInterrupt

    monkeypatch.setattr(ck, "_fault_point", fault)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(root, 2, 16, model, opt, cfg, local_state())
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest"]
    assert ck.resolve(root).endswith("iter_0000001")


def test_sigint_during_training_exits_130_with_one_line_and_no_temporary_checkpoint(sample_data, tmp_path):
    save = tmp_path / "ckpt"
    args = tiny_args(sample_data, 2000, "--save", str(save), "--save-interval", "1")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt_moe.py"), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # even under a runner that ignores it
        env=dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1"),
    )
    try:
        deadline = time.monotonic() + 300
        while not (save / "latest").exists():  # the first iteration was trained and saved
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: every process of the group
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == INTERRUPTED, err[-3000:]
    assert err.count("interrupted") == 1
    left = sorted(os.listdir(save))
    assert not [n for n in left if n.startswith(".") or "." in n], left  # no .tmp-/.old- copy, the lock released
    assert ck.incomplete_reason(ck.resolve(str(save))) is None


def test_no_space_left_while_saving_ends_with_one_line_and_the_last_checkpoint_intact(
    sample_data, tmp_path, capsys, monkeypatch
):
    """An OSError while writing after start-up (here ENOSPC in the second save) ends the run with one
    `error:` line naming the path, exit status 1, and the previous checkpoint still the one `latest` names."""
    save = tmp_path / "ckpt"
    saves = []

    def fault(name):
        if name == "after_shards":
            saves.append(name)
            if len(saves) == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(save / "iter_0000002"))

    monkeypatch.setattr(ck, "_fault_point", fault)
    code, out, err = run(sample_data, capsys, "--save", str(save), "--save-interval", "1", iters=3)
    assert code == 1 and len(err) == 1, err
    assert f"error: No space left on device: {save / 'iter_0000002'}; make room" in err[0]
    assert ck.resolve(str(save)).endswith("iter_0000001")
    assert sorted(n for n in os.listdir(save) if not n.startswith(".")) == ["iter_0000001", "latest"]
