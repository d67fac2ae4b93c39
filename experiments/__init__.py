"""The lab notebook: the sweep runner (sweep.py), the analysis (analysis.py, regime.py, plots.py) and the records."""
