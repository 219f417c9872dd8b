"""The agent in the process where ``transformers serve`` runs its model.

From transformers 5.25 on, ``transformers serve`` runs each model in a process of its own,
spawned by ``EngineClient.start_process`` with ``run_until_parent_exits`` as its target; the
process that answers HTTP never touches the KV cache. The agent must be installed where the
engine runs, so :func:`route_agent_to_engine_process` makes that target start the agent first
(and stop it, flushing the log, when the server stops the process with SIGTERM). Earlier
versions serve in one process, where ``python -m kvdiag.run`` starts the agent itself.
"""

from __future__ import annotations

import functools
import logging
import signal
from typing import Callable, Optional


def _model_manager():
    """transformers' serving model manager, when it spawns the engine; else None."""
    try:
        from transformers.cli.serving import model_manager
    except Exception:  # not installed, or a version without a separate engine process
        return None
    spawns = hasattr(getattr(model_manager, "EngineClient", None), "start_process")
    return model_manager if spawns and hasattr(model_manager, "run_until_parent_exits") else None


def serves_in_a_child(command: list[str]) -> bool:
    """Whether ``command`` is ``transformers serve ...`` with a transformers that runs its model
    in a spawned process."""
    return (len(command) >= 2 and command[0].rsplit("/", 1)[-1] == "transformers"
            and command[1] == "serve" and _model_manager() is not None)


def route_agent_to_engine_process(agent_kwargs: dict) -> None:
    """Make every model process ``transformers serve`` spawns from now on start the agent with
    ``agent_kwargs`` (:func:`kvdiag.agent.start`'s arguments; they are pickled to the child)."""
    manager = _model_manager()
    if manager is None:
        raise RuntimeError("this transformers serves in one process: start the agent in it")
    manager.run_until_parent_exits = functools.partial(run_engine_with_agent, agent_kwargs,
                                                       manager.run_until_parent_exits)


def run_engine_with_agent(agent_kwargs: dict, run_until_parent_exits: Callable, target: Callable,
                          *args) -> None:
    """In the spawned model process: start the agent, run transformers' own target, and stop the
    agent (last pool sample, log flushed) however the process is asked to end."""
    from kvdiag import agent

    previous: Optional[object] = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        agent.start(**agent_kwargs)
    except Exception as exc:  # the engine serves without kvdiag rather than not at all
        logging.getLogger("kvdiag.agent").warning(
            "kvdiag agent: not started in the model's process (%s: %s); serving without it",
            type(exc).__name__, exc)
    try:
        run_until_parent_exits(target, *args)
    finally:
        agent.stop()
        signal.signal(signal.SIGTERM, previous)


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)
