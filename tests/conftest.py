"""Test-session settings and the markers of every test, assigned here in one place.

The package is imported from the checkout (pyproject.toml `[tool.pytest.ini_options] pythonpath`),
support modules in tests/ (tiny_run, equivalence, ...) through pytest's import of the test files.

Markers (registered in pyproject.toml): `multiprocess` starts gloo process groups
(`megatron_moe.testing.spawn`) or a cluster of processes; `slow` takes more than about 20 s on
2 idle CPU cores; `needs_root` needs root for network namespaces (it skips otherwise). The fast
subset is `pytest -m "not slow and not multiprocess"`. tests/test_tooling.py checks that every
test which spawns processes is marked `multiprocess` and that every name below exists.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton's kernels on CPU tensors (tests/test_kernels.py): the interpreter must be chosen before
# triton is first imported (triton.language's own jit functions are made then), so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# subprocesses (tools/*.py, torchrun) import this checkout's package whether or not it is installed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])

ALL = "*"  # every test of the file

EMULATED_CLUSTER = {
    "test_non_root_is_refused_with_exit_2",
    "test_two_node_allreduce_and_link_rate",
    "test_both_directions_of_each_link_are_shaped_and_env_is_set",
    "test_failing_node_fails_the_run_and_stops_the_others",
    "test_timeout_stops_the_run_with_124",
    "test_sigint_kills_the_nodes_and_removes_the_namespaces",
    "test_delay_is_applied_or_warned_about",
}

# marker -> test file -> ALL or the names of its test functions (parametrized ids left out)
MARKS: dict[str, dict[str, object]] = {
    "multiprocess": {
        "test_bf16.py": {"test_bf16_golden_curve_matches_bf16_one_process"},
        "test_choose.py": {"test_ranks_agree_on_the_max_of_each_pass_and_on_the_pick"},
        "test_clean_exit.py": ALL,
        "test_steady_memory.py": ALL,
        "test_clipping.py": {
            "test_global_norm_counts_every_element_once_and_clipping_scales_to_the_clip",
            "test_clipped_golden_curve_matches_one_process",
        },
        "test_comm_bytes.py": ALL,
        "test_plan_parts.py": ALL,
        "test_planner_profile.py": {"test_two_ranks_on_two_nodes_fit_an_inter_node_link"},
        "test_planner.py": {
            "test_predicted_volumes_equal_the_observed_bytes_of_one_training_step",
            "test_predicted_mp_all_reduce_equals_the_observed_bytes",
        },
        "test_device_hygiene.py": {
            "test_trainer_under_meta_default_device_matches_the_plain_run",
            "test_bench_tool_under_meta_default_device",
        },
        "test_dropless.py": {
            "test_every_layout_matches_one_process_dropless_reference",
            "test_trainer_dropless_ep2_with_lina_matches_one_process",
        },
        "test_composition.py": {"test_every_combination_keeps_the_curve_or_is_refused_naming_both_flags"},
        "test_pro_prophet_locality.py": ALL,
        "test_bench_pro_prophet_counts.py": {
            "test_benchmark_runs_with_trained_counts",
            "test_expert_count_mismatch_exits_2",
        },
        "test_pro_prophet_trial.py": {"test_the_pick_is_applied_to_every_later_iteration_and_the_untimed_rules_hold"},
        "test_pro_prophet_placement.py": {
            "test_forced_plan_equals_no_placement",
            "test_trainer_curve_with_pro_prophet_equals_without_and_resumes_without_it",
            "test_replica_buffers_are_freed_every_iteration",
        },
        "test_comm_timeout.py": {
            "test_ep2_stalled_peer_ends_the_other_rank_with_the_timeout_error",
            "test_dp2_trainer_stalled_peer_prints_one_error_and_exits_1",
        },
        "test_kept_tokens.py": {"test_s1_expert_gemms_see_exactly_the_kept_rows_of_every_source"},
        "test_topk.py": {"test_every_layout_matches_one_process_reference_at_top4_of_8"},
        "test_lina_gate.py": ALL,
        "test_lina_lancet.py": ALL,
        "test_lina_packing.py": {
            "test_a_kept_pack_keeps_the_curve_and_its_checkpoint_resumes_in_the_original_layout",
            "test_relayout_moves_expert_slices_and_adam_state_under_esp",
            "test_the_packing_decision_is_applied_unpacked_goes_back_to_ep4_on_the_same_curve",
        },
        "test_lina_pipeline.py": {
            "test_pipelined_layer_equals_unsplit_outputs_gradients_and_drops",
            "test_pipelined_all_to_all_moves_the_same_bytes",
        },
        "test_inference.py": {"test_greedy_under_mp2_ep2_and_mp2xep2_equals_one_process_and_lina_keeps_the_logits"},
        "test_inference_fallback.py": {
            "test_forced_outcome_every_rank_takes_the_same_path_and_fallback_keeps_the_outputs"
        },
        "test_mutation_targets.py": {
            "test_two_process_layout_matches_one_process",
            "test_global_grad_norm_counts_every_element_once",
            "test_saa_sends_the_next_chunk_before_gathering_the_previous_one",
            "test_lina_launches_nothing_once_an_all_to_all_is_imminent",
            "test_lina_micro_ops_follow_reverse_parameter_order",
        },
        "test_optim_schedule.py": {
            "test_eval_loss_and_perplexity_under_dp_equal_one_process",
            "test_default_auto_schedule_through_the_trainer_equals_the_baseline_curve",
            "test_lancet_with_esp2_equals_the_plain_run",
            "test_dropout_under_mp2_equals_one_process_and_masks_agree_across_mp_ranks",
        },
        "test_parm_cost_fit.py": {"test_profile_saa_fits_the_same_numbers_on_every_rank"},
        "test_profiling.py": {"test_two_ranks_each_write_their_trace_with_all_to_all"},
        "test_random_routing.py": {"test_data_parallel_ranks_with_the_same_tokens_draw_different_experts"},
        "test_resume_layouts.py": ALL,
        "test_saa_overlap.py": ALL,
        "test_slurm_resume.py": {"test_all_ranks_stop_together_when_one_rank_gets_the_signal"},
        "test_convert_checkpoint.py": {
            "test_resharded_checkpoints_load_on_their_layouts_and_resume_with_the_same_loss"
        },
        "test_data_sampler.py": {"test_mp_ranks_of_a_dp_group_get_identical_samples"},
        "test_data_wikitext.py": {"test_two_ranks_share_rank_zeros_preprocessing_and_its_error"},
        "test_reliability_data.py": {
            "test_ranks_wait_for_rank0s_preprocessing_past_the_comm_timeout",
            "test_a_rank_that_waits_past_its_bound_says_what_it_waited_for",
        },
        "test_emulated_cluster.py": EMULATED_CLUSTER - {"test_non_root_is_refused_with_exit_2"},
        "test_lancet_runtime.py": ALL,
        "test_layout_equivalence.py": ALL,
        "test_lina.py": ALL,
        "test_parallel_state.py": {"test_process_groups_reduce_over_the_layout_groups"},
        "test_parm_auto_measure.py": {
            "test_measured_s2_beats_the_models_baseline_on_every_rank",
            "test_measuring_keeps_the_curve_and_a_resumed_run_reproduces_it_bitwise",
        },
        "test_parm_schedules.py": ALL,
        "test_saa_events.py": ALL,
        "test_streams.py": {"test_collective_waited_on_a_lane_finishes_before_its_consumer_launches"},
        "test_streams_users.py": {
            "test_lina_micro_ops_run_on_one_side_stream_per_communicator_after_their_gradients",
            "test_partitioned_parts_run_experts_and_return_launches_on_the_side_stream",
        },
        "test_training.py": {
            "test_golden_curve_matches_one_process",
            "test_resume_reproduces_the_uninterrupted_curve_exactly",
            "test_loading_under_another_layout_names_the_conversion_tool",
            "test_every_optimization_switch_keeps_the_training_curve",
        },
    },
    "slow": {
        "test_inference.py": {"test_greedy_under_mp2_ep2_and_mp2xep2_equals_one_process_and_lina_keeps_the_logits"},
        "test_device_hygiene.py": {
            "test_trainer_under_meta_default_device_matches_the_plain_run",
            "test_bench_tool_under_meta_default_device",
        },
        "test_dropless.py": {"test_every_layout_matches_one_process_dropless_reference"},
        "test_compile.py": {"test_compiled_blocks_follow_the_eager_bf16_curve"},
        "test_examples.py": {"test_dense_example_trains_exports_and_generates_with_transformers"},
        "test_bf16.py": {"test_bf16_golden_curve_matches_bf16_one_process"},
        "test_clean_exit.py": ALL,
        "test_clipping.py": {"test_clipped_golden_curve_matches_one_process"},
        "test_composition.py": {"test_every_combination_keeps_the_curve_or_is_refused_naming_both_flags"},
        "test_pro_prophet_placement.py": {
            "test_forced_plan_equals_no_placement",
            "test_trainer_curve_with_pro_prophet_equals_without_and_resumes_without_it",
        },
        "test_comm_timeout.py": {
            "test_ep2_stalled_peer_ends_the_other_rank_with_the_timeout_error",
            "test_dp2_trainer_stalled_peer_prints_one_error_and_exits_1",
        },
        "test_optim_schedule.py": {
            "test_default_auto_schedule_through_the_trainer_equals_the_baseline_curve",
            "test_lancet_with_esp2_equals_the_plain_run",
        },
        "test_quality.py": {
            "test_reference_curve_matches_transformers_within_1e4_per_step",
            "test_moe_vs_dense_end_to_end_on_a_tiny_budget",
        },
        "test_resume_layouts.py": ALL,
        "test_mutation_targets.py": {"test_two_process_layout_matches_one_process"},
        "test_parm_cost_fit.py": {"test_profile_saa_fits_the_same_numbers_on_every_rank"},
        "test_layout_equivalence.py": ALL,
        "test_lina.py": ALL,  # its module fixture trains 4 ranks twice
        "test_parm_schedules.py": ALL,
        "test_packaging.py": {"test_wheel_installs_and_every_console_script_runs_from_another_directory"},
        "test_training.py": {
            "test_golden_curve_matches_one_process",
            "test_main_job_smoke_with_wandb_offline_and_json_log",
            "test_every_optimization_switch_keeps_the_training_curve",
        },
    },
    "needs_root": {
        "test_emulated_cluster.py": EMULATED_CLUSTER,
    },
}


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory) -> str:
    """The bundled sample corpus preprocessed (512-id tokenizer) into a fresh directory per test
    module: PREFIX of PREFIX_{train,valid,test}_text_document and PREFIX_tokenizer."""
    from megatron_moe.data.preprocess import prepare_sample_data

    prefix = str(tmp_path_factory.mktemp("data") / "sample")
    prepare_sample_data(prefix, vocab_size=512)
    return prefix


def marked(marker: str, filename: str, test_name: str) -> bool:
    """Whether MARKS gives `marker` to test function `test_name` of `filename`."""
    names = MARKS[marker].get(filename)
    return names == ALL or (isinstance(names, set) and test_name in names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Attach the markers of MARKS to the collected tests."""
    for item in items:
        name = getattr(item, "originalname", item.name)
        for marker in MARKS:
            if marked(marker, item.path.name, name):
                item.add_marker(getattr(pytest.mark, marker))
