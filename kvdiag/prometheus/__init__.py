"""Prometheus: the metrics table, the exporter (a sink folding events into the live state), the
doctor's rules as alerting rules and the Grafana dashboard.

May import :mod:`kvdiag.live` and the layers below it.
"""
