"""Experiments: sweeps of variants x seeds (sweep.py), their plots (plots.py), and the results they wrote."""
