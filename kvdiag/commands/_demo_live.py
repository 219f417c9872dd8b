"""`kvdiag demo`'s live line: the agent's live stream folded into requests done, tokens/s, KV
blocks in use and the engine's prefix hit rate."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

from kvdiag.collectors.agent_client import AgentConnection
from kvdiag.events.schema import KVPoolInfo, KVPoolSample, RequestArrived, RequestFinished
from kvdiag.pool.hit_rate import counts_toward_hit_rate, engine_token_hit_rate


class LiveStats:
    """Folds the agent's live event stream into the numbers of the live line."""

    def __init__(self) -> None:
        self.blocks_used = 0
        self.blocks_cached = 0
        self.num_blocks = 0
        self.peak_blocks_used = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.arrived = 0
        self.finished = 0
        self.connected = False
        self._conn: Optional[AgentConnection] = None
        self._idle = threading.Condition()

    @property
    def prefix_hit_rate(self) -> Optional[float]:
        """The engine's token hit rate (:mod:`kvdiag.pool.hit_rate`) over the requests seen so far."""
        return engine_token_hit_rate(self.prompt_tokens, self.cached_prompt_tokens)

    def follow(self, path: Path) -> None:
        """Read the agent's stream in a daemon thread until it closes."""
        conn = AgentConnection(path)
        self._conn = conn
        self.connected = True
        threading.Thread(target=self._read, args=(conn,), name="kvdiag-demo-live", daemon=True).start()

    def _read(self, conn: AgentConnection) -> None:
        try:
            conn.read_header()
        except OSError:  # no header (AgentProtocolError) or the connection went away
            return
        for ev in conn.events():
            if isinstance(ev, KVPoolSample):
                self.blocks_used = ev.blocks_used
                self.blocks_cached = ev.blocks_cached
                self.num_blocks = ev.num_blocks
                self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used)
            elif isinstance(ev, KVPoolInfo):
                self.num_blocks = ev.num_blocks
            elif isinstance(ev, RequestArrived):
                with self._idle:
                    self.arrived += 1
            elif isinstance(ev, RequestFinished):
                if counts_toward_hit_rate(ev.status):
                    self.prompt_tokens += ev.prompt_tokens
                    self.cached_prompt_tokens += ev.cached_prompt_tokens
                with self._idle:
                    self.finished += 1
                    self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every request the engine saw arrive has finished (aborted ones included),
        at most ``timeout_s``; whether it did."""
        with self._idle:
            return self._idle.wait_for(lambda: self.finished >= self.arrived, timeout=timeout_s)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()



def live_line(done: int, total: Optional[int], tokens: int, elapsed_s: float, stats: LiveStats) -> str:
    rate = stats.prefix_hit_rate
    pool = f"{stats.blocks_used}/{stats.num_blocks} (+{stats.blocks_cached} cached)" if stats.num_blocks else "-"
    of = f"/{total}" if total else ""
    return (f"requests {done}{of} | {tokens / elapsed_s if elapsed_s > 0 else 0.0:5.1f} tok/s | "
            f"KV blocks {pool} | prefix hit {'-' if rate is None else f'{rate:.0%}'}")
