"""Production-like chat traffic for the demo server, deterministic for a given seed.

Shape of the traffic (the content lives in ``kvdiag/data/traffic.json``):

- a few shared customer-service system prompts (each conversation uses one);
- multi-turn conversations (1-3 turns): a follow-up re-sends the whole history, including
  the model's previous answer, as chat clients do;
- a mix of short questions and long ones (``long_share``) that paste a customer history, so
  that the prompt exceeds ``LONG_PROMPT_MIN_CHARS`` characters (well over 512 tokens);
- Poisson arrivals: request ``i`` is released at the i-th arrival of a Poisson process of
  ``rate_per_s``; a follow-up also waits for the answer it continues.

The sequence of requests (conversation, turn, text) depends only on the seed; answers are the
model's real text.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable, Iterator, Optional

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


def chat(base_url: str, model: str, messages: list[dict], max_tokens: int, request_id: str,
         timeout_s: float = 600.0) -> dict:
    """POST one OpenAI-style chat completion (greedy) and return the decoded JSON answer."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": False}).encode()
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-ID": request_id})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


class TrafficDriver:
    """Sends the plan's requests to a server at their arrival times, one thread per request."""

    def __init__(self, base_url: str, model: str, plan: TrafficPlan, max_tokens: int = 32,
                 on_result: Optional[Callable[[Result], None]] = None) -> None:
        self.base_url = base_url
        self.model = model
        self.plan = plan
        self.max_tokens = max_tokens
        self.on_result = on_result
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def _send(self, planned: PlannedRequest, predecessor: Optional[threading.Event]) -> None:
        conv = planned.conversation
        if predecessor is not None:
            predecessor.wait()
        messages = conv.messages + [{"role": "user", "content": conv.user_turns[planned.turn]}]
        t0 = time.monotonic()
        try:
            answer = chat(self.base_url, self.model, messages, self.max_tokens, planned.request_id)
            text = answer["choices"][0]["message"]["content"] or ""
            usage = answer.get("usage") or {}
            result = Result(planned.request_id, True, int(usage.get("prompt_tokens", 0)),
                            int(usage.get("completion_tokens", 0)), time.monotonic() - t0, text,
                            is_long=planned.is_long)
            conv.messages = messages + [{"role": "assistant", "content": text}]
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            result = Result(planned.request_id, False, latency_s=time.monotonic() - t0,
                            error=f"{type(exc).__name__}: {exc}", is_long=planned.is_long)
            conv.messages = messages + [{"role": "assistant", "content": ""}]
        with self._lock:
            self.results.append(result)
        if self.on_result is not None:
            self.on_result(result)

    def run(self, num_requests: Optional[int] = None, duration_s: Optional[float] = None) -> list[Result]:
        """Release requests until ``num_requests`` were sent or ``duration_s`` passed; wait for all."""
        if num_requests is None and duration_s is None:
            raise ValueError("expected --requests N or --duration S")
        start = time.monotonic()
        threads: list[threading.Thread] = []
        done_events: dict[str, threading.Event] = {}
        for planned in self.plan.requests():
            if num_requests is not None and planned.index >= num_requests:
                break
            if duration_s is not None and planned.arrival_s >= duration_s:
                break
            delay = start + planned.arrival_s - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            conv_id = planned.conversation.conversation_id
            predecessor = done_events.get(conv_id)
            finished = threading.Event()
            done_events[conv_id] = finished

            def work(p=planned, pred=predecessor, fin=finished):
                try:
                    self._send(p, pred)
                finally:
                    fin.set()

            thread = threading.Thread(target=work, name=f"kvdiag-traffic-{planned.index}", daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        return self.results
