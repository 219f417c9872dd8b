"""Pure analyses: events or DataFrames in, DataFrames and dataclasses out. No UI imports."""
