"""The source for a running server given by PID (``kvdiag top --pid``): its agent's socket,
else attach's outside collectors, else the host view of the process."""

from __future__ import annotations

from kvdiag.collectors import agent_client
from kvdiag.collectors.agent_client import AgentConnection, AgentProtocolError
from kvdiag.live.merged_source import with_host_view
from kvdiag.live.outside_sources import OutsideSource, ProcessSource
from kvdiag.live.socket_source import SocketSource
from kvdiag.live.sources import NoEngineError, SourceError, find_agent_socket


def attach(pid: int, any_process: bool = False, outside=None):
    """A source for a running server: its agent socket if it has one; else, when its tree
    serves a recognised engine (vLLM, SGLang, TensorRT-LLM) or ``outside`` names a
    ``/metrics`` or KV-event endpoint, attach's outside collectors (:class:`OutsideSource`);
    else the host view. ``outside``: :class:`kvdiag.collectors.outside.OutsideOptions`.
    Raises SourceError when there is no such process or it may not be read, and when its agent
    does not send its header within :data:`~kvdiag.collectors.agent_client.HEADER_TIMEOUT_S`
    ("the agent is not answering"), refuses us or is another user's; :class:`NoEngineError`
    when the process serves no recognised engine (no agent in its tree, not a vLLM, SGLang or
    TensorRT-LLM server), unless ``any_process``."""
    import psutil

    from kvdiag.collectors.outside import OutsideOptions, recognised_server

    if not psutil.pid_exists(pid):
        raise SourceError(f"no process with PID {pid}")
    path = find_agent_socket(pid)
    served = recognised_server(pid) if path is None else None
    endpoints = outside is not None and bool(outside.metrics_url or outside.kv_events)
    if path is None and served is None and not endpoints and not any_process:
        raise NoEngineError(
            f"process {agent_client.process_label(pid)} serves no recognised engine: no kvdiag agent in "
            "its process tree and not a vLLM, SGLang or TensorRT-LLM server (--any-process watches it "
            "from outside anyway: process tree, NVML, py-spy)")
    if path is not None:
        try:
            conn = AgentConnection(path, timeout_s=agent_client.READ_TIMEOUT_S)
        except (AgentProtocolError, PermissionError) as exc:
            raise SourceError(f"pid {pid}: {exc}") from None
        except OSError:  # it went away: the outside view
            conn = None
        if conn is not None:
            try:
                conn.read_header()
            except OSError as exc:
                conn.close()
                raise SourceError(f"pid {pid}: {exc}") from None
            return with_host_view(SocketSource(path, description=f"pid {pid} agent", conn=conn), pid)
    try:
        if served is not None or endpoints:
            # an engine child (VLLM::EngineCore, ::Worker): its server's /metrics and KV events
            return OutsideSource(served.pid if served is not None else pid,
                                 options=outside or OutsideOptions(hardware=False))
        return ProcessSource(pid)
    except (RuntimeError, PermissionError) as exc:  # collectors' TargetGone / TargetNotAccessible
        raise SourceError(str(exc)) from None
