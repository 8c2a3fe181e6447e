"""The planner's memory model (`planner.memory`) against what the trainer's code keeps.

The activation term against the bytes a forward's graph saves for backward (saved_tensors_hooks and
the grouped experts' ctx) on one process and on one rank of EP2 and MP2 (torch's fake process
group); the total against the profiled peak of a tiny one-process run of `Trainer.train_step`
(`tools/validate_plan_memory.py`, which checks the larger layouts).
"""

import contextlib
import importlib.util
import os
import sys

import pytest
import torch

from megatron_moe.fake_world import fake_world
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import initialize_model_parallel, local_state
from megatron_moe.planner.memory import activation_bytes, memory
from megatron_moe.planner.predict import Candidate
from tool_modules import TOOLS

# registered before it runs: its dataclasses look their module up in sys.modules
_spec = importlib.util.spec_from_file_location("validate_plan_memory", os.path.join(TOOLS, "validate_plan_memory.py"))
assert _spec is not None and _spec.loader is not None
V = sys.modules["validate_plan_memory"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(V)
SHAPE = {"layers": 2, "hidden": 64, "seq": 64, "micro": 2}
TOLERANCE = 0.15


@pytest.mark.parametrize("name", ["one-process", "EP2", "MP2", "ESP2"])
def test_activations_match_the_saved_tensors(name):
    run = V.RUNS[name]
    cfg = V.model_config(run, **SHAPE)
    with fake_world(0, run.world) if run.world > 1 else contextlib.nullcontext():
        if run.world > 1:
            ps = initialize_model_parallel(run.mp, run.ep, run.esp, device=torch.device("cpu"))
        else:
            ps = local_state(torch.device("cpu"))
        model = GPT2MoE(cfg, ps)
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_length + 1))
        saved = V.saved_bytes(model, ids[:, :-1], ids[:, 1:])
    act = activation_bytes(cfg, run.mp, run.ep, run.esp, cfg.moe.moe_expert_capacity_factor, 4)
    predicted = act["dense"] + act["moe"]
    assert abs(predicted / saved - 1) <= TOLERANCE, (name, predicted, saved)


def test_total_matches_the_profiled_peak_of_one_process():
    run = V.RUNS["one-process"]
    measured = V.measure(run, SHAPE)[0]["peak"]
    cfg = V.model_config(run, **SHAPE)
    predicted = memory(cfg, Candidate(1, 1, 1, 1), cfg.moe.moe_expert_capacity_factor)["total"]
    assert abs(predicted / measured - 1) <= TOLERANCE, (predicted, measured)
