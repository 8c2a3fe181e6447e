"""Command-line programs: `main(argv)` of each console script (see pyproject.toml).

pretrain -> mmoe-pretrain, preprocess -> mmoe-preprocess, convert -> mmoe-convert,
generate -> mmoe-generate. Each also runs as `python -m megatron_moe.cli.NAME`.
"""
