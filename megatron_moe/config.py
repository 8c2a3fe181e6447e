"""Configuration dataclasses: one per concern. CLI flags are generated from them.

Each field's flag is `--` + the field name with `_` -> `-` unless its metadata
gives `flag`; `help` and `choices` come from the metadata too. Validation that
concerns one dataclass lives in its `__post_init__` and names the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


def opt(default, help: str, flag: Optional[str] = None, choices=None, nargs: Optional[str] = None, cli: bool = True):
    """A dataclass field carrying its CLI help text (and optional flag name / choices / nargs);
    cli=False: no flag (a setting for tests and ablations, set from Python)."""
    md = {"help": help, "cli": cli}
    if flag:
        md["flag"] = flag
    if choices:
        md["choices"] = choices
    if nargs:
        md["nargs"] = nargs
    return field(default=default, metadata=md)


def _flag_of(obj, name: str) -> str:
    """The CLI flag of field `name` of dataclass instance `obj` (its metadata `flag`, else --name)."""
    f = obj.__dataclass_fields__[name]
    return f.metadata.get("flag", "--" + name.replace("_", "-"))


def check_fields(obj, rules: dict) -> None:
    """Raise ValueError naming the flag of the first field of `obj` that breaks its rule; `rules`
    maps a field name to (predicate, requirement in words); None values are skipped."""
    for name, (ok, words) in rules.items():
        value = getattr(obj, name)
        if value is not None and not ok(value):
            raise ValueError(f"{_flag_of(obj, name)} must be {words}, got {value!r}")


POSITIVE = (lambda v: v > 0, "positive")
NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
AT_LEAST_ONE = (lambda v: v >= 1, ">= 1")
FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")


@dataclass
class ModelConfig:
    """GPT-2 architecture; MoE layers replace the MLP in every `moe_layer_freq`-th block."""

    num_layers: int = opt(4, "number of transformer blocks")
    hidden_size: int = opt(128, "model dimension M")
    num_attention_heads: int = opt(4, "attention heads")
    ffn_hidden_size: Optional[int] = opt(None, "MLP hidden size H (default 4 * hidden size)")
    seq_length: int = opt(128, "tokens per sample")
    max_position_embeddings: Optional[int] = opt(None, "learned positions (default seq length)")
    vocab_size: int = opt(0, "vocabulary size (0: taken from the tokenizer / data)")
    make_vocab_size_divisible_by: int = opt(
        128, "pad the embedding table to a multiple of this (padded entries are masked out of the softmax)"
    )
    layernorm_epsilon: float = opt(1e-5, "LayerNorm epsilon")
    init_method_std: float = opt(0.02, "std of the normal weight initialization")
    dropout: float = opt(0.0, "dropout on embeddings, attention output and MLP output", flag="--hidden-dropout")

    def __post_init__(self) -> None:
        check_fields(
            self,
            {
                "num_layers": AT_LEAST_ONE,
                "hidden_size": AT_LEAST_ONE,
                "num_attention_heads": AT_LEAST_ONE,
                "ffn_hidden_size": AT_LEAST_ONE,
                "seq_length": AT_LEAST_ONE,
                "max_position_embeddings": AT_LEAST_ONE,
                "vocab_size": NON_NEGATIVE,
                "make_vocab_size_divisible_by": AT_LEAST_ONE,
                "layernorm_epsilon": POSITIVE,
                "init_method_std": NON_NEGATIVE,
                "dropout": FRACTION,
            },
        )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} must be divisible by "
                f"--num-attention-heads {self.num_attention_heads}"
            )
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}"
            )


@dataclass
class MoEConfig:
    """Router and expert settings (docs/DESIGN.md "The MoE layer")."""

    num_experts: int = opt(4, "experts per MoE layer E (0: dense model)")
    moe_layer_freq: int = opt(2, "every this many blocks is an MoE block (the 2nd, 4th, ... by default)")
    moe_router_topk: int = opt(1, "experts per token k (1 <= k <= --num-experts)")
    moe_expert_capacity_factor: float = opt(1.0, "capacity factor f")
    moe_dropless: bool = opt(
        False,
        "dropless MoE (Megatron-Core's mode): no capacity, every routed choice is "
        "kept, only real tokens travel and experts compute only the tokens they receive",
    )
    moe_min_capacity: int = opt(4, "minimum expert capacity")
    moe_router_policy: str = opt(
        "position", "slot assignment / expert choice policy", choices=["position", "batch_prioritized", "random"]
    )
    moe_aux_loss_coeff: float = opt(0.01, "load-balancing loss coefficient")
    moe_z_loss_coeff: float = opt(0.0, "router z-loss coefficient (0: off)")
    moe_schedule: str = opt(
        "auto",
        "MoE layer schedule (Parm): baseline, S1, S2, or auto: the baseline with one MP rank (the schedules "
        "coincide), else the cost model's ranking timed on the layer (--measure-iters)",
        choices=["baseline", "s1", "s2", "auto"],
    )
    moe_s1_local_capacity: bool = opt(
        False, "S1 with Parm's original per-slice capacity (NOT equivalent; an ablation)", cli=False
    )
    moe_saa: bool = opt(
        True, "S2: overlap return all-to-all with MP all-gather (SAA); --no-moe-saa runs them one after the other (AAS)"
    )
    comm_profile: Optional[str] = opt(None, "cache file of the fitted alpha-beta collective costs")

    def __post_init__(self) -> None:
        check_fields(
            self,
            {
                "num_experts": NON_NEGATIVE,
                "moe_layer_freq": AT_LEAST_ONE,
                "moe_expert_capacity_factor": POSITIVE,
                "moe_min_capacity": NON_NEGATIVE,
                "moe_aux_loss_coeff": NON_NEGATIVE,
                "moe_z_loss_coeff": NON_NEGATIVE,
                "moe_router_topk": AT_LEAST_ONE,
            },
        )
        if self.num_experts and self.moe_router_topk > self.num_experts:
            raise ValueError(f"--moe-router-topk {self.moe_router_topk} exceeds --num-experts {self.num_experts}")
        if self.moe_dropless and self.moe_schedule == "s2":
            raise ValueError(DROPLESS_S2_ERROR)


DROPLESS_S2_ERROR = (
    "--moe-dropless cannot be combined with --moe-schedule s2 (S2 pads every expert to the "
    "capacity); use --moe-schedule baseline, s1 or auto"
)


@dataclass
class ParallelConfig:
    """Parallel degrees; data parallel is what is left of the world size."""

    tensor_model_parallel_size: int = opt(1, "MP degree (Megatron tensor parallel)")
    expert_model_parallel_size: int = opt(1, "EP degree")
    expert_sharding_parallel_size: int = opt(1, "ESP degree: expert hidden dim sharded over this many ranks")
    device: str = opt(
        "auto",
        "device of the run: cuda (this rank's GPU, LOCAL_RANK), cpu, or auto "
        "(cuda when available and --distributed-backend is not gloo, else cpu)",
        choices=["auto", "cpu", "cuda"],
    )
    distributed_backend: Optional[str] = opt(
        None, "gloo or nccl (default: nccl on --device cuda, gloo on cpu)", choices=["gloo", "nccl"]
    )
    comm_timeout: float = opt(600.0, "seconds before a stuck collective becomes an error")

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cpu" and self.distributed_backend == "nccl":
            raise ValueError("--distributed-backend nccl needs --device cuda (NCCL has no CPU tensors)")
        check_fields(
            self,
            {
                "tensor_model_parallel_size": AT_LEAST_ONE,
                "expert_model_parallel_size": AT_LEAST_ONE,
                "expert_sharding_parallel_size": AT_LEAST_ONE,
                "comm_timeout": POSITIVE,
            },
        )


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: str = opt("adamw", "optimizer", choices=["adamw", "sgd"])
    lr: float = opt(1e-3, "peak learning rate")
    min_lr: float = opt(0.0, "final learning rate of the decay (Megatron-LM's default 0)")
    lr_warmup_iters: int = opt(20, "linear warmup iterations")
    lr_decay_style: str = opt("cosine", "decay after warmup", choices=["cosine", "linear", "constant"])
    lr_decay_iters: Optional[int] = opt(None, "decay length (default --train-iters)")
    weight_decay: float = opt(0.01, "decoupled weight decay (not on biases and LayerNorm)")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.95, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    sgd_momentum: float = opt(0.9, "SGD momentum")
    clip_grad: float = opt(1.0, "global gradient-norm clip (0: off)")
    bf16: bool = opt(False, "bf16 autocast with fp32 master weights")

    def __post_init__(self) -> None:
        check_fields(
            self,
            {
                "lr": NON_NEGATIVE,
                "min_lr": NON_NEGATIVE,
                "lr_warmup_iters": NON_NEGATIVE,
                "lr_decay_iters": AT_LEAST_ONE,
                "weight_decay": NON_NEGATIVE,
                "adam_beta1": FRACTION,
                "adam_beta2": FRACTION,
                "adam_eps": POSITIVE,
                "sgd_momentum": FRACTION,  # >= 1 makes the velocity grow without bound
                "clip_grad": NON_NEGATIVE,
            },
        )
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} must be <= --lr {self.lr} (pass a smaller --min-lr)")


@dataclass
class DataConfig:
    """Where the tokens come from."""

    data_path: Optional[Union[str, list[str]]] = opt(
        None,
        "PREFIX (files PREFIX.{bin,idx}, cut by --split; or PREFIX_{train,valid,test}_text_document"
        ".{bin,idx}), or a weighted blend 'W1 PREFIX1 W2 PREFIX2 ...' as in Megatron "
        "(default: the bundled sample corpus, preprocessed once; see data/README.md)",
        nargs="+",
    )
    tokenizer_name_or_path: Optional[str] = opt(None, "tokenizer directory/hub name (default: beside the data)")
    num_workers: int = opt(0, "dataloader workers")
    split: str = opt(
        "969,30,1",
        "train,valid,test weights cutting a single PREFIX.{bin,idx} corpus into "
        "document ranges (unused for per-split PREFIX_{train,valid,test}_text_document files)",
    )

    def __post_init__(self) -> None:
        if isinstance(self.data_path, (list, tuple)):
            self.data_path = self.data_path[0] if len(self.data_path) == 1 else list(self.data_path)
        from megatron_moe.data.paths import parse_split

        parse_split(self.split)  # error naming --split
        check_fields(self, {"num_workers": NON_NEGATIVE})


# where the default main job saves (TrainConfig.save's help) and mmoe-generate loads from, under the current directory
DEFAULT_SAVE = "checkpoints/gpt2-moe-tiny"


@dataclass
class TrainConfig:
    """Loop lengths, batch sizes, checkpoints."""

    micro_batch_size: int = opt(4, "samples per micro-batch per data-parallel rank")
    global_batch_size: Optional[int] = opt(None, "samples per iteration (default micro x DP)")
    train_iters: int = opt(300, "iterations")
    eval_interval: int = opt(
        100,
        "evaluate on valid every this many iterations, and on valid and test at the end (0: never, not even at the end)",
    )
    eval_iters: int = opt(10, "valid/test global batches per evaluation (each --global-batch-size samples)")
    seed: int = opt(1234, "random seed")
    save: Optional[str] = opt(
        None,
        "checkpoint directory to write (default: none, except that the default main job, run with no --load, "
        "--data-path, --tokenizer-name-or-path, model or MoE flag, saves to checkpoints/gpt2-moe-tiny under the "
        "current directory, and resumes from there when it holds a checkpoint; --save '' saves nothing)",
    )
    load: Optional[str] = opt(None, "checkpoint directory to resume from")
    save_interval: Optional[int] = opt(0, "save every this many iterations (0: only at the end if --save)")
    exit_interval: int = opt(0, "stop after this many iterations of this run (0: never; for tests)")
    keep_last: int = opt(0, "keep only the newest N checkpoints under --save (0: keep all)")
    use_checkpoint_args: bool = opt(
        False,
        "take the model and MoE flags from the --load checkpoint's metadata "
        "(flags given on the command line win, as in Megatron)",
    )
    check_for_nan_in_loss_and_grad: bool = opt(
        True,
        "stop with an error when the loss or the gradient norm is "
        "NaN/inf (the step is not applied, nothing non-finite is saved)",
    )
    exit_duration_in_mins: float = opt(
        0.0,
        "save (with --save) and exit 0 once this run has lasted this many "
        "minutes; all ranks stop at the same iteration (0: never)",
    )
    exit_signal_handler: bool = opt(
        True,
        "on SIGUSR1 (e.g. sbatch --signal=USR1@300) save and exit 0 at the next iteration boundary, all ranks together",
    )
    compile: bool = opt(
        False,
        "torch.compile each transformer block (as torchtitan): dense blocks whole, MoE blocks their attention "
        "(the MoE layer stays eager: collectives, uneven shapes and its own autograd functions)",
    )

    def __post_init__(self) -> None:
        check_fields(
            self,
            {
                "micro_batch_size": AT_LEAST_ONE,
                "global_batch_size": AT_LEAST_ONE,
                "train_iters": AT_LEAST_ONE,
                "eval_interval": NON_NEGATIVE,
                "eval_iters": NON_NEGATIVE,
                "save_interval": NON_NEGATIVE,
                "exit_interval": NON_NEGATIVE,
                "keep_last": NON_NEGATIVE,
                "exit_duration_in_mins": NON_NEGATIVE,
            },
        )
        if self.use_checkpoint_args and not self.load:
            raise ValueError("--use-checkpoint-args needs --load")


@dataclass
class LoggingConfig:
    """Console, JSON lines and wandb."""

    log_interval: int = opt(10, "iterations between log lines")
    log_json: Optional[str] = opt(None, "append metrics as JSON lines to this file")
    wandb_project: Optional[str] = opt(None, "wandb project (enables wandb)")
    wandb_exp_name: Optional[str] = opt(None, "wandb run name")
    wandb_mode: str = opt("offline", "wandb mode", choices=["offline", "online", "disabled"])
    wandb_save_dir: Optional[str] = opt(
        None, "wandb writes DIR/wandb/ (default: the --save directory, else $XDG_CACHE_HOME/megatron-moe)"
    )
    tensorboard_dir: Optional[str] = opt(
        None, "write TensorBoard event files here: the log line's scalars and expert-load histograms"
    )
    profile: bool = opt(
        False,
        "record a torch.profiler Chrome trace of iterations "
        "[--profile-step-start, --profile-step-end) on --profile-ranks",
    )
    profile_step_start: int = opt(10, "first profiled iteration (counted as iterations already done)")
    profile_step_end: int = opt(12, "profiling stops before this iteration")
    profile_ranks: list[int] = opt((0,), "global ranks that write a trace", nargs="+")
    profile_dir: Optional[str] = opt(None, "trace directory (default SAVE/profile; needs --save or this flag)")

    def __post_init__(self) -> None:
        self.profile_ranks = [int(r) for r in self.profile_ranks]
        if self.profile and self.profile_step_end <= self.profile_step_start:
            raise ValueError(
                f"--profile-step-end ({self.profile_step_end}) must be greater than "
                f"--profile-step-start ({self.profile_step_start})"
            )
        if self.profile and self.profile_step_start < 0:
            raise ValueError("--profile-step-start must be >= 0")
        check_fields(self, {"log_interval": AT_LEAST_ONE})


@dataclass
class OptimizationsConfig:
    """Switches of the communication optimizations (each exactly equivalent to the plain run)."""

    measure_iters: int = opt(
        3,
        "timed passes of each alternative wherever the run measures and chooses (`megatron_moe/choose.py`: "
        "Parm's auto schedule, Lancet's plan, Lina, Lina's packing, Pro-Prophet's placement), after warm-up "
        "rounds; an alternative is kept only if faster than the simpler one by more than 2 %% on the slowest "
        "rank. 0: measure nothing (Parm keeps the cost model's schedule, Lancet the planner's plan, Lina, "
        "packing and Pro-Prophet stay on)",
    )
    lina: bool = opt(
        False,
        "Lina: gradient all-reduce in micro-ops that yield to all-to-all, kept only when measured faster than "
        "the plain all-reduce (--measure-iters training iterations each, from the first; 0: always Lina)",
    )
    lina_partition_mb: float = opt(30.0, "Lina micro-op size in MB")
    lina_pipeline_chunks: int = opt(
        1,
        "Lina: split each MoE layer's all-to-alls into this many token-chunk "
        "micro-ops pipelined with the expert FFN (1: no pipelining)",
    )
    lina_packing: bool = opt(
        False,
        "Lina expert packing: from iteration 10, every 4 iterations, when an FFN micro-op is "
        "shorter than an all-to-all micro-op (max over ranks) halve EP and double expert-DP "
        "(more experts per rank), kept only when measured faster (--measure-iters iterations in each "
        "layout, after Lina's and Pro-Prophet's measurements; 0: the rule decides); the same training curve",
    )
    lina_max_experts_per_rank: int = opt(
        0, "Lina expert packing: never pack beyond this many experts per rank (0: no bound)"
    )
    lancet_wgrad: bool = opt(False, "Lancet: defer weight-gradient GEMMs under all-to-alls")
    lancet_partition: bool = opt(False, "Lancet: batch-partitioned pipelining around MoE layers")
    lancet_max_partitions: int = opt(8, "Lancet rho: max partitions")
    lancet_group_ms: float = opt(1.0, "Lancet gamma: op group size in ms")
    lancet_max_range: int = opt(8, "Lancet iota: max range in op groups")
    lancet_report: Optional[str] = opt(None, "write Lancet's plan and timings to this JSON file")
    pro_prophet: bool = opt(
        False,
        "Pro-Prophet (needs --moe-dropless): replicate heavy experts on other EP ranks "
        "for one iteration, planned from the last iteration's token counts; Trans/Agg of "
        "their weights/gradients overlapped with compute; after the calibration, kept only when measured "
        "faster than no placement (--measure-iters iterations each, after Lina's measurement; 0: always place)",
    )
    pro_prophet_alpha: float = opt(
        0.25, "Pro-Prophet: balanced when max - min computed tokens per EP rank < alpha x tokens / experts (eq. (7))"
    )
    pro_prophet_n: int = opt(
        0, "Pro-Prophet: EP ranks (those with the fewest tokens for it) a moved expert is not sent to"
    )
    pro_prophet_interval: int = opt(1, "Pro-Prophet: plan every this many iterations (the plan is kept in between)")
    pro_prophet_no_schedule: bool = opt(
        False,
        "Pro-Prophet ablation: Trans/Agg blocking at the point of use instead of overlapped (Algorithm 2)",
        cli=False,
    )

    def __post_init__(self) -> None:
        check_fields(
            self,
            {
                "lina_partition_mb": POSITIVE,
                "lina_pipeline_chunks": AT_LEAST_ONE,
                "lina_max_experts_per_rank": NON_NEGATIVE,
                "measure_iters": NON_NEGATIVE,
                "lancet_max_partitions": AT_LEAST_ONE,
                "lancet_group_ms": POSITIVE,
                "lancet_max_range": AT_LEAST_ONE,
                "pro_prophet_alpha": NON_NEGATIVE,
                "pro_prophet_n": NON_NEGATIVE,
                "pro_prophet_interval": AT_LEAST_ONE,
            },
        )


@dataclass
class Config:
    """Everything a run needs; built by `arguments.parse_args`, which also sets `explicit_flags`
    (the "section.field" names given on the command line; not a field, so not saved)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    opts: OptimizationsConfig = field(default_factory=OptimizationsConfig)

    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to --make-vocab-size-divisible-by (a layout-independent padding)."""
        d = self.model.make_vocab_size_divisible_by
        return -(-self.model.vocab_size // d) * d

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Block `layer_idx` (0-based) is MoE when (idx + 1) % freq == 0: blocks 2, 4, ... for freq 2."""
        return self.moe.num_experts > 0 and (layer_idx + 1) % self.moe.moe_layer_freq == 0
