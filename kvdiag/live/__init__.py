"""The live path of ``kvdiag top``: event sources (a log, a socket, top's demo), the incremental
state folded from them, immutable snapshots and the live evaluation of the doctor's rules.

May import :mod:`kvdiag.collectors`, :mod:`kvdiag.diagnosis` and the layers below; never a UI
library.
"""
