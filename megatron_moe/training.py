"""The training loop: distributed setup, data, model, optimizer, steps, eval, checkpoints, logs.

One iteration = one global batch = `global / (micro * DP)` micro-batches per rank; each
micro-batch's loss is (lm + aux) / num_micro, so the accumulated gradient is the global-batch mean.
Gradient all-reduce starts from grad-ready hooks in the last micro-batch's backward (`GradSync`).
SIGUSR1 or --exit-duration-in-mins stops all ranks after the same iteration (`StopControl`), saves
and returns normally; a rerun with --load continues exactly.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from megatron_moe import optimizations
from megatron_moe.arguments import config_to_dict, validate
from megatron_moe.checkpointing import (
    TOKENIZER_DIR,
    NonFiniteError,
    apply_checkpoint_args,
    SaveDirLock,
    check_config,
    complete_iterations,
    link_problem,
    load_checkpoint,
    lock_save_dir,
    read_metadata,
    resolve,
    save_checkpoint,
    tokenizer_source,
)
from megatron_moe.config import DEFAULT_SAVE, Config
from megatron_moe.data.indexed_dataset import MMapIndexedDataset, index_file_path
from megatron_moe.data.paths import (
    WIKITEXT_VOCAB_SIZE,
    default_data_prefix,
    split_prefix,
    tokenizer_dir_for,
    wikitext_cache_prefix,
    wikitext_source,
)
from megatron_moe.data.preprocess import SAMPLE_CORPUS_DIR, one_corpus_files, prepare_sample_data, prepare_wikitext_data
from megatron_moe.data.sampler import build_train_valid_test_data_loaders
from megatron_moe.data.tokenizer import load_tokenizer
from megatron_moe.distributed.comm_errors import CommTimeoutError, guard
from megatron_moe.distributed.grad_sync import GradSync
from megatron_moe.distributed.lina_trial import LinaTrial
from megatron_moe.fileio import output_path_problem
from megatron_moe.layers.fused import kernel_report
from megatron_moe.logging import MetricsLogger, new_wandb_run_id, setup_console, wandb_dir, wandb_enabled
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.packing import ExpertPacking
from megatron_moe.moe.placement import Placement, gather_counts, routed_counts
from megatron_moe.optim import build_optimizer, clip_gradients, lr_at
from megatron_moe.parallel_state import ParallelState, device_and_backend, initialize_model_parallel, local_state
from megatron_moe.profiling import StepProfiler, annotate


def init_distributed(cfg: Config):
    """(ParallelState, device): the process group from torchrun's env (or one process) and the layout's groups."""
    p = cfg.parallel
    device, backend = device_and_backend(p.device, p.distributed_backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not dist.is_initialized():
        if (p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size) != (1, 1, 1):
            raise ValueError("parallel sizes > 1 need several processes: launch with torchrun --nproc-per-node N")
        return local_state(device), device
    if device.type == "cpu":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=p.comm_timeout))
    validate(cfg, dist.get_world_size())
    ps = initialize_model_parallel(
        p.tensor_model_parallel_size,
        p.expert_model_parallel_size,
        p.expert_sharding_parallel_size,
        backend,
        timeout_s=p.comm_timeout,
        device=device,
    )
    return ps, device


T = TypeVar("T")


_RANK0_CALLS = itertools.count()  # names the store key of each `_on_rank0` call (all ranks make the same calls)
# Measured preprocessing: 0.78 MB/s on 2 CPU cores; the wait allows 100 kB/s (8x slower) + 10 min.
WAIT_FIXED_S, WAIT_BYTES_PER_S = 600.0, 100e3
HUB_CORPUS_BYTES = 540e6  # a hub dataset's size is unknown before the download: WikiText-103's


def preprocess_wait_s(directory, comm_timeout: float) -> float:
    """Seconds the other ranks wait for rank 0 to preprocess `directory`'s wiki.* files (None: hub)."""
    try:
        size = sum(f.stat().st_size for f in Path(directory).iterdir() if f.name.startswith("wiki."))
    except (OSError, TypeError):  # None, or a directory this rank cannot see
        size = HUB_CORPUS_BYTES
    return max(comm_timeout, WAIT_FIXED_S + size / WAIT_BYTES_PER_S)


def _on_rank0(ps, work: Callable[[], T], waiting: Optional[tuple[str, float]] = None) -> T:
    """`work()` on global rank 0, its result (or ValueError / FileNotFoundError) shared with every rank.

    `waiting` = (what, seconds): the other ranks wait in the store up to that bound, not in a collective."""
    box: list = [None, None]  # [result, (error type name, message) or None]
    if ps.global_rank == 0:
        try:
            box[0] = work()
        except (ValueError, FileNotFoundError) as e:
            if ps.layout.world_size == 1:
                raise
            box[1] = (type(e).__name__, str(e))
    key = f"megatron_moe/rank0/{next(_RANK0_CALLS)}"
    if ps.layout.world_size > 1 and waiting is None:
        dist.broadcast_object_list(box, src=0, group=ps.group("world"))
    elif ps.layout.world_size > 1:
        store = dist.distributed_c10d._get_default_store()
        if ps.global_rank == 0:
            store.set(key, json.dumps(box))  # a vocabulary size or None, and the error
        else:
            what, bound_s = waiting
            try:
                store.wait([key], timedelta(seconds=bound_s))
            except RuntimeError as e:  # the bound passed, or rank 0 (the store's host) is gone
                raise CommTimeoutError(
                    f"waiting for rank 0 to preprocess {what}: no result within {bound_s:.0f} s (10 min + 10 s "
                    f"per MB of corpus, or --comm-timeout if longer): rank 0 is stuck, dead or far slower than "
                    f"expected; preprocess once with tools/preprocess_data.py and pass --data-path PREFIX "
                    f"(store said: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
                ) from None
            box = json.loads(store.get(key))
    if box[1] is not None:
        raise (FileNotFoundError if box[1][0] == "FileNotFoundError" else ValueError)(box[1][1])
    return box[0]


def prepare_data(cfg: Config, ps: ParallelState) -> str:
    """Preprocess (rank 0, once) the sample corpus (no --data-path) or raw WikiText into
    `paths.default_data_dir()`; set --data-path and --vocab-size (when 0). Returns the summary line."""
    text, where = None, "_{train,valid,test}_text_document.{bin,idx}"
    if cfg.data.data_path is None:
        prefix = default_data_prefix()
        wait = (f"the sample corpus into {prefix}", preprocess_wait_s(SAMPLE_CORPUS_DIR, cfg.parallel.comm_timeout))

        def sample() -> bool:  # whether the files were there already
            there = os.path.isfile(index_file_path(split_prefix(prefix, "train")))
            prepare_sample_data(prefix)
            return there

        reused = _on_rank0(ps, sample, wait)
        text = f"{'reusing' if reused else 'preprocessed'} the bundled sample corpus ({SAMPLE_CORPUS_DIR}) at {prefix}"
        cfg.data.data_path = prefix
    words = [cfg.data.data_path] if isinstance(cfg.data.data_path, str) else list(cfg.data.data_path)
    sources = [wikitext_source(w) for w in words]
    if any(sources) and len(words) > 1:
        raw = next(w for w, s in zip(words, sources) if s)
        raise ValueError(
            f"--data-path: {raw} is raw WikiText, which only a one-word --data-path "
            f"preprocesses; in a blend give preprocessed prefixes (tools/preprocess_data.py)"
        )
    if sources[0] is not None:
        source, tok_name = sources[0], cfg.data.tokenizer_name_or_path
        vocab = None if tok_name else (cfg.model.vocab_size or WIKITEXT_VOCAB_SIZE)
        prefix = wikitext_cache_prefix(source, tok_name, vocab or 0)

        def work() -> list:
            res, reused = prepare_wikitext_data(source, prefix, tok_name, vocab)
            return [res.vocab_size, reused]

        wait_s = preprocess_wait_s(source.directory, cfg.parallel.comm_timeout)
        tok_vocab, reused = _on_rank0(ps, work, (f"{source.word} ({source.label()}) into {prefix}", wait_s))
        text = f"{'reusing' if reused else 'preprocessed'} {source.word} ({source.label()}) at {prefix}"
        if one := " + ".join(f.name for f in one_corpus_files(source)):
            where = f".{{bin,idx}} ({one} as one corpus, cut into train/valid/test by --split {cfg.data.split})"
        cfg.data.data_path = prefix
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = tok_vocab
    if cfg.model.vocab_size == 0:
        tok_dir = cfg.data.tokenizer_name_or_path or tokenizer_dir_for(cfg.data.data_path)
        if not os.path.exists(tok_dir) and cfg.train.load and not cfg.data.tokenizer_name_or_path:
            tok_dir = os.path.join(resolve(cfg.train.load), TOKENIZER_DIR)  # the checkpoint carries it
        if not os.path.exists(tok_dir):
            raise FileNotFoundError(
                f"--vocab-size not given and no tokenizer at {tok_dir}: pass --vocab-size or --tokenizer-name-or-path"
            )
        cfg.model.vocab_size = load_tokenizer(tok_dir).vocab_size
    if text:
        return text + where
    return f"{' '.join(words)} (--data-path)"


def build_loaders(cfg: Config, ps: ParallelState, consumed: int):
    t = cfg.train
    gb = t.global_batch_size
    eval_samples = t.eval_iters * gb if t.eval_iters > 0 and t.eval_interval > 0 else 0  # 0: never
    loaders = build_train_valid_test_data_loaders(
        cfg.data.data_path,
        cfg.model.seq_length,
        t.seed,
        t.micro_batch_size,
        gb,
        ps.rank("dp"),
        ps.size("dp"),
        train_samples=t.train_iters * gb,
        valid_samples=eval_samples,
        test_samples=eval_samples,
        consumed_train_samples=consumed,
        num_workers=cfg.data.num_workers,
        split=cfg.data.split,
    )
    for loader in loaders:
        for indexed in _indexed_datasets(getattr(loader, "dataset", None)):
            indexed.check_vocab(cfg.model.vocab_size)
    return loaders


def _indexed_datasets(dataset) -> list:
    """The indexed datasets under a loader's dataset (a GPTDataset, or a blend holding several)."""
    if dataset is None:
        return []
    if isinstance(dataset, MMapIndexedDataset):
        return [dataset]
    inner = getattr(dataset, "indexed", None)
    if inner is not None:
        return _indexed_datasets(inner)
    return [d for sub in getattr(dataset, "datasets", []) for d in _indexed_datasets(sub)]


def param_counts(cfg: Config) -> tuple[int, int]:
    """(all, active per token) parameters of the whole model: dense ones plus top-k experts per MoE layer."""
    m, moe = cfg.model, cfg.moe
    L, M, H = m.num_layers, m.hidden_size, m.ffn_hidden_size
    n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
    mlp = 2 * M * H + H + M  # a dense MLP's or one expert's weights and biases
    dense = (m.max_position_embeddings + cfg.padded_vocab_size) * M + 2 * M  # embeddings, final layer norm
    dense += L * (4 * M * M + 8 * M) + (L - n_moe) * mlp + n_moe * moe.num_experts * M  # blocks, routers
    return dense + n_moe * moe.num_experts * mlp, dense + n_moe * moe.moe_router_topk * mlp


def model_flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: 6 x active params (but position embeddings) + attention."""
    m = cfg.model
    active = param_counts(cfg)[1] - m.max_position_embeddings * m.hidden_size
    return 6 * active + 12 * m.num_layers * m.seq_length * m.hidden_size


# flags that make a run other than the default main job, which saves to DEFAULT_SAVE (--save's help)
NOT_DEFAULT_JOB = ("model.", "moe.", "data.data_path", "data.tokenizer_name_or_path", "train.save", "train.load")


def use_default_save(cfg: Config) -> None:
    """Default main job: --save DEFAULT_SAVE, and --load it when complete; nothing if it cannot be written."""
    if any(f.startswith(NOT_DEFAULT_JOB) for f in getattr(cfg, "explicit_flags", ())):
        return
    if output_path_problem(DEFAULT_SAVE, "directory"):
        return
    cfg.train.save = DEFAULT_SAVE
    if complete_iterations(DEFAULT_SAVE):
        cfg.train.load = DEFAULT_SAVE


class StopControl:
    """When to save and exit early: SIGUSR1 or --exit-duration-in-mins. The handler only sets a
    flag; `poll()`, at each iteration boundary, all-reduces (MAX) the flags so all ranks agree."""

    def __init__(
        self, exit_duration_mins: float, handle_signal: bool, ps, device: torch.device, start: Optional[float] = None
    ):
        self.start = time.time() if start is None else start  # the run's start (setup counts too)
        self.limit_s = 60.0 * exit_duration_mins
        self.ps, self.device = ps, device
        self.received = False
        self.previous = None
        # decided from the config only, so every rank joins the same all-reduces
        self.collective = (handle_signal or self.limit_s > 0) and ps.layout.world_size > 1
        self.installed = handle_signal and threading.current_thread() is threading.main_thread()
        if self.installed:
            self.previous = signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def poll(self) -> Optional[str]:
        """None to go on, else why to stop ('SIGUSR1' or 'exit duration ...')."""
        flags = [float(self.received), float(self.limit_s > 0 and time.time() - self.start >= self.limit_s)]
        if self.collective:
            t = torch.tensor(flags, dtype=torch.float32, device=self.device)
            with guard("stop-flag all_reduce", self.ps.group("world")):  # a stalled peer: a named timeout
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ps.group("world"))
            flags = t.tolist()
        if flags[0]:
            return "SIGUSR1"
        if flags[1]:
            return f"exit duration ({self.limit_s / 60:g} min) reached"
        return None

    def restore(self) -> None:
        """Put back the SIGUSR1 handler that was there before the trainer."""
        if self.installed:
            signal.signal(signal.SIGUSR1, self.previous if self.previous is not None else signal.SIG_DFL)
            self.installed = False


def profile_dir(cfg) -> Optional[str]:
    """--profile-dir, else SAVE/profile; an error naming the flags when --profile has neither."""
    lg = cfg.logging
    if lg.profile_dir:
        return lg.profile_dir
    if cfg.train.save:
        return os.path.join(cfg.train.save, "profile")
    if lg.profile:
        raise ValueError("--profile needs --profile-dir DIR or --save DIR (traces then go to DIR/profile)")
    return None


def output_paths(cfg) -> list:
    """[(flag, path, "directory" or "file")] of every output path flag given."""
    lg = cfg.logging
    given = [
        ("--save", cfg.train.save, "directory"),
        ("--tensorboard-dir", lg.tensorboard_dir, "directory"),
        ("--wandb-save-dir", lg.wandb_save_dir, "directory"),
        ("--log-json", lg.log_json, "file"),
        ("--lancet-report", cfg.opts.lancet_report, "file"),
        ("--profile-dir", lg.profile_dir, "directory"),
    ]
    return [(flag, path, kind) for flag, path, kind in given if path]


def check_output_paths(cfg) -> None:
    """ValueError naming the flag unless every output path is creatable, writable, of its kind (no links)."""
    for flag, path, kind in output_paths(cfg):
        why = output_path_problem(path, kind)
        if why:
            raise ValueError(f"{flag} {path} {why}")
    problem = link_problem(cfg.train.save) if cfg.train.save else None
    if problem:
        raise ValueError(problem)


# In-training trials, one at a time; Lina's first: its plain arm changes every step's gradient sync.
TRIALS = ("lina", "pro-prophet", "lina-packing")


def take_turns(trials: dict) -> None:
    """Give the turn to the first undecided of `trials` (name in TRIALS -> object with `decided`, `turn`)."""
    first = next((name for name in TRIALS if name in trials and not trials[name].decided), None)
    for name, trial in trials.items():
        trial.turn = name == first


class Trainer:
    """Holds everything of one run; `train()` runs it."""

    def __init__(self, cfg: Config, pro_prophet_plan: Optional[dict] = None):
        """`pro_prophet_plan`: Pro-Prophet's fixed placement instead of planning (`optimizations.apply`)."""
        self.save_lock: Optional[SaveDirLock] = None
        try:
            self._init(cfg, pro_prophet_plan)
        except BaseException:
            self.release_save_dir()  # a failed start leaves --save unlocked
            raise

    def lock_save_dir(self) -> Optional[SaveDirLock]:
        """Rank 0 takes the --save lock (None on the other ranks); a refusal raises on every rank."""
        taken: list = []

        def work() -> None:
            taken.append(lock_save_dir(self.cfg.train.save, resuming=bool(self.cfg.train.load)))

        _on_rank0(self.ps, work)
        return taken[0] if taken else None

    def release_save_dir(self) -> None:
        """Let another run write --save (the end of the run; idempotent)."""
        if self.save_lock is not None:
            self.save_lock.release()

    def _init(self, cfg: Config, pro_prophet_plan: Optional[dict]) -> None:
        self.cfg = cfg
        if cfg.train.load and cfg.train.use_checkpoint_args:
            apply_checkpoint_args(cfg, read_metadata(resolve(cfg.train.load)))
        self.started = started = time.time()
        trace_dir = profile_dir(cfg)
        check_output_paths(cfg)
        self.ps, self.device = init_distributed(cfg)
        if cfg.train.save:  # one writer per --save: rank 0 holds its lock for the run (`checkpointing`)
            self.save_lock = self.lock_save_dir()
        setup_console(self.ps.global_rank)
        if self.ps.layout.world_size == 1:
            validate(cfg, 1)
        torch.manual_seed(cfg.train.seed)
        data_text = prepare_data(cfg, self.ps)
        if cfg.train.load:  # refuse a mismatching checkpoint before building anything
            path = resolve(cfg.train.load)
            check_config(read_metadata(path), cfg, self.ps, path)
        self.model = GPT2MoE(cfg, self.ps, device=self.device)
        self.optimizer, opt_name = build_optimizer(self.model, cfg.optim, self.device)
        self.grad_sync = GradSync(self.model, self.ps)
        self.applied = applied = optimizations.apply(self.model, self.ps, cfg, self.grad_sync, pro_prophet_plan)
        self.lancet = applied.lancet
        if cfg.train.compile:  # after Parm measured its schedules eagerly
            self.model.compile_blocks()
            applied.changes.append("compile: torch.compile per block (MoE blocks: attention and layer norms)")
        self.iteration, self.consumed = 0, 0
        self.checkpoint_meta: dict = {}
        if cfg.train.load:
            meta = load_checkpoint(cfg.train.load, self.model, self.optimizer, self.ps, cfg)
            self.iteration, self.consumed = meta["iteration"], meta["consumed_samples"]
            self.checkpoint_meta = meta
        o = cfg.opts
        self.lina_trial = (  # Lina kept only if measured faster than the plain gradient sync (`distributed.lina_trial`)
            LinaTrial(
                self.grad_sync,
                applied.lina,
                self.ps,
                o.measure_iters,
                self.set_lina_pipeline if o.lina_pipeline_chunks > 1 else None,
            )
            if applied.lina is not None and o.measure_iters
            else None
        )
        self.packing = (  # Lina's expert packing: a layout change between iterations (`moe.packing`)
            ExpertPacking(
                self.model, self.optimizer, self.ps, cfg.moe.num_experts, o.lina_max_experts_per_rank, o.measure_iters
            )
            if o.lina_packing
            else None
        )
        parts = (self.lina_trial, applied.pro_prophet, self.packing)
        self.trials = {name: part for name, part in zip(TRIALS, parts) if part is not None}
        self.is_logger = self.ps.global_rank == self.ps.layout.world_size - 1
        self.wandb_run_id = self.choose_wandb_run_id()
        self.logger = MetricsLogger(cfg, self.is_logger, config_to_dict(cfg), wandb_run_id=self.wandb_run_id)
        lg = cfg.logging
        self.profiler = StepProfiler(
            lg.profile,
            lg.profile_step_start,
            lg.profile_step_end,
            lg.profile_ranks,
            self.ps.global_rank,
            trace_dir,
            self.device,
        )
        self.train_loader, self.valid_loader, self.test_loader = build_loaders(cfg, self.ps, self.consumed)
        # the SIGUSR1 handler goes in last: nothing below can fail and leave it installed
        self.stop = StopControl(
            cfg.train.exit_duration_in_mins, cfg.train.exit_signal_handler, self.ps, self.device, start=started
        )
        self.num_micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * self.ps.size("dp"))
        self.saved: Optional[tuple] = None  # (--save, iteration) of the last save
        self.evals: dict = {}  # split -> the last evaluation's record
        for line in self.startup_summary(data_text, opt_name) + applied.changes:
            self.logger.line(f"> {line}")

    def startup_summary(self, data_text: str, opt_name: str) -> list[str]:
        """The start-up lines: model, parameters, layout, data, tokenizer, device, the run, checkpoints."""
        cfg, lay, m, moe, t = self.cfg, self.ps.layout, self.cfg.model, self.cfg.moe, self.cfg.train
        (total, active), k, E = param_counts(cfg), moe.moe_router_topk, moe.num_experts
        n_moe = sum(cfg.is_moe_layer(i) for i in range(m.num_layers))
        routing = "dropless" if moe.moe_dropless else f"capacity factor {moe.moe_expert_capacity_factor:g}"
        gpu = f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" else ""
        evals = f"valid every {t.eval_interval} iterations and test at the end, {t.eval_iters} batches each"
        on_rank = sum(p.numel() for p in self.model.parameters())
        every = f"every {t.save_interval} iterations and " if t.save_interval else ""
        default = t.save == DEFAULT_SAVE and "train.save" not in getattr(cfg, "explicit_flags", {"train.save"})
        plan = [f"resuming {t.load} at iteration {self.iteration}"] if t.load else []
        plan.append(f"saving to {t.save} {every}at the end" if t.save else "none saved (no --save)")
        if default:
            plan[-1] += f" (the default main job's --save{' and --load' if t.load else ''}; --save DIR for another)"
        if self.iteration >= t.train_iters:
            plan.append(f"nothing to train: it is at --train-iters {t.train_iters} (a larger one continues)")
        return [
            f"model: GPT-2, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, FFN "
            f"{m.ffn_hidden_size}, sequence {m.seq_length}; "
            + (f"{E} experts in {n_moe} MoE layers, top-{k}, {routing}" if E else "dense"),
            f"parameters: {total:,} ({total / 1e6:.2f}M), {active:,} ({active / 1e6:.2f}M) active per token"
            + (f" (top-{k} of {E} experts)" if E else ""),
            f"layout: world {lay.world_size} MP{lay.mp} EP{lay.ep} ESP{lay.esp} DP{lay.dp} expert-DP{lay.expert_dp}"
            + (f"; {on_rank:,} parameters on this rank" if on_rank != total else ""),
            f"data: {data_text}",
            f"tokenizer: {tokenizer_source(cfg) or 'none given (--vocab-size)'}, vocab {m.vocab_size}"
            + (f" (padded to {cfg.padded_vocab_size})" if cfg.padded_vocab_size != m.vocab_size else ""),
            f"device: {self.device}{gpu}, {'bf16 autocast, fp32 weights' if cfg.optim.bf16 else 'fp32'}; optimizer "
            f"{opt_name}; "
            + ", ".join(f"{op.replace('_', ' ')} {v.rsplit('.', 1)[-1]}" for op, v in kernel_report().items()),
            f"training: {t.train_iters} iterations of {t.global_batch_size} samples x {m.seq_length} tokens; "
            + (evals if t.eval_interval and t.eval_iters else "no evaluation (--eval-interval 0 or --eval-iters 0)"),
            "checkpoint: " + "; ".join(plan),
        ]

    def set_lina_pipeline(self, on: bool) -> None:
        """Lina's all-to-all pipelining (`--lina-pipeline-chunks`) on or off for every MoE layer (the Lina trial)."""
        self.model.set_pipeline_chunks(self.cfg.opts.lina_pipeline_chunks if on else 1)

    def choose_wandb_run_id(self) -> Optional[str]:
        """The wandb run id: the resumed checkpoint's, else a new one made on rank 0 and shared."""
        if not wandb_enabled(self.cfg):
            return None
        run_id = self.checkpoint_meta.get("wandb_run_id") or new_wandb_run_id()
        if self.ps.layout.world_size > 1:
            obj = [run_id]
            dist.broadcast_object_list(obj, src=0, group=self.ps.group("world"))
            run_id = obj[0]
        return run_id

    def checkpoint_extra(self) -> dict:
        """Extra checkpoint metadata: the wandb run id, so that a resume continues the same run."""
        return {"wandb_run_id": self.wandb_run_id} if self.wandb_run_id else {}

    def save(self) -> None:
        root = self.cfg.train.save
        save_checkpoint(
            root, self.iteration, self.consumed, self.model, self.optimizer, self.cfg, self.ps, self.checkpoint_extra()
        )
        self.saved = (root, self.iteration)
        self.logger.line(f"> saved checkpoint to {root} (iteration {self.iteration})")

    # ------------------------------------------------------------------ one iteration
    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.optim.bf16)

    def micro_batch(self, batch):
        tokens = batch["tokens"].to(self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def train_step(self, batches) -> dict:
        lr = lr_at(self.iteration, self.cfg.optim)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        lm_sum, aux_sum, dropped, choices, loads = 0.0, 0.0, 0, 0, []
        per_layer: dict[int, torch.Tensor] = {}  # block index -> kept tokens per expert, this rank
        routed: dict[int, torch.Tensor] = {}  # dropless: block index -> choices this rank sent per expert
        for i, batch in enumerate(batches):
            ids, labels = self.micro_batch(batch)
            self.grad_sync.accumulating = i < len(batches) - 1
            with self.autocast():
                lm, aux = self.model(ids, labels)
            loss = (lm + aux) / len(batches)
            if self.lancet is not None:
                self.lancet.backward(loss)  # runs deferred dW under the all-to-alls, then flushes
            else:
                loss.backward()
            lm_sum = lm_sum + lm.detach().double()  # on the device: read once per step, with the stats below
            aux_sum = aux_sum + aux.detach().double()
            for layer in self.model.moe_layers():
                kept_E, n = layer.router.device_stats  # on the device: no host read per layer
                dropped, choices = dropped + (n - kept_E.sum()), choices + n
                loads.append(kept_E.float())
                per_layer[layer.layer_idx] = per_layer.get(layer.layer_idx, 0) + kept_E.long()
                if layer.dropless:
                    routed[layer.layer_idx] = routed.get(layer.layer_idx, 0) + routed_counts(layer)
        self.grad_sync.finish()
        balance = self.token_balance(routed) if routed else {}
        norm = clip_gradients(self.model, self.ps, self.cfg.optim.clip_grad)
        sums = [lm_sum / len(batches), aux_sum / len(batches), dropped, choices]
        stats = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in sums])
        stats = self.average_over_dp(stats)
        if self.cfg.train.check_for_nan_in_loss_and_grad:
            self.check_finite(float(stats[0]), norm)
        self.optimizer.step()
        load = torch.stack(loads).sum(0).cpu() if loads else torch.zeros(1, device="cpu")  # host-side log
        imbalance = float(load.max() / load.mean()) if loads and load.mean() > 0 else 1.0
        return {
            "loss": float(stats[0]),
            "aux_loss": float(stats[1]),
            "lr": lr,
            "grad_norm": norm,
            "dropped_frac": float(stats[2] / stats[3]) if stats[3] > 0 else 0.0,
            "load_imbalance": imbalance,
            "expert_load": load.tolist(),
            "expert_counts": {str(i): c.tolist() for i, c in sorted(per_layer.items())},
            **balance,
        }

    def token_balance(self, routed: dict) -> dict:
        """Dropless: tokens per expert and per EP rank with max / mean imbalance (Pro-Prophet: also unplaced)."""
        idx = sorted(routed)
        prophet = self.applied.pro_prophet
        # [L, N_EP, E]; Pro-Prophet's came with the dispatchers' count exchanges (no collective here)
        counts = (
            prophet.collected_counts()
            if prophet is not None
            else gather_counts(self.ps, torch.stack([routed[i] for i in idx]))
        )
        E, n_ep = counts.shape[2], counts.shape[1]
        plain = Placement.of(E, n_ep, {})
        used = [prophet.placement_of(i) if prophet is not None else plain for i in idx]
        per_rank = [sum(col) for col in zip(*(p.computed_tokens(c.tolist()) for p, c in zip(used, counts)))]
        per_expert = counts.sum(dim=(0, 1)).tolist()
        out = {
            "expert_tokens": per_expert,
            "expert_imbalance": max_over_mean(per_expert),
            "rank_tokens": per_rank,
            "rank_imbalance": max_over_mean(per_rank),
        }
        if prophet is not None:
            before = [sum(col) for col in zip(*(plain.computed_tokens(c.tolist()) for c in counts))]
            out["rank_imbalance_no_placement"] = max_over_mean(before)
            out["pro_prophet_replicas"] = sum(len(r) for p in used for r in p.replicas)
            out["pro_prophet_plan"] = {str(i): p.as_dict() for i, p in zip(idx, used)}
            prophet.end_iteration(self.iteration + 1)
        return out

    def check_finite(self, loss: float, grad_norm: float) -> None:
        """NonFiniteError (before the step, on every rank) when the DP-mean loss or global grad norm is NaN/inf."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(
                f"iteration {self.iteration + 1}: non-finite lm loss {loss} or grad norm "
                f"{grad_norm}; the step was not applied and the run stops (the last checkpoint "
                f"is finite; lower --lr or disable with --no-check-for-nan-in-loss-and-grad)"
            )

    def average_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (on the run's device) averaged over DP, returned on the host for logging."""
        if self.ps.size("dp") > 1:
            with guard("loss all_reduce", self.ps.group("dp")):
                dist.all_reduce(t, group=self.ps.group("dp"))
            t = t / self.ps.size("dp")
        return t.cpu()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, loader, split: str) -> Optional[dict]:
        if loader is None:
            return None
        self.model.eval()
        total, n = 0.0, 0
        for batch in loader:
            ids, labels = self.micro_batch(batch)
            with self.autocast():
                lm, _ = self.model(ids, labels)
            total, n = total + lm.item(), n + 1
        self.model.train()
        mean = torch.tensor([total / max(n, 1)], device=self.device, dtype=torch.float64)
        loss = float(self.average_over_dp(mean)[0])
        rec = {"split": split, "iteration": self.iteration, "loss": loss, "ppl": math.exp(min(loss, 50.0))}
        self.logger.line(f" {split} at iteration {self.iteration:6d} | lm loss {loss:.4f} | ppl {rec['ppl']:.2f}")
        self.logger.record(rec, self.iteration)
        self.evals[split] = rec
        return rec

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        cfg, t = self.cfg, self.cfg.train
        history: list[dict] = []
        it = iter(self.train_loader)
        bar = None
        if self.is_logger and sys.stdout.isatty():
            from tqdm import tqdm

            bar = tqdm(total=t.train_iters, initial=self.iteration, desc="train", leave=False)
        tokens_per_iter = t.global_batch_size * cfg.model.seq_length
        flops_per_iter = model_flops_per_token(cfg) * tokens_per_iter
        start_iter = self.iteration
        while self.iteration < t.train_iters:
            self.profiler.before_step(self.iteration)
            take_turns(self.trials)  # at most one in-training trial measures, in TRIALS order
            if self.lina_trial is not None:
                self.lina_trial.before_step()  # Lina or the plain sync for this step, while its trial runs
            if self.packing is not None:
                self.packing.step_begins()  # this step's layout; drops what an evaluation recorded
            t0 = time.perf_counter()
            with annotate("train/step"):
                rec = self.train_step([next(it) for _ in range(self.num_micro)])
            self.iteration += 1
            self.consumed += t.global_batch_size
            dt = time.perf_counter() - t0
            load = rec.pop("expert_load")
            rec.update(
                iteration=self.iteration,
                consumed_samples=self.consumed,
                ms_per_iter=dt * 1e3,
                tokens_per_s=tokens_per_iter / dt,
                tflops=flops_per_iter / dt / 1e12 / self.ps.layout.world_size,
            )
            if self.packing is not None:
                rec["experts_per_rank"] = self.packing.experts_per_rank  # the layout this step ran in
            prophet = self.applied.pro_prophet
            lines = [
                self.lina_trial.after_step() if self.lina_trial is not None else None,
                prophet.take_trial_line() if prophet is not None else None,
                *(self.packing.step_done(self.iteration) if self.packing is not None else []),
            ]
            for line in filter(None, lines):  # the trials' decisions (the same on every rank)
                self.logger.line(f"> {line}")
            history.append(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}")
            if self.iteration % cfg.logging.log_interval == 0 or self.iteration == t.train_iters:
                self.log_train(rec, load)
            if t.eval_interval and self.iteration % t.eval_interval == 0:
                self.evaluate(self.valid_loader, "valid")
            if t.save and t.save_interval and self.iteration % t.save_interval == 0:
                self.save()
            trace = self.profiler.after_step(self.iteration)
            if trace:
                self.logger.line(f"> profile: rank {self.ps.global_rank} wrote {trace}")
            if t.exit_interval and self.iteration - start_iter >= t.exit_interval:
                break
            reason = self.stop.poll()
            if reason:
                self.logger.line(
                    f"> {reason}: stopping after iteration {self.iteration}"
                    + (f", saving to {t.save}" if t.save else " (no --save: nothing is saved)")
                )
                break
        if bar is not None:
            bar.close()
        self.stop.restore()
        trace = self.profiler.close(self.iteration)
        if trace:
            self.logger.line(f"> profile: rank {self.ps.global_rank} wrote {trace}")
        if t.save and (not t.save_interval or self.iteration % t.save_interval):
            self.save()
        if self.iteration >= t.train_iters and t.eval_interval:  # --eval-interval 0: never
            if self.evals.get("valid", {}).get("iteration") != self.iteration:  # not just evaluated
                self.evaluate(self.valid_loader, "valid")
            self.evaluate(self.test_loader, "test")
        for line in self.end_summary(history, start_iter):
            self.logger.line(f"> {line}")
        self.finish(history)
        return history

    def end_summary(self, history: list, start_iter: int) -> list[str]:
        """The end lines: time, throughput, final losses, where the checkpoint and the logs are."""
        t, lg, wall = self.cfg.train, self.cfg.logging, f"{time.time() - self.started:.1f} s (wall)"
        done = f"no iteration trained (at {self.iteration} of {t.train_iters}) in {wall}"
        final = [r for r in self.evals.values() if r["iteration"] == self.iteration]
        losses = [f"{r['split']} {r['loss']:.4f} (ppl {r['ppl']:.2f})" for r in final]
        if history:
            rate = (
                len(history)
                * t.global_batch_size
                * self.cfg.model.seq_length
                * 1e3
                / sum(h["ms_per_iter"] for h in history)
            )
            done = (
                f"iterations {start_iter + 1}-{self.iteration} of {t.train_iters} in {wall}, {rate:.0f} tokens/s mean"
            )
            losses.insert(0, f"train {history[-1]['loss']:.4f}")
        where = "no checkpoint (no --save)"
        if self.saved:
            where = f"checkpoint {self.saved[0]} (iteration {self.saved[1]}; mmoe-generate --load {self.saved[0]} samples from it)"
        logs = [lg.log_json, lg.tensorboard_dir and f"TensorBoard {lg.tensorboard_dir}"]
        logs.append(wandb_enabled(self.cfg) and f"wandb {os.path.join(wandb_dir(self.cfg), 'wandb')}")
        return [
            f"done: {done}" + ("; final lm loss: " + ", ".join(losses) if losses else ""),
            f"outputs: {where}; logs: "
            + (", ".join(filter(None, logs)) or "this console only (--log-json FILE keeps them)"),
        ]

    def log_train(self, rec: dict, load) -> None:
        self.logger.line(
            f" iteration {rec['iteration']:6d}/{self.cfg.train.train_iters} | consumed samples {rec['consumed_samples']:8d}"
            f" | lr {rec['lr']:.3e} | lm loss {rec['loss']:.4f} | aux loss {rec['aux_loss']:.4f}"
            f" | grad norm {rec['grad_norm']:.3f} | ms/iter {rec['ms_per_iter']:.1f}"
            f" | tokens/s {rec['tokens_per_s']:.0f} | TFLOP/s/rank {rec['tflops']:.4f}"
            f" | dropped {100 * rec['dropped_frac']:.2f}% | load imbalance {rec['load_imbalance']:.2f}"
            + balance_text(rec)
        )
        hists = {"expert_load": load, **{k: rec[k] for k in ("expert_tokens", "rank_tokens") if k in rec}}
        self.logger.record(rec, rec["iteration"], histograms=hists)

    def finish(self, history: Optional[list] = None) -> None:
        if self.lancet is not None and self.cfg.opts.lancet_report:
            times = sorted(h["ms_per_iter"] for h in (history or [])[1:]) or [None]
            self.lancet.write_report(measured_iter_ms=times[len(times) // 2])
        if self.lina_trial is not None:
            self.lina_trial.close()
        self.grad_sync.remove()
        if self.packing is not None:
            self.packing.close()
        self.logger.close()
        self.release_save_dir()


def max_over_mean(values: list) -> float:
    """max / mean (1.0 when everything is zero)."""
    mean = sum(values) / max(len(values), 1)
    return float(max(values) / mean) if mean > 0 else 1.0


def balance_text(rec: dict) -> str:
    """The dropless part of the log line: tokens per expert and per EP rank with their imbalance."""
    if "rank_tokens" not in rec:
        return ""
    text = (
        f" | tokens/expert {','.join(map(str, rec['expert_tokens']))} (imbalance {rec['expert_imbalance']:.2f})"
        f" | tokens/EP rank {','.join(map(str, rec['rank_tokens']))} (imbalance {rec['rank_imbalance']:.2f})"
    )
    if "rank_imbalance_no_placement" in rec:
        text += (
            f" | pro-prophet {rec['pro_prophet_replicas']} replicas (rank imbalance without "
            f"{rec['rank_imbalance_no_placement']:.2f})"
        )
    return text


def pretrain(cfg: Config, pro_prophet_plan: Optional[dict] = None) -> list[dict]:
    """Run a Trainer; this rank's per-iteration records. SIGUSR1 handler and --save lock restored on raise."""
    trainer = Trainer(cfg, pro_prophet_plan)
    try:
        return trainer.train()
    finally:
        trainer.stop.restore()
        trainer.release_save_dir()
