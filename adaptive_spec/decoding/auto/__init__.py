"""`auto`: what pays on this machine (its modules: docs/design.md's map). Outside this package, import from here."""
from .acceptance import BUDGET_S, FIELD, MAX_PROMPTS, load_texts, measure_prompts, record
from .cost_timing import (PREFIX, decode_step_time, interleaved_round, interleaved_times, loop_times, monotone,
                          prefilled, release)
from .costs import Costs, config_key, cost_config, costs_dir, costs_from_json, measure_costs, measured_cells
from .counts import (MIX, WORKLOADS, Answers, check_workload, combined_counts, copy_counts, describe_workload,
                     parse_workload, sum_counts)
from .curve_replay import H_GRID, K_GRID, curve_of, replay, stop_lengths, window_products
from .picker import AR, DEFAULT_TIME_MODEL, describe_pick, pick, predicted_wall, resolve_auto
from .prediction import by_name, copy_round, picks_of, predict, timed
from .timemodel import (ONE_STEP, coef_of, compare_decompositions, comparison_table, decode_s, decompose,
                        fit_forward_times, fit_standalone, mean_std, predict_time, relative_error, round_costs,
                        theoretical_tokens_per_s)
