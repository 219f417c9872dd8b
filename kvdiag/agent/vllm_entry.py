"""The ``vllm.general_plugins`` entry point (pyproject.toml): kvdiag's agent inside vLLM.

vLLM calls :func:`register` in every process it starts. With ``KVDIAG_AGENT=1`` it installs
the vLLM collector's hooks (:mod:`kvdiag.collectors.vllm_plugin`) and hands them this
package's agent, which they start in the process that builds a ``Scheduler`` (the engine
core). The agent lives above the collectors, so it is handed down here rather than imported
by the collector. Without the variable nothing is imported beyond the collector module.
"""

from __future__ import annotations


def register() -> None:
    """Install the vLLM hooks with :mod:`kvdiag.agent` when ``KVDIAG_AGENT=1``; never raises."""
    from kvdiag.collectors import vllm_plugin

    if not vllm_plugin.enabled():
        return
    try:
        from kvdiag import agent
    except Exception as exc:  # a broken install: vLLM serves on without kvdiag
        import sys
        print(f"kvdiag: vLLM plugin not installed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    vllm_plugin.register(agent)
