"""Configuration dataclasses: one per concern. CLI flags are generated from them.

Each field's flag is `--` + the field name with `_` -> `-` unless its metadata
gives `flag`; `help` and `choices` come from the metadata too. Validation that
concerns one dataclass lives in its `__post_init__` and names the flag.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def opt(default, help: str, flag: Optional[str] = None, choices=None):
    """A dataclass field carrying its CLI help text (and optional flag name / choices)."""
    md = {"help": help}
    if flag:
        md["flag"] = flag
    if choices:
        md["choices"] = choices
    return field(default=default, metadata=md)


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
    make_vocab_size_divisible_by: int = opt(128, "pad the embedding table to a multiple of this "
                                            "(padded entries are masked out of the softmax)")
    layernorm_epsilon: float = opt(1e-5, "LayerNorm epsilon")
    init_method_std: float = opt(0.02, "std of the normal weight initialization")
    dropout: float = opt(0.0, "dropout on embeddings, attention output and MLP output", flag="--hidden-dropout")

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} must be divisible by "
                             f"--num-attention-heads {self.num_attention_heads}")
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                             f"{self.max_position_embeddings}")
        if self.hidden_size % self.num_attention_heads == 0 and self.make_vocab_size_divisible_by < 1:
            raise ValueError("--make-vocab-size-divisible-by must be positive")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")


@dataclass
class MoEConfig:
    """Router and expert settings (docs/DESIGN.md "The MoE layer")."""

    num_experts: int = opt(4, "experts per MoE layer E (0: dense model)")
    moe_layer_freq: int = opt(2, "every this many blocks is an MoE block (the 2nd, 4th, ... by default)")
    moe_router_topk: int = opt(1, "experts per token k (1 or 2)")
    moe_expert_capacity_factor: float = opt(1.0, "capacity factor f")
    moe_min_capacity: int = opt(4, "minimum expert capacity")
    moe_router_policy: str = opt("position", "slot assignment / expert choice policy",
                                 choices=["position", "batch_prioritized", "random"])
    moe_aux_loss_coeff: float = opt(0.01, "load-balancing loss coefficient")
    moe_z_loss_coeff: float = opt(0.0, "router z-loss coefficient (0: off)")
    moe_schedule: str = opt("auto", "MoE layer schedule (Parm): baseline, S1, S2 or cost-model choice",
                            choices=["baseline", "s1", "s2", "auto"])
    moe_s1_local_capacity: bool = opt(False, "S1 with Parm's original per-slice capacity (NOT equivalent)")
    moe_saa: bool = opt(True, "S2: overlap return all-to-all with MP all-gather (SAA); "
                        "--no-moe-saa runs them one after the other (AAS)")
    comm_profile: Optional[str] = opt(None, "cache file of the fitted alpha-beta collective costs")

    def __post_init__(self) -> None:
        if self.num_experts < 0:
            raise ValueError("--num-experts must be >= 0")
        if self.moe_router_topk not in (1, 2):
            raise ValueError(f"--moe-router-topk must be 1 or 2, got {self.moe_router_topk}")
        if self.num_experts and self.moe_router_topk > self.num_experts:
            raise ValueError(f"--moe-router-topk {self.moe_router_topk} exceeds --num-experts {self.num_experts}")
        if self.moe_expert_capacity_factor <= 0:
            raise ValueError("--moe-expert-capacity-factor must be positive")
        if self.moe_layer_freq < 1:
            raise ValueError("--moe-layer-freq must be >= 1")


@dataclass
class ParallelConfig:
    """Parallel degrees; data parallel is what is left of the world size."""

    tensor_model_parallel_size: int = opt(1, "MP degree (Megatron tensor parallel)")
    expert_model_parallel_size: int = opt(1, "EP degree")
    expert_sharding_parallel_size: int = opt(1, "ESP degree: expert hidden dim sharded over this many ranks")
    distributed_backend: Optional[str] = opt(None, "gloo or nccl (default: nccl with CUDA, else gloo)",
                                             choices=["gloo", "nccl"])
    comm_timeout: float = opt(600.0, "seconds before a stuck collective becomes an error")


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    optimizer: str = opt("adamw", "optimizer", choices=["adamw", "sgd"])
    lr: float = opt(1e-3, "peak learning rate")
    min_lr: float = opt(1e-4, "final learning rate of the decay")
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


@dataclass
class DataConfig:
    """Where the tokens come from."""

    data_path: Optional[str] = opt(None, "PREFIX of PREFIX_{train,valid,test}_text_document.{bin,idx} "
                                   "(default: preprocess the bundled sample corpus)")
    tokenizer_name_or_path: Optional[str] = opt(None, "tokenizer directory/hub name (default: beside the data)")
    num_workers: int = opt(0, "dataloader workers")


@dataclass
class TrainConfig:
    """Loop lengths, batch sizes, checkpoints."""

    micro_batch_size: int = opt(4, "samples per micro-batch per data-parallel rank")
    global_batch_size: Optional[int] = opt(None, "samples per iteration (default micro x DP)")
    train_iters: int = opt(300, "iterations")
    eval_interval: int = opt(100, "evaluate on valid every this many iterations (0: never)")
    eval_iters: int = opt(10, "valid/test global batches per evaluation (each --global-batch-size samples)")
    seed: int = opt(1234, "random seed")
    save: Optional[str] = opt(None, "checkpoint directory to write")
    load: Optional[str] = opt(None, "checkpoint directory to resume from")
    save_interval: int = opt(0, "save every this many iterations (0: only at the end if --save)")
    exit_interval: int = opt(0, "stop after this many iterations of this run (0: never; for tests)")


@dataclass
class LoggingConfig:
    """Console, JSON lines and wandb."""

    log_interval: int = opt(10, "iterations between log lines")
    log_json: Optional[str] = opt(None, "append metrics as JSON lines to this file")
    wandb_project: Optional[str] = opt(None, "wandb project (enables wandb)")
    wandb_exp_name: Optional[str] = opt(None, "wandb run name")
    wandb_mode: str = opt("offline", "wandb mode", choices=["offline", "online", "disabled"])
    wandb_save_dir: Optional[str] = opt(None, "wandb directory (default ./wandb)")


@dataclass
class OptimizationsConfig:
    """Switches of the communication optimizations (each exactly equivalent to the plain run)."""

    lina: bool = opt(False, "Lina: gradient all-reduce in micro-ops that yield to all-to-all")
    lina_partition_mb: float = opt(30.0, "Lina micro-op size in MB")
    lancet_wgrad: bool = opt(False, "Lancet: defer weight-gradient GEMMs under all-to-alls")
    lancet_partition: bool = opt(False, "Lancet: batch-partitioned pipelining around MoE layers")
    lancet_max_partitions: int = opt(8, "Lancet rho: max partitions")
    lancet_group_ms: float = opt(1.0, "Lancet gamma: op group size in ms")
    lancet_max_range: int = opt(8, "Lancet iota: max range in op groups")
    lancet_report: Optional[str] = opt(None, "write Lancet's plan and timings to this JSON file")


@dataclass
class Config:
    """Everything a run needs; built by `arguments.parse_args`."""

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
