"""The live path of ``kvdiag top``: event sources (a log replayed, an agent's socket, a process
seen from outside, the embedded demo), the incremental state folded from their events, the
immutable snapshots the TUI renders, and the rules run over the events seen so far.

Pure data: no UI library is imported here (a test checks it in a subprocess).
"""
