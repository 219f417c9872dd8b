"""Measures and verdicts over what was recorded: functions of events (the frames of one or more
logs, or a Parquet dataset through DuckDB) returning DataFrames with units in their column
names, findings or summaries; every check's thresholds in ``rules`` and their evaluation in
``doctor.run_rules``.

May import :mod:`kvdiag.simulation` and the layers below it; never a collector, the live path or
a UI library.
"""
