"""megatron-moe: Megatron-style GPT-2 Mixture-of-Experts training with MP, EP, ESP and DP."""
