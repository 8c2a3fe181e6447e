"""Output paths are checked at start-up, before any iteration and before anything is written:
--save, --tensorboard-dir, --wandb-save-dir, --log-json, --lancet-report and --profile-dir must be
creatable, writable and of the right kind (directory or file); a bad one ends the trainer with one
`error:` line naming the flag and the path, exit status 2. One writer per --save: a lock held
for the run, and a run without --load refuses a --save that already holds checkpoints."""

import os

import pytest

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
