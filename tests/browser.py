"""Open an HTML file in headless Chromium (Debian's `chromium`): the rendered DOM, the console
messages, a screenshot."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--hide-scrollbars",
         # any network fetch goes to a closed port and fails
         "--proxy-server=127.0.0.1:9", "--enable-logging=stderr", "--v=0"]


def available() -> bool:
    return shutil.which("chromium") is not None


def _run(html: Path, extra: list[str], timeout_s: int = 180) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="kvdiag-chromium-") as profile:
        return subprocess.run(["chromium", *FLAGS, f"--user-data-dir={profile}", *extra,
                               html.resolve().as_uri()],
                              capture_output=True, text=True, timeout=timeout_s)


def dump_dom(html: Path, budget_ms: int = 15000) -> tuple[str, list[str]]:
    """The DOM after scripts ran, and the page's console messages."""
    p = _run(html, [f"--virtual-time-budget={budget_ms}", "--dump-dom"])
    console = [m.group(1) for m in re.finditer(r":CONSOLE[^\]]*\] (.*)", p.stderr)]
    return p.stdout, console


def screenshot(html: Path, out: Path, size: str = "1400,5000") -> Path:
    _run(html, ["--virtual-time-budget=15000", f"--window-size={size}", f"--screenshot={out}"])
    return out
