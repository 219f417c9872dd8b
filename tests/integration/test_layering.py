"""Imports point one way: nothing headless (core, analyses, kernels, collectors, the live
path) imports a UI library (textual, plotly)."""

import subprocess
import sys

HEADLESS = [
    "kvdiag", "kvdiag.events.schema", "kvdiag.events.sinks", "kvdiag.events.eventlog", "kvdiag.analysis",
    "kvdiag.kernels", "kvdiag.collectors",
]


def _headless_modules():
    """Every module of the headless packages (analysis, kernels, collectors, core)."""
    import pkgutil

    import kvdiag
    import kvdiag.analysis
    import kvdiag.collectors
    import kvdiag.kernels
    import kvdiag.live

    names = list(HEADLESS)
    for package in (kvdiag.analysis, kvdiag.kernels, kvdiag.collectors, kvdiag.live):
        names += [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    ui_or_cli = {"kvdiag.cli", "kvdiag.commands", "kvdiag.tui", "kvdiag.reports", "kvdiag.__main__"}
    names += [f"kvdiag.{m.name}" for m in pkgutil.iter_modules(kvdiag.__path__)
              if f"kvdiag.{m.name}" not in ui_or_cli and not m.ispkg]
    return sorted(set(names))


def test_headless_modules_do_not_import_ui_libraries():
    modules = _headless_modules()
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in ('textual', 'plotly') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"UI libraries imported by headless modules: {out.stdout}"
