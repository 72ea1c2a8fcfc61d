"""`auto`: what pays on this machine. Its forward costs measured and cached (costs.py; how each is timed:
cost_timing.py), the time model that prices a policy's counts with them (timemodel.py), the threshold curve's
replay (curve_replay.py; the curve's file format is heads/curve.py), the pick of `--threshold auto` / `--k auto`
(picker.py), and prediction: every configuration priced, its reason rendered apart (prediction.py, pricing.py,
counts.py; the acceptance on a user's own prompts: acceptance.py). Outside this package, import from here."""
from .acceptance import BUDGET_S, FIELD, MAX_PROMPTS, load_texts, measure_prompts, record
from .cost_timing import (PREFIX, decode_step_time, interleaved_round, interleaved_times, loop_times, monotone,
                          prefilled, release)
from .costs import Costs, config_key, cost_config, costs_dir, costs_from_json, measure_costs, measured_cells
from .counts import (MIX, WORKLOADS, Answers, check_workload, combined_counts, copy_counts, describe_workload,
                     parse_workload, sum_counts)
from .curve_replay import H_GRID, K_GRID, curve_of, replay, stop_lengths, window_products
from .picker import AR, DEFAULT_TIME_MODEL, describe_pick, pick, predicted_wall, resolve_auto
from .prediction import by_name, picks_of, predict
from .pricing import copy_round, timed
from .timemodel import (ONE_STEP, coef_of, compare_decompositions, comparison_table, decode_s, decompose,
                        fit_forward_times, fit_standalone, mean_std, predict_time, relative_error, round_costs,
                        theoretical_tokens_per_s)
