"""Pro-Prophet (Wang et al.): the planner half, pure functions without process groups
(except `perf_model.measure_constants`, which times the real groups).

  perf_model  the performance model of one MoE layer under a lightweight expert placement
              (eqs. (1)-(8)): `PerfConstants`, `PerfModel`, `loads`, `fit_constants`,
              `measure_constants`
  planner     Algorithm 1 (`plan`), the "k heaviest experts to every device" comparison
              (`heaviest_to_all`), Algorithm 2's block-wise Trans/Agg schedule (`block_schedule`)
  calibration the model fitted to measured layer times (scale, Trans/Agg cost, overlap efficiency;
              a departure from the paper): `fit_calibration`, `Calibrator`
  clock       the MoE layers' measured forward + backward time per iteration (`LayerClock`)

The runtime (replicas in the dispatcher, Trans/Agg) lives in `megatron_moe.moe.placement`.
"""
