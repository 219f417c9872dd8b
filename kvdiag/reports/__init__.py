"""HTML (plotly) and markdown reports built from analyses."""
