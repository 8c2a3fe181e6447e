"""Run a script (the trainer or a tool) with `torch.set_default_device("meta")` set before anything else.

  python tests/meta_run.py [--meta] SCRIPT.py ARGS...          (also under torchrun)

With --meta every tensor created without an explicit device is a meta tensor, so any
tensor the library (or a tool) forgets to place fails on first use next to a real
one, or silently has no data; the run's results then differ from the run without
--meta. Without --meta the script runs as usual, through the same wrapper.
"""

import runpy
import sys

import torch


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--meta":
        torch.set_default_device("meta")
        argv = argv[1:]
    if not argv:
        sys.exit("usage: meta_run.py [--meta] SCRIPT.py ARGS...")
    script = argv[0]
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
