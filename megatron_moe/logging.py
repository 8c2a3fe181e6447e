"""Console, JSON-lines, TensorBoard and wandb logging, from one rank (the last, as Megatron does).

JSON lines: iteration, loss, lr, grad_norm, ms_per_iter, tokens_per_s, dropped_frac, ... and
`split` for evaluation lines. Console lines start with a local-time stamp `[YYYY-MM-DD HH:MM:SS]`.
TensorBoard (--tensorboard-dir): every numeric value as a scalar `<split>/<name>` (`train/loss`,
`valid/ppl`) at the record's iteration, and `train/expert_load` as a histogram whose bucket e holds
the tokens routed to expert e in the iteration. wandb: offline unless --wandb-mode says otherwise,
no secret in the logged config; the trainer passes the run id (new, or the resumed checkpoint's)
with `resume="allow"`, so a resumed job continues the same run.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Optional

log = logging.getLogger("megatron_moe")

SECRET_KEYS = ("api_key", "wandb_key", "token", "password", "secret")


TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def timestamp(t: Optional[float] = None) -> str:
    """`[2026-11-23 18:30:01]`: local time, to the second."""
    return "[" + time.strftime(TIME_FORMAT, time.localtime(t)) + "]"


def setup_console(rank: int, timestamps: bool = True) -> None:
    level = logging.INFO if rank == 0 or os.environ.get("MEGATRON_MOE_LOG_ALL_RANKS") else logging.WARNING
    fmt = "[%(asctime)s] %(message)s" if timestamps else "%(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt=TIME_FORMAT, stream=sys.stdout, force=True)


def new_wandb_run_id() -> str:
    """A fresh wandb run id (8 lowercase letters and digits, as wandb makes them)."""
    import secrets
    import string

    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def open_tensorboard(log_dir: str):
    """A SummaryWriter on `log_dir`, or a clear error when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch raises ImportError when the tensorboard package is missing
        raise ImportError(
            f"--tensorboard-dir {log_dir} needs the tensorboard package: pip install tensorboard ({e})"
        ) from None
    os.makedirs(log_dir, exist_ok=True)
    return SummaryWriter(log_dir=log_dir)


def log_expert_load(writer, tag: str, counts, step: int) -> None:
    """Histogram of expert ids weighted by tokens routed: bucket e (edges e-0.5, e+0.5) = counts[e]."""
    import numpy as np

    c = np.asarray(counts, dtype=np.float64)
    ids = np.arange(len(c), dtype=np.float64)
    total = float(c.sum())
    if total <= 0:
        return
    writer.add_histogram_raw(
        tag,
        min=float(ids[c > 0].min()),
        max=float(ids[c > 0].max()),
        num=total,
        sum=float((ids * c).sum()),
        sum_squares=float((ids * ids * c).sum()),
        bucket_limits=(ids + 0.5).tolist(),
        bucket_counts=c.tolist(),
        global_step=step,
    )


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

    def __init__(self, cfg, active: bool, config_dict: dict, wandb_run_id: Optional[str] = None):
        self.active = active
        self.json_path: Optional[str] = cfg.logging.log_json if active else None
        self.wandb = None
        self.tensorboard = None
        if self.json_path:
            d = os.path.dirname(os.path.abspath(self.json_path))
            os.makedirs(d, exist_ok=True)
        if active and cfg.logging.tensorboard_dir:
            self.tensorboard = open_tensorboard(cfg.logging.tensorboard_dir)
        if active and wandb_enabled(cfg):
            import wandb

            save_dir = wandb_dir(cfg)
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(
                project=cfg.logging.wandb_project,
                name=cfg.logging.wandb_exp_name,
                mode=cfg.logging.wandb_mode,
                dir=save_dir,
                config=scrub(config_dict),
                id=wandb_run_id,
                resume="allow" if wandb_run_id else None,
            )

    def line(self, text: str) -> None:
        if self.active:
            print(f"{timestamp()} {text}", flush=True)

    def record(self, values: dict, step: int, histograms: Optional[dict] = None) -> None:
        if not self.active:
            return
        if self.json_path:
            with open(self.json_path, "a") as f:
                f.write(json.dumps(values) + "\n")
        prefix = values.get("split", "train")
        if self.tensorboard is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration":
                    self.tensorboard.add_scalar(f"{prefix}/{k}", v, global_step=step)
            for name, counts in (histograms or {}).items():
                log_expert_load(self.tensorboard, f"{prefix}/{name}", counts, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            import wandb

            scalars = {k: v for k, v in values.items() if isinstance(v, (int, float)) and k != "iteration"}
            payload: dict[str, object] = {f"{prefix}/{k}": v for k, v in scalars.items()}
            for name, counts in (histograms or {}).items():
                import numpy as np

                c = np.asarray(counts, dtype=np.float64)
                payload[name] = wandb.Histogram(np_histogram=(c, np.arange(len(c) + 1)))
            self.wandb.log(payload, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def wandb_enabled(cfg) -> bool:
    return bool(cfg.logging.wandb_project) and cfg.logging.wandb_mode != "disabled"


def wandb_dir(cfg) -> str:
    """The `dir` given to wandb.init (wandb writes DIR/wandb/): --wandb-save-dir, else the --save
    directory, else $XDG_CACHE_HOME/megatron-moe; never the current directory."""
    if cfg.logging.wandb_save_dir:
        return cfg.logging.wandb_save_dir
    if cfg.train.save:
        return cfg.train.save
    from megatron_moe.data.paths import cache_home

    return str(cache_home())
