"""Inference: batched KV-cache generation under any trainer layout, Lina's expert-popularity
profile and two-phase scheduling (paper section 5).

  kv_cache    the attention cache (`Attention.forward(x, cache)`), left-padded rows
  engine      InferenceEngine: prefill + decode, dropless MoE, DP ranks serve their own requests
  popularity  expert-path profile (JSON), estimation (eq. 1), replicate / first-fit-decreasing packing,
              phase 2 priced by compute and link traffic (traffic_aware_replan)
  scheduled   the MoE layer under a placement (replicas of popular experts, packed unpopular ones)
  fallback    --lina-inference: the scheduled layer checked against unscheduled inference, kept only if faster
"""
