"""The terminal UI of ``kvdiag top`` (textual): the app, its panels and their rendering of live
snapshots.

May import everything below :mod:`kvdiag.agent`; one of the two places a UI library (textual)
may be imported.
"""
