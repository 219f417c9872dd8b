"""`kvdiag demo --prometheus [HOST:]PORT`: the address checked, a free port chosen for port 0, the
metrics URL, and the option handed to the server's agent."""

from __future__ import annotations

from kvdiag.demo.server_process import free_port


def problem(args) -> str:
    """Why ``--prometheus`` cannot be used as given ("" when it can)."""
    if args.prometheus is None:
        return ""
    from kvdiag.prometheus.exporter import parse_address
    try:
        parse_address(args.prometheus)
    except ValueError as exc:
        return f"--prometheus: {exc}"
    return ""


def resolve_port(args) -> None:
    """``--prometheus [HOST:]0``: a free port chosen here, so that the URL can be printed (the
    exporter runs in the server's process)."""
    if args.prometheus is None:
        return
    from kvdiag.prometheus.exporter import parse_address
    host, port = parse_address(args.prometheus)
    if port == 0:
        args.prometheus = f"[{host}]:{free_port()}" if ":" in host else f"{host}:{free_port()}"


def prometheus_url(address: str) -> str:
    """The ``/metrics`` URL of an exporter serving on ``[HOST:]PORT``."""
    from kvdiag.prometheus.exporter import parse_address
    host, port = parse_address(address)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def agent_args(args) -> list[str]:
    """``python -m kvdiag.run`` options of the exporter."""
    return ["--prometheus", args.prometheus] if args.prometheus is not None else []
