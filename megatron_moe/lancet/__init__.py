"""Lancet (Jiang et al., MLSys 2024): whole-graph computation-communication overlap for MoE training.

Planning (pure functions, no process group):
  ir              instruction IR of a pass, dependency edges, reachability,
                  `overlappable_dw` (dW with no path to or from an all-to-all)
  wgrad_schedule  Algorithm 1: best-fit greedy assignment of deferred dW GEMMs
                  to all-to-alls; IR builder for a GPT-2 + MoE backward pass
  cost            piecewise-linear comm cost model (C/n rule for split
                  all-to-alls) and a caching op profiler
  simulator       two-stream timeline of a range split into k batch parts
  partition_dp    the DP choosing ranges (iota groups of ~gamma ms) and k <= rho
  axes            partition-axis inference with OR-Tools CP-SAT

The runtime (deferred dW execution, partitioned MoE forward) consumes:
`WgradSchedule.assignment` {a2a name: [dW names in launch order]} and
`.leftover`; `PartitionPlan.ranges` (op index ranges with k); and the axis
per tensor from `axes.solve_axes`.

Runtime (uses process groups; works through the model's own stages and hooks):
  wgrad_runtime   the dW queue the linear / expert modules and the dispatchers take
                  (`set_dw_queue`): deferred GEMMs, windows under all-to-alls
  partitioned_moe `PartitionedRange`: the k-part pipelined block from the block's
                  halves, the layer's router and a dispatcher's async handles
  model_ir        profiled costs, the model's forward op list and CP-SAT IR
  planner         `make_plan`: DP + CP-SAT + Algorithm 1 + predictions -> LancetPlan;
                  `candidate_plans`, `fit_contention` (never slower)
  controller      `setup(model, ps, opts) -> LancetController` (what `optimizations.apply` calls);
                  `choose_plan` measures the candidates on the real model and keeps the fastest
"""
