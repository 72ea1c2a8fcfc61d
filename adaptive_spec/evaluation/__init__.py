"""Evaluation: threshold and K sweeps, tree calibration, and the report (tables, Pareto plots)."""
