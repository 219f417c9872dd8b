"""Trace I/O: request traces in every supported format read into one ``Trace`` (chained block
keys), their lines checked, and workloads for capacity planning.

May import :mod:`kvdiag.shadow` and the layers below it (kernels, pool, demo, events, paths).
"""
