"""Megatron-style command-line flags generated from the config dataclasses.

Each config dataclass is one argparse group; every field a flag (`num_layers` -> `--num-layers`),
booleans `--flag` / `--no-flag`. Checks that need the world size live in `validate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Optional, Sequence

from megatron_moe.config import Config
from megatron_moe.parallel_state import validate_degrees

GROUPS = {
    "model": "model",
    "moe": "MoE",
    "parallel": "parallelism",
    "optim": "optimizer",
    "data": "data",
    "train": "training",
    "logging": "logging",
    "opts": "communication optimizations",
}


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _base_type(tp):
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {})  # annotations are strings under `from __future__ import annotations`
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` to a flag's help, except where the help already states its default
    (`--ffn-hidden-size`: "default 4 * hidden size") or there is none to show (default None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "(default" in text:
            return text
        return super()._get_help_string(action) or text


GIVEN = "flags_given"  # namespace attribute: {dest: the option string that set it}


class _Once(argparse.Action):
    """A flag given a second time (`--lr 1e-3 --lr 2e-3`, `--bf16 --no-bf16`) is an error naming
    it: argparse would silently keep the last value."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault(GIVEN, {})
        if self.dest in given:
            first = given[self.dest]
            also = f" (as {first} and {option_string})" if first != option_string else ""
            parser.error(f"{option_string} given twice{also}")
        given[self.dest] = option_string
        super().__call__(parser, namespace, values, option_string)


class _StoreOnce(_Once, argparse._StoreAction):
    pass


class _BoolOnce(_Once, argparse.BooleanOptionalAction):
    pass


def add_config_flags(
    parser: argparse.ArgumentParser,
    sections: Sequence[str] = tuple(GROUPS),
    defaults: Optional[Config] = None,
) -> None:
    """Add the trainer's flags of the config `sections` to `parser` (one group each), with the
    values of `defaults` (a Config; the dataclass defaults when None). Tools use it so their
    flags are the trainer's; `config_from_args` turns the parsed namespace back into a Config.
    Each flag may be given once; the namespace's `GIVEN` names those given."""
    defaults = defaults or Config()
    for section in sections:
        group = parser.add_argument_group(GROUPS[section])
        sub = getattr(defaults, section)
        for f in dataclasses.fields(sub):
            if not f.metadata.get("cli", True):
                continue  # set from Python only (tests, benchmarks, ablations)
            flag, tp = _flag(f), _base_type(f.type)
            dest = f"{section}.{f.name}"
            derived = f.name in ("ffn_hidden_size", "max_position_embeddings")  # from the others when None
            default = None if derived else getattr(sub, f.name)
            if tp is bool:
                group.add_argument(
                    flag,
                    dest=dest,
                    action=_BoolOnce,
                    default=default,
                    help=f.metadata.get("help", ""),
                )
            else:
                group.add_argument(
                    flag,
                    dest=dest,
                    action=_StoreOnce,
                    type=tp,
                    default=default,
                    choices=f.metadata.get("choices"),
                    metavar=None if f.metadata.get("choices") else tp.__name__.upper(),
                    nargs=f.metadata.get("nargs"),
                    help=f.metadata.get("help", ""),
                )


def build_parser() -> argparse.ArgumentParser:
    """One argument group per config dataclass."""
    parser = argparse.ArgumentParser(
        description="Pretrain a GPT-2 Mixture-of-Experts model.", formatter_class=HelpFormatter
    )
    add_config_flags(parser)
    return parser


def config_from_args(ns: argparse.Namespace) -> Config:
    """The Config of a namespace parsed with `add_config_flags` flags (a tool's own options are ignored)."""
    return config_from_namespace({k: v for k, v in vars(ns).items() if "." in k})


def parse_args(argv: Optional[Sequence[str]] = None) -> Config:
    """Parse flags into a Config (dataclass validation runs here).

    The returned config carries `explicit_flags`, the set of "section.field" names given on
    the command line (what --use-checkpoint-args must not override).
    """
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    explicit = frozenset(ns.pop(GIVEN, {}))
    load = ns["train.load"] if ns["train.use_checkpoint_args"] else None
    if load:  # merged before validation: errors quote the checkpoint's values, never the defaults
        from megatron_moe.checkpointing import checkpoint_args, read_metadata, resolve

        path = resolve(load)
        ns.update(checkpoint_args(read_metadata(path)["config"], explicit))
    try:
        cfg = config_from_namespace(ns)
    except ValueError as e:
        if not load:
            raise
        raise ValueError(f"{e} (--use-checkpoint-args: the model and MoE flags not given are {path}'s)") from None
    cfg.explicit_flags = explicit
    return cfg


def config_from_namespace(ns: dict) -> Config:
    kwargs: dict = {}
    for dest, value in ns.items():
        section, name = dest.split(".", 1)
        kwargs.setdefault(section, {})[name] = value
    cls = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    return Config(**{section: cls[section](**vals) for section, vals in kwargs.items()})


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> Config:
    """A checkpoint's config; sections and fields this version does not have (a flag removed since the
    checkpoint was written) are skipped, as `checkpointing.validate_metadata` leaves them alone."""
    cls = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    built = {}
    for section, vals in d.items():
        if section in cls:
            known = {f.name for f in dataclasses.fields(cls[section])}
            built[section] = cls[section](**{k: v for k, v in vals.items() if k in known})
    return Config(**built)


def validate(cfg: Config, world_size: int) -> None:
    """Checks that need the world size: degrees, experts, batch sizes. Errors name the flag."""
    p, m, moe, t = cfg.parallel, cfg.model, cfg.moe, cfg.train
    validate_degrees(
        world_size,
        p.tensor_model_parallel_size,
        p.expert_model_parallel_size,
        p.expert_sharding_parallel_size,
        num_experts=moe.num_experts if moe.num_experts else None,
        ffn_hidden_size=m.ffn_hidden_size if moe.num_experts else None,
    )
    esp = p.expert_sharding_parallel_size
    if moe.num_experts and m.hidden_size % esp:
        raise ValueError(f"--hidden-size {m.hidden_size} must be divisible by --expert-sharding-parallel-size {esp}")
    mp = p.tensor_model_parallel_size
    if m.num_attention_heads % mp:
        raise ValueError(
            f"--num-attention-heads {m.num_attention_heads} must be divisible by --tensor-model-parallel-size {mp}"
        )
    if m.ffn_hidden_size % mp:
        raise ValueError(
            f"--ffn-hidden-size {m.ffn_hidden_size} must be divisible by --tensor-model-parallel-size {mp}"
        )
    dp = world_size // mp
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ValueError(
            f"--global-batch-size {t.global_batch_size} must be a multiple of --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp}"
        )
    if t.train_iters < 1:
        raise ValueError("--train-iters must be positive")
    if cfg.optim.lr_decay_iters is None:
        cfg.optim.lr_decay_iters = t.train_iters
    validate_pro_prophet(cfg)
    validate_lina_packing(cfg)


def validate_lina_packing(cfg: Config) -> None:
    """--lina-max-experts-per-rank, when given, must allow at least the experts EP already puts on a rank."""
    o, ep, E = cfg.opts, cfg.parallel.expert_model_parallel_size, cfg.moe.num_experts
    if o.lina_packing and o.lina_max_experts_per_rank and E and o.lina_max_experts_per_rank < E // ep:
        raise ValueError(
            f"--lina-max-experts-per-rank {o.lina_max_experts_per_rank} is below the {E // ep} experts per rank "
            f"of --num-experts {E} / --expert-model-parallel-size {ep}"
        )


def validate_pro_prophet(cfg: Config) -> None:
    """--pro-prophet needs dropless MoE and an EP group of 2+."""
    o, moe, ep = cfg.opts, cfg.moe, cfg.parallel.expert_model_parallel_size
    if not o.pro_prophet:
        return
    if not moe.moe_dropless:
        raise ValueError(
            "--pro-prophet needs --moe-dropless (with capacity padding every expert computes "
            "C slots and there is no load to balance)"
        )
    if not moe.num_experts or ep < 2:
        raise ValueError(
            f"--pro-prophet needs --expert-model-parallel-size >= 2 and --num-experts > 0, got "
            f"{ep} and {moe.num_experts}"
        )
    if o.pro_prophet_n > ep - 2:
        raise ValueError(
            f"--pro-prophet-n must be in [0, {ep - 2}] for --expert-model-parallel-size {ep}, got {o.pro_prophet_n}"
        )
