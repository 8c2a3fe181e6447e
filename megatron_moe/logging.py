"""Console, JSON-lines and wandb logging, from one rank (the last, as Megatron does).

wandb runs offline unless --wandb-mode says otherwise; nothing secret (an API
key) is ever put in the logged config. Values logged to JSON lines:
iteration, loss, lr, grad_norm, ms_per_iter, tokens_per_s, dropped_frac, ...
and `split` for evaluation lines.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Optional

log = logging.getLogger("megatron_moe")

SECRET_KEYS = ("api_key", "wandb_key", "token", "password", "secret")


def setup_console(rank: int) -> None:
    level = logging.INFO if rank == 0 or os.environ.get("MEGATRON_MOE_LOG_ALL_RANKS") else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stdout, force=True)


def scrub(d: dict) -> dict:
    """A copy of a nested config dict without keys that look like secrets."""
    out = {}
    for k, v in d.items():
        if any(s in k.lower() for s in SECRET_KEYS):
            continue
        out[k] = scrub(v) if isinstance(v, dict) else v
    return out


class MetricsLogger:
    """Writes Megatron-style lines, JSON lines and wandb records (only where `active`)."""

    def __init__(self, cfg, active: bool, config_dict: dict):
        self.active = active
        self.json_path: Optional[str] = cfg.logging.log_json if active else None
        self.wandb = None
        if self.json_path:
            d = os.path.dirname(os.path.abspath(self.json_path))
            os.makedirs(d, exist_ok=True)
        if active and cfg.logging.wandb_project and cfg.logging.wandb_mode != "disabled":
            import wandb
            save_dir = cfg.logging.wandb_save_dir or os.path.join(os.getcwd(), "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.wandb_exp_name,
                                    mode=cfg.logging.wandb_mode, dir=save_dir, config=scrub(config_dict))

    def line(self, text: str) -> None:
        if self.active:
            print(text, flush=True)

    def record(self, values: dict, step: int, histograms: Optional[dict] = None) -> None:
        if not self.active:
            return
        if self.json_path:
            with open(self.json_path, "a") as f:
                f.write(json.dumps(values) + "\n")
        if self.wandb is not None:
            import wandb
            payload = {k: v for k, v in values.items() if isinstance(v, (int, float)) and k != "iteration"}
            prefix = values.get("split", "train")
            payload = {f"{prefix}/{k}": v for k, v in payload.items()}
            for name, counts in (histograms or {}).items():
                import numpy as np
                c = np.asarray(counts, dtype=np.float64)
                payload[name] = wandb.Histogram(np_histogram=(c, np.arange(len(c) + 1)))
            self.wandb.log(payload, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
