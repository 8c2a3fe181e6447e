"""Trainer checkpoints under MP and ESP: 6 iterations == 3 + save + load + 3, bitwise (AdamW state,
data position, RNG), on MP2 x EP2 and EP2 x ESP2; and an MP2 x EP2 checkpoint resharded to
EP2 x ESP2 by tools/convert_checkpoint.py resumes for three iterations on the uninterrupted curve."""

import importlib.util
import os

import pytest
import torch.distributed as dist

from megatron_moe.arguments import parse_args
from megatron_moe.testing import spawn
from megatron_moe.training import pretrain
from tiny_run import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"MP2xEP2": ("2", "2", "1"), "EP2xESP2": ("1", "2", "2")}
ITERS, SPLIT = 6, 3


def _layout_args(layout):
    mp, ep, esp = LAYOUTS[layout]
    return [
        "--tensor-model-parallel-size",
        mp,
        "--expert-model-parallel-size",
        ep,
        "--expert-sharding-parallel-size",
        esp,
    ]


def _reshard(src: str, dst: str) -> int:
    """tools/convert_checkpoint.py reshard SRC -> EP2 x ESP2 (world 4), with --verify."""
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint_tool", os.path.join(ROOT, "tools", "convert_checkpoint.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    mp, ep, esp = LAYOUTS["EP2xESP2"]
    return tool.main(
        [
            "reshard",
            "--no-progress",
            "--load",
            src,
            "--save",
            dst,
            "--target-tensor-model-parallel-size",
            mp,
            "--target-expert-model-parallel-size",
            ep,
            "--target-expert-sharding-parallel-size",
            esp,
            "--target-world-size",
            "4",
            "--verify",
        ]
    )


def _curve(hist):
    return [(h["iteration"], h["loss"], h["grad_norm"]) for h in hist]


def _on_rank(rank, world, data, root):
    out = {}
    for layout in LAYOUTS:
        args, ckpt = _layout_args(layout), os.path.join(root, layout)
        straight = pretrain(parse_args(tiny_args(data, ITERS, *args)))
        first = pretrain(parse_args(tiny_args(data, ITERS, *args, "--save", ckpt, "--exit-interval", str(SPLIT))))
        second = pretrain(parse_args(tiny_args(data, ITERS, *args, "--load", ckpt)))
        out[layout] = (_curve(straight), _curve(first), _curve(second))
    moved = os.path.join(root, "MP2xEP2-to-EP2xESP2")
    status = _reshard(os.path.join(root, "MP2xEP2"), moved) if rank == 0 else 0
    dist.barrier()
    out["reshard_status"] = status
    out["resharded"] = _curve(pretrain(parse_args(tiny_args(data, ITERS, *_layout_args("EP2xESP2"), "--load", moved))))
    return out


@pytest.fixture(scope="module")
def runs(sample_data, tmp_path_factory):
    return spawn(_on_rank, 4, sample_data, str(tmp_path_factory.mktemp("ckpt")), timeout=900)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_resume_under_the_layout_is_bitwise_the_uninterrupted_run(runs, layout):
    for res in runs:
        straight, first, second = res[layout]
        assert [it for it, _, _ in first] == list(range(1, SPLIT + 1))
        assert [it for it, _, _ in second] == list(range(SPLIT + 1, ITERS + 1))
        assert first + second == straight  # loss and grad norm of every iteration, bitwise


def test_three_iterations_after_a_reshard_follow_the_uninterrupted_curve(runs):
    for res in runs:
        assert res["reshard_status"] == 0
        resumed = res["resharded"]
        assert [it for it, _, _ in resumed] == list(range(SPLIT + 1, ITERS + 1))
        for layout in LAYOUTS:
            straight = res[layout][0][SPLIT:]
            for (it, loss, norm), (_, l_ref, n_ref) in zip(resumed, straight):
                assert abs(loss - l_ref) < 1e-4, f"iteration {it}: {loss} vs uninterrupted {layout} {l_ref}"
                assert abs(norm - n_ref) < 1e-3 * max(1.0, n_ref), f"iteration {it}: grad norm {norm} vs {n_ref}"
