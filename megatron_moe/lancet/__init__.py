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

Runtime (uses process groups):
  wgrad_runtime   deferrable linear / batched-linear GEMMs, the dW queue,
                  windows under all-to-alls, grad-ready hooks fired once
  irregular_a2a   count exchange + uneven token all-to-all, async in both passes
  partitioned_moe capacity-passing gating and the k-part pipelined block forward
  model_ir        profiled costs, the model's forward op list and CP-SAT IR
  planner         `make_plan`: DP + CP-SAT + Algorithm 1 + predictions -> LancetPlan
  controller      `setup(model, ps, opts) -> LancetController` (the trainer's API)
"""


def setup(model, ps, opts, **kwargs):
    """Plan and install Lancet on `model` (see `megatron_moe.lancet.controller.setup`)."""
    from megatron_moe.lancet.controller import setup as _setup
    return _setup(model, ps, opts, **kwargs)
