"""Production-like chat traffic for the demo server, deterministic for a given seed.

Shape of the traffic (the content lives in ``kvdiag/data/traffic.json``):

- a few shared customer-service system prompts (each conversation uses one);
- multi-turn conversations (1-3 turns): a follow-up re-sends the whole history, including
  the model's previous answer, as chat clients do;
- a mix of short questions and long ones (``long_share``) that paste a customer history, so
  that the prompt exceeds ``LONG_PROMPT_MIN_CHARS`` characters (well over 512 tokens);
- Poisson arrivals: request ``i`` is released at the i-th arrival of a Poisson process of
  ``rate_per_s``; a follow-up also waits for the answer it continues;
- a cap on requests in flight (:class:`TrafficDriver` ``max_in_flight``): an arrival that finds
  the cap reached waits for a request to finish, and the following arrivals keep their Poisson
  gaps from then on. The arrival rate is so capped at what the machine serves, and the server's
  queue (so its queue wait) stays bounded whatever the machine.

The sequence of requests (conversation, turn, text) depends only on the seed; answers are the
model's real text.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable, Iterator, Optional

CHAT_ROUTE = "v1/chat/completions"
"""The OpenAI-style chat route the traffic posts to, relative to the server's root URL."""

LONG_PROMPT_MIN_CHARS = 1100  # with the ~1,500-character system prompts: > 512 tokens


def load_corpus() -> dict:
    """System prompts, questions and templates shipped with kvdiag."""
    return json.loads(resources.files("kvdiag").joinpath("data/traffic.json").read_text())


@dataclass
class Conversation:
    conversation_id: str
    system_prompt: str
    system_name: str
    user_turns: list[str]
    messages: list[dict] = field(default_factory=list)


@dataclass
class PlannedRequest:
    """One chat request of the plan: turn ``turn`` (0-based) of ``conversation``."""

    index: int
    conversation: Conversation
    turn: int
    arrival_s: float  # offset from the start of the traffic

    @property
    def request_id(self) -> str:
        return f"{self.conversation.conversation_id}/t{self.turn}"

    @property
    def is_long(self) -> bool:
        return len(self.conversation.user_turns[self.turn]) >= LONG_PROMPT_MIN_CHARS


class TrafficPlan:
    """An endless, seeded sequence of chat requests with Poisson arrival offsets."""

    def __init__(self, seed: int, rate_per_s: float, long_share: float = 0.3, max_turns: int = 3,
                 max_open_conversations: int = 4) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"rate: expected a positive number of requests per second, got {rate_per_s}")
        self.rng = random.Random(seed)
        self.rate_per_s = rate_per_s
        self.long_share = long_share
        self.max_turns = max_turns
        self.max_open = max_open_conversations
        self.corpus = load_corpus()
        self._next_conversation = 0

    def _fill(self, template: str) -> str:
        rng = self.rng
        return template.format(
            order=f"NW{rng.randrange(10**5, 10**6)}", days=rng.randint(2, 40),
            item=rng.choice(self.corpus["items"]), amount=rng.randint(12, 480),
            date=f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}")

    def _long_message(self, question: str) -> str:
        lines = [self.corpus["long_intro"]]
        while sum(len(x) + 1 for x in lines) < LONG_PROMPT_MIN_CHARS:
            lines.append(self._fill(self.rng.choice(self.corpus["long_lines"])))
        lines.append(question)
        return "\n".join(lines)

    def _new_conversation(self) -> Conversation:
        rng = self.rng
        system = rng.choice(self.corpus["system_prompts"])
        turns = rng.randint(1, self.max_turns)
        first = self._fill(rng.choice(self.corpus["questions"]))
        if rng.random() < self.long_share:
            first = self._long_message(first)
        user_turns = [first] + [rng.choice(self.corpus["follow_ups"]) for _ in range(turns - 1)]
        conv_id = f"c{self._next_conversation:04d}"
        self._next_conversation += 1
        return Conversation(conv_id, system["text"], system["name"], user_turns,
                            messages=[{"role": "system", "content": system["text"]}])

    def requests(self) -> Iterator[PlannedRequest]:
        """Requests in release order; follow-ups are interleaved with new conversations."""
        open_convs: list[tuple[Conversation, int]] = []  # (conversation, next turn)
        t = 0.0
        index = 0
        while True:
            t += self.rng.expovariate(self.rate_per_s)
            if open_convs and (len(open_convs) >= self.max_open or self.rng.random() < 0.5):
                k = self.rng.randrange(len(open_convs))
                conv, turn = open_convs.pop(k)
            else:
                conv, turn = self._new_conversation(), 0
            if turn + 1 < len(conv.user_turns):
                open_convs.append((conv, turn + 1))
            yield PlannedRequest(index, conv, turn, t)
            index += 1


@dataclass
class Result:
    request_id: str
    ok: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    answer: str = ""
    error: str = ""
    is_long: bool = False
    cut: bool = False  # failed because the traffic was aborted (TrafficDriver.abort), not by the server


def chat(base_url: str, model: str, messages: list[dict], max_tokens: int, request_id: str,
         timeout_s: float = 600.0, on_connection: Optional[Callable[[http.client.HTTPConnection], None]] = None
         ) -> dict:
    """POST one OpenAI-style chat completion (greedy) and return the decoded JSON answer.
    ``on_connection`` is given the connection before the request is sent (to cut it from
    another thread: :meth:`TrafficDriver.abort`). Raises ``urllib.error.HTTPError`` for a
    status other than 200, OSError or ``http.client.HTTPException`` when the connection fails."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": False}).encode()
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    if on_connection is not None:
        on_connection(conn)
    try:
        conn.request("POST", "/" + CHAT_ROUTE, body=body,
                     headers={"Content-Type": "application/json", "X-Request-ID": request_id})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise urllib.error.HTTPError(f"{base_url}/{CHAT_ROUTE}", resp.status, resp.reason,
                                         resp.headers, None)
        return json.loads(data)
    finally:
        conn.close()


class TrafficDriver:
    """Sends the plan's requests to a server at their arrival times, one thread per request,
    with at most ``max_in_flight`` requests sent and not yet answered (None: no cap)."""

    def __init__(self, base_url: str, model: str, plan: TrafficPlan, max_tokens: int = 32,
                 on_result: Optional[Callable[[Result], None]] = None, max_in_flight: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max in flight: expected a positive number of requests, got {max_in_flight}")
        self.base_url = base_url
        self.model = model
        self.plan = plan
        self.max_tokens = max_tokens
        self.on_result = on_result
        self.max_in_flight = max_in_flight
        self.results: list[Result] = []
        self.released = 0
        self.capped = 0  # releases the cap delayed
        self.abandoned = 0  # requests still unanswered when the drain's bound ran out
        self.started_s: Optional[float] = None
        self.stopped_sending_s: Optional[float] = None
        self._clock = clock
        self._lock = threading.Lock()
        self._slots = threading.Condition(self._lock)
        self._in_flight = 0
        self._stop = threading.Event()
        self._aborted = threading.Event()
        self._connections: set[http.client.HTTPConnection] = set()

    def stop(self) -> None:
        """Release no more requests (those in flight go on)."""
        self._stop.set()
        with self._slots:
            self._slots.notify_all()

    def abort(self) -> int:
        """Stop, and cut the connections of the requests in flight: a server that cancels a
        request whose client left (``transformers serve`` and vLLM do) frees it at once, so that
        its graceful shutdown need not wait for it; requests not yet sent are not sent. Returns
        how many connections were cut."""
        self._aborted.set()
        self.stop()
        with self._lock:
            connections = list(self._connections)
        cut = 0
        for conn in connections:
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
                except OSError:
                    pass
        return cut

    def _track(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._connections.add(conn)
        if self._aborted.is_set():  # aborted while it was being made: do not send it
            conn.close()
            raise ConnectionAbortedError("the traffic was stopped")

    @property
    def in_flight(self) -> int:
        """Requests released and not yet answered."""
        return self._in_flight

    def rates_per_s(self) -> tuple[float, float]:
        """(released, answered) requests per second: released over the sending window (from the
        start to now, or to when sending stopped), answered over the whole run so far."""
        if self.started_s is None:
            return 0.0, 0.0
        now = self._clock()
        sending_s = (self.stopped_sending_s or now) - self.started_s
        running_s = now - self.started_s
        return (self.released / sending_s if sending_s > 0 else 0.0,
                len(self.results) / running_s if running_s > 0 else 0.0)

    def _send(self, planned: PlannedRequest, predecessor: Optional[threading.Event]) -> None:
        conv = planned.conversation
        if predecessor is not None:
            predecessor.wait()
        messages = conv.messages + [{"role": "user", "content": conv.user_turns[planned.turn]}]
        t0 = time.monotonic()
        conn: list[http.client.HTTPConnection] = []
        try:
            if self._aborted.is_set():
                raise ConnectionAbortedError("the traffic was stopped")
            answer = chat(self.base_url, self.model, messages, self.max_tokens, planned.request_id,
                          on_connection=lambda c: (conn.append(c), self._track(c)))
            text = answer["choices"][0]["message"]["content"] or ""
            usage = answer.get("usage") or {}
            result = Result(planned.request_id, True, int(usage.get("prompt_tokens", 0)),
                            int(usage.get("completion_tokens", 0)), time.monotonic() - t0, text,
                            is_long=planned.is_long)
            conv.messages = messages + [{"role": "assistant", "content": text}]
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            result = Result(planned.request_id, False, latency_s=time.monotonic() - t0,
                            error=f"{type(exc).__name__}: {exc}", is_long=planned.is_long,
                            cut=self._aborted.is_set())
            conv.messages = messages + [{"role": "assistant", "content": ""}]
        with self._lock:
            self._connections.difference_update(conn)
            self.results.append(result)
        if self.on_result is not None:
            self.on_result(result)

    def _wait(self, until_s: float) -> bool:
        """Wait until clock time ``until_s``; False when stopped first."""
        while not self._stop.is_set():
            left = until_s - self._clock()
            if left <= 0:
                return True
            self._stop.wait(left)
        return False

    def _take_slot(self, deadline_s: float) -> Optional[bool]:
        """Wait for a free slot under the cap (until ``deadline_s``): whether it had to wait, or
        None when stopped or past the deadline first."""
        waited = False
        with self._slots:
            while self.max_in_flight is not None and self._in_flight >= self.max_in_flight:
                left = deadline_s - self._clock()
                if self._stop.is_set() or left <= 0:
                    return None
                waited = True
                self._slots.wait(min(left, 1.0))
            if self._stop.is_set() or self._clock() >= deadline_s:
                return None
            self._in_flight += 1
            return waited

    def _free_slot(self) -> None:
        with self._slots:
            self._in_flight -= 1
            self._slots.notify_all()

    def run(self, num_requests: Optional[int] = None, duration_s: Optional[float] = None,
            drain_s: float = float("inf"), on_drain: Optional[Callable[[int], None]] = None) -> list[Result]:
        """Release requests until ``num_requests`` were sent or ``duration_s`` of wall time passed
        (or :meth:`stop`), then wait up to ``drain_s`` for those in flight (``on_drain(n)`` is told
        how many first); ``abandoned`` counts those still unanswered after that."""
        if num_requests is None and duration_s is None:
            raise ValueError("expected --requests N or --duration S")
        start = self.started_s = self._clock()
        deadline = start + duration_s if duration_s is not None else float("inf")
        lag = 0.0  # how much the cap has delayed the schedule so far
        threads: list[threading.Thread] = []
        done_events: dict[str, threading.Event] = {}
        for planned in self.plan.requests():
            if num_requests is not None and planned.index >= num_requests:
                break
            due = start + planned.arrival_s + lag
            if due >= deadline or not self._wait(due):
                break
            waited = self._take_slot(deadline)
            if waited is None:
                break
            if waited:  # later arrivals keep their Poisson gaps from now
                lag += max(0.0, self._clock() - due)
                self.capped += 1
            conv_id = planned.conversation.conversation_id
            predecessor = done_events.get(conv_id)
            finished = threading.Event()
            done_events[conv_id] = finished

            def work(p=planned, pred=predecessor, fin=finished):
                try:
                    self._send(p, pred)
                finally:
                    fin.set()
                    self._free_slot()

            thread = threading.Thread(target=work, name=f"kvdiag-traffic-{planned.index}", daemon=True)
            self.released += 1
            thread.start()
            threads.append(thread)
        self.stopped_sending_s = self._clock()
        pending = [t for t in threads if t.is_alive()]
        if pending and on_drain is not None and not self._stop.is_set():
            on_drain(len(pending))
        end = self._clock() + drain_s
        for thread in pending:
            thread.join(timeout=max(0.0, end - self._clock()) if end != float("inf") else None)
        self.abandoned = sum(t.is_alive() for t in threads)
        return self.results
