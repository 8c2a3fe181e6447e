"""Checkpoint conversion (tools/convert_checkpoint.py, tools/generate.py use it).

sharded  FullCheckpoint, read_sharded / write_sharded (reshard), the --verify logit comparison
formats  Hugging Face GPT-2 import/export, one consolidated safetensors file
"""

from megatron_moe.convert.formats import (
    export_file,
    export_hf,
    hf_logit_diff,
    import_hf,
    load_hf_model,
    read_any,
    read_file,
)
from megatron_moe.convert.sharded import (
    FullCheckpoint,
    batch_warning,
    build_model,
    checkpoint_dir,
    fixed_batch,
    max_logit_diff,
    model_logits,
    optimizer_mismatches,
    read_sharded,
    structure_specs,
    target_config,
    write_sharded,
)

__all__ = [
    "FullCheckpoint",
    "batch_warning",
    "build_model",
    "checkpoint_dir",
    "export_file",
    "export_hf",
    "fixed_batch",
    "hf_logit_diff",
    "import_hf",
    "load_hf_model",
    "max_logit_diff",
    "model_logits",
    "optimizer_mismatches",
    "read_any",
    "read_file",
    "read_sharded",
    "structure_specs",
    "target_config",
    "write_sharded",
]
