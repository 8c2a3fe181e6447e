"""Pretrain GPT-2 Mixture-of-Experts on WikiText.

Installed as `mmoe-pretrain`; `python pretrain_gpt_moe.py` in the repository runs the same.

  python pretrain_gpt_moe.py                      # tiny model on the bundled sample corpus, CPU;
                                                  # saves to ./checkpoints/gpt2-moe-tiny (a rerun resumes)
  torchrun --nproc-per-node 4 pretrain_gpt_moe.py --tensor-model-parallel-size 2 \\
      --expert-model-parallel-size 2 ...          # any layout; see README for every flag group

Bad input (a flag, a data file, a checkpoint) ends with one `error: ...` line and exit status 2;
a NaN/inf loss or gradient norm ends with one `error: ...` line and exit status 1; Ctrl-C (SIGINT)
ends with one line and exit status 130, no traceback, no temporary checkpoint left (SIGUSR1 with
--exit-signal-handler saves, then exits 0).
"""

import os
import socket
import sys

import torch.distributed as dist

from megatron_moe.arguments import parse_args
from megatron_moe.checkpointing import NonFiniteError
from megatron_moe.distributed.comm_errors import exit_on_comm_error
from megatron_moe.parallel_state import shutdown
from megatron_moe.training import pretrain, use_default_save

BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError)
_claim = None  # keeps the socket that marks this process as the one that reported


def first_to_report() -> bool:
    """True in exactly one failing process of a launch on each node (the first to ask).

    Under torchrun the local workers share the agent's directory of this attempt (the parent of
    their TORCHELASTIC_ERROR_FILE folders): the first creates a marker there (O_EXCL). Otherwise the
    processes of one launch share the parent and MASTER_PORT: the first binds an abstract Unix
    socket named after them, which the kernel frees when it exits, so a process that asks after
    the reporter has exited reports again. Without a launcher, or where neither works, every
    process reports.
    """
    global _claim
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return True
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        marker = os.path.join(os.path.dirname(os.path.dirname(error_file)), "megatron_moe-error-reported")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False
        except OSError:
            pass  # the folder is gone or read-only: the socket below
    if not sys.platform.startswith("linux"):
        return True
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(f"\0megatron_moe-error-{os.getppid()}-{os.environ.get('MASTER_PORT', '')}")
    except OSError:
        s.close()
        return False
    _claim = s
    return True


def main(argv=None) -> int:
    """Parse flags and train; returns the exit status."""
    os.environ.setdefault("WANDB_MODE", "offline")
    try:
        # a collective stuck past --comm-timeout (or a lost peer): `error: ...` once, exit 1
        with exit_on_comm_error():
            cfg = parse_args(argv)
            use_default_save(cfg)  # the default main job saves to checkpoints/gpt2-moe-tiny (--save's help)
            pretrain(cfg)  # returns with Lina's thread joined and the logger closed
            shutdown()  # barrier, destroy every group, join the backends' threads
    except (*BAD_INPUT, NonFiniteError) as e:
        if first_to_report():
            print(f"{os.path.basename(sys.argv[0]) or 'mmoe-pretrain'}: error: {e}", file=sys.stderr, flush=True)
        return 1 if isinstance(e, NonFiniteError) else 2
    except OSError as e:  # writing later: no space left, permissions, a read-only or vanished directory
        if first_to_report():
            print(
                f"{os.path.basename(sys.argv[0]) or 'mmoe-pretrain'}: error: {e.strerror or e}: {e.filename}; "
                "make room or fix the path, then resume with --load from the last complete checkpoint in --save "
                "(a checkpoint is renamed into place only when complete)",
                file=sys.stderr,
                flush=True,
            )
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback, 128 + SIGINT as shells report it
        if first_to_report():
            print(
                f"{os.path.basename(sys.argv[0]) or 'mmoe-pretrain'}: interrupted (SIGINT): stopped without saving; "
                "the checkpoints in --save are complete (to save and stop, send SIGUSR1 to a run started with "
                "--exit-signal-handler)",
                file=sys.stderr,
                flush=True,
            )
        return 130
    finally:
        if dist.is_initialized():  # an error left the groups up
            shutdown(barrier=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
