"""Lancet (Jiang et al., MLSys 2024): whole-graph computation-communication overlap for MoE training.

Planning (pure functions, no process group):
  ir              instruction IR of a pass; `overlappable_dw` (dW with no path to or from an all-to-all)
  wgrad_schedule  Algorithm 1: best-fit assignment of deferred dW GEMMs to all-to-alls; the backward IR
                  of a GPT-2 + MoE model
  cost            piecewise-linear comm cost model (C/n rule for split all-to-alls), caching op profiler
  simulator       two-stream timeline of a range split into k batch parts
  partition_dp    the DP choosing ranges (iota groups of ~gamma ms) and k <= rho
  axes            partition-axis inference with OR-Tools CP-SAT
Runtime (process groups; through the model's own stages and hooks):
  wgrad_runtime   the dW queue the linears, experts and dispatchers take (`set_dw_queue`)
  partitioned_moe `PartitionedRange`: a range around an MoE layer run as k pipelined batch parts
  model_ir        profiled costs, the model's forward op list and its CP-SAT IR
  planner         `make_plan` (DP + CP-SAT + Algorithm 1 + predictions -> LancetPlan),
                  `candidate_plans`, `fit_contention`
  controller      `setup(model, ps, opts) -> LancetController` (what `optimizations.apply` calls);
                  `choose_plan` keeps the fastest measured candidate
"""
