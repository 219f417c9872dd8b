"""A real Prometheus (Debian's package, installed by .ci/run) on 127.0.0.1, for tests: its own
config, data dir and free port; queried through its HTTP API. Missing binaries fail."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

from waiting import wait_for


def binary(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} not found: install Debian's prometheus package (.ci/run does)"
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def response(self, expr: str) -> dict:
        """The query API's JSON answer, an error (HTTP 400/422: bad syntax or types) included."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            return json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as err:
            return json.loads(err.read())

    def query(self, expr: str) -> list[dict]:
        body = self.response(expr)
        assert body["status"] == "success", body
        return body["data"]["result"]


@contextlib.contextmanager
def running(tmp: Path, targets: list[str], timeout_s: float = 60) -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (host:port) every second; stopped on exit."""
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: kvdiag\n    static_configs:\n"
        f"      - targets: [{', '.join(repr(t) for t in targets)}]\n")
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        server = Prometheus(port)

        def ready():
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            return urllib.request.urlopen(f"{server.url}/-/ready", timeout=2).status == 200
        # until it listens, its HTTP API refuses connections (an OSError): not ready yet
        wait_for(ready, timeout_s, "Prometheus to be ready", poll_s=0.2, ignore=(OSError,))
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def replaying(paths: list[Path], nodes: Optional[list[str]] = None) -> Iterator[list]:
    """A kvdiag exporter per recorded log, on a free loopback port, fed every event of its
    log (``nodes``: header node names to tell logs of one host apart); closed on exit."""
    import msgspec

    from kvdiag.events.eventlog import iter_events, read_header
    from kvdiag.prometheus.exporter import serve

    started = []
    try:
        for i, path in enumerate(paths):
            header = read_header(path)
            if nodes is not None:
                header = msgspec.structs.replace(header, node=nodes[i])
            exporter = serve(0, header)
            started.append(exporter)
            for ev in iter_events(path):
                exporter.sink.record(ev)
        yield started
    finally:
        for exporter in started:
            exporter.close()
