"""Named profiler ranges (`torch.profiler.record_function`) around the stages of the MoE layer."""
from __future__ import annotations

import torch


def annotate(name: str) -> torch.profiler.record_function:
    """A context manager marking `name` (e.g. "moe/router") in a torch profiler trace."""
    return torch.profiler.record_function(name)
