"""Flags of the tiny end-to-end runs shared by the training, conversion and generation tests."""


def tiny_args(data, iters, *extra):
    """A 2-layer MoE (4 experts, top-2, capacity 0.75 so tokens drop) on the sample corpus; a flag
    of `extra` replaces the one below (the trainer refuses a flag given twice)."""
    base = [
        "--data-path",
        data,
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-expert-capacity-factor",
        "0.75",
        "--moe-min-capacity",
        "1",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        str(iters),
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "3",
        "--eval-interval",
        str(iters),  # valid and test once, at the end
        "--eval-iters",
        "1",
        "--log-interval",
        "100",
        "--seed",
        "11",
        "--moe-schedule",
        "baseline",
    ]
    pairs = [base[i : i + 2] for i in range(0, len(base), 2)]  # every flag here takes one value
    return [word for pair in pairs if pair[0] not in extra for word in pair] + list(extra)
