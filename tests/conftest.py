"""Test-session settings: offline hub and wandb, one OMP thread. The package is imported from
the checkout (pyproject.toml `[tool.pytest.ini_options] pythonpath`), and helper modules in
tests/ (tiny_run, equivalence, ...) through pytest's rootdir-relative import of test files."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("OMP_NUM_THREADS", "1")
