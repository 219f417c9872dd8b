"""Command lines for the Python child processes kvdiag starts (the demo server, top's demo).

``python -m kvdiag...`` puts the current folder first on ``sys.path``; started from a
checkout of kvdiag, the checkout's ``kvdiag/`` would shadow the installed package (and lack
its mapped subpackages). The children run with ``-P`` (Python 3.11+: no unsafe path entry), so
they import the kvdiag installed in this interpreter's environment whatever the current folder.
"""

from __future__ import annotations

import signal
import sys

_BOOTSTRAP_310 = ("import runpy, sys; sys.path.pop(0); "
                  "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


def kvdiag_module(module: str) -> list[str]:
    """``[python, ..., -m module]`` that runs the installed ``module`` of this environment."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    return [sys.executable, "-c", _BOOTSTRAP_310.format(module=module)]


def reset_interrupt_signal() -> None:
    """In a child before exec: take SIGINT's default action back. A parent started from a
    non-interactive shell (``cmd &``, CI, nohup) ignores SIGINT, children inherit that, and
    Python keeps an inherited ignore: the graceful stop kvdiag sends would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
