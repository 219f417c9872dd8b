"""Data shipped with kvdiag: the demo traffic templates (traffic.json)."""
