"""vLLM's KV cache events, live: a ZMQ subscriber that turns them into schema events.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "topic": "kv"}'`` (optionally ``"replay_endpoint"``) publishes one
multipart message per engine step with cache changes: ``(topic, seq, payload)``, ``seq`` 8 bytes
big-endian counting batches from 0, ``payload`` msgpack of ``[ts, [event, ...], dp_rank?]``
(``ts``: wall-clock seconds). Events are tagged maps (``{"type": "BlockStored", ...}``; arrays
``["BlockStored", ...]`` before vLLM 0.11). Each becomes a ``PrefixCacheStored``,
``PrefixCacheRemoved`` or ``PrefixCacheCleared`` (:mod:`kvdiag.pool.prefix_cache`), with the
batch's ``ts`` as ``ts_ns`` and its ``seq``.

vLLM binds a wildcard endpoint (``tcp://*:5557``) and connects to any other: for those the
subscriber is the side that binds (``bind=True``; :func:`kvdiag.collectors.vllm.subscriber_side`
decides).

Health, as events, never exceptions: a seq above the expected one means batches were lost (the
subscriber joined a busy PUB socket late, or its queue overflowed). With ``replay_endpoint``
the missing batches are first asked for on vLLM's ROUTER replay socket; what it cannot return
is recorded as ``CollectorGap(collector="vllm-kv-events")`` whose ``dropped_events`` counts
*batches*, not events. A seq that goes back (the engine restarted) is a ``CollectorError`` and
a new expectation; an undecodable payload is counted and reported as one ``CollectorError``.

With ``raw_path`` every batch is also appended as one JSON line ``{"seq", "ts", "events"}``
(bytes as lists of ints), which ``kvdiag replay --format vllm`` reads and
:func:`kvdiag.traces.kv_event_traces.kv_event_gaps` checks for gaps.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Optional

import msgspec

from kvdiag.pool.kv_stream_health import StreamHealth
from kvdiag.pool.prefix_cache import (DUPLICATE_BATCH_MESSAGE, INT64_MAX, VLLM_KV_EVENTS_COLLECTOR,
                                 PrefixCacheTally, SeqTracker, batch_ts_ns, checked_int,
                                 event_dicts, schema_event)
from kvdiag.events.schema import CollectorError, CollectorGap, CollectorStatus, Event
from kvdiag.events.sinks import Sink

COLLECTOR = VLLM_KV_EVENTS_COLLECTOR
END_SEQ = b"\xff" * 8  # vLLM's end-of-replay marker: seq -1 as 8 signed big-endian bytes


class MalformedBatch(ValueError):
    """A message or payload that is not a vLLM KV event batch."""


def decode_batch(payload: bytes, seq: int) -> tuple[float, list, list[Event], Optional[int]]:
    """(ts in seconds, the raw events, their schema events, data-parallel rank) of one
    payload, every field checked as :func:`kvdiag.pool.prefix_cache.schema_event` does (the
    replay loader checks recorded batches the same way); raises :class:`MalformedBatch`."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise MalformedBatch(f"seq {seq}: not msgpack ({exc})") from None
    if isinstance(obj, dict):  # a batch encoded as a map (not array_like): same fields
        rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
        obj = [obj.get("ts"), obj.get("events")] + ([rank] if rank is not None else [])
    if not isinstance(obj, list) or len(obj) not in (2, 3) or not isinstance(obj[1], list):
        raise MalformedBatch(f"seq {seq}: expected a batch [ts, [events], dp_rank?]")
    try:
        ts_ns = batch_ts_ns(obj[0])
        rank = checked_int(obj[2], "dp_rank") if len(obj) == 3 else None
        events = [schema_event(d, ts_ns, seq) for ev in obj[1] for d in event_dicts(ev)]
    except (ValueError, KeyError, TypeError) as exc:
        raise MalformedBatch(f"seq {seq}: {exc}") from None
    return float(obj[0]), obj[1], events, rank


def _jsonable(value):
    """msgpack-decoded values as JSON: bytes as lists of ints (what the replay loader folds),
    a non-finite float (in a field kvdiag does not read) as null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return list(bytes(value))
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


class KVEventSubscriber:
    """Subscribes to vLLM's KV event PUB socket at ``endpoint`` (e.g. ``tcp://127.0.0.1:5557``)
    on a daemon thread and records schema events into ``sink``.

    Counters: ``batches`` (batches decoded, replayed ones included), ``events`` (schema events
    recorded), ``replayed_batches``, ``gaps`` and ``dropped_batches`` (lost, not replayed),
    ``restarts`` (seq went back), ``malformed`` (undecodable messages) and ``errors``
    (malformed messages plus sink or file failures). ``tally`` counts stored, duplicate,
    removed and cleared blocks (:class:`kvdiag.pool.prefix_cache.PrefixCacheTally`).
    ``replay_history``: on the first batch, also ask the replay endpoint for everything
    before it (a subscriber that joined a running engine learns what its cache holds).

    Any publisher of the wire format (vLLM, SGLang; LMCache and Mooncake publish through
    them; TensorRT-LLM's serialized events through a relay): ``publisher`` names it (``kvdiag
    attach`` writes it in its ``CollectorStatus``). ``health`` folds the stream
    (:class:`kvdiag.pool.kv_stream_health.StreamHealth`, ``pool_blocks`` its balance check's pool
    size); a batch received again (same seq and timestamp) is dropped, not recorded, and
    counted in ``duplicate_batches`` (one ``CollectorError`` at stop)."""

    def __init__(self, endpoint: str, sink: Sink, topic: str = "",
                 replay_endpoint: Optional[str] = None,
                 raw_path: Optional[str | os.PathLike] = None, *, bind: bool = False,
                 replay_history: bool = False,
                 replay_timeout_s: float = 1.0, poll_interval_s: float = 0.1,
                 publisher: str = "vllm", pool_blocks: Optional[int] = None) -> None:
        self.endpoint = endpoint
        self.publisher = publisher
        self.health = StreamHealth(pool_blocks)
        self.duplicate_batches = 0
        self.bind = bind  # listen on endpoint (vLLM connects to a non-wildcard address)
        self.sink = sink
        self.topic = topic
        self.replay_endpoint = replay_endpoint
        self.raw_path = raw_path
        self.replay_history = replay_history
        self.replay_timeout_s = replay_timeout_s
        self.poll_interval_s = poll_interval_s
        self.batches = 0
        self.events = 0
        self.replayed_batches = 0
        self.gaps = 0
        self.dropped_batches = 0
        self.restarts = 0
        self.malformed = 0
        self.errors = 0
        self.tally = PrefixCacheTally()
        self._seq = SeqTracker()
        self._last_ts_ns: Optional[int] = None
        self._pending_gap: Optional[tuple[Optional[int], int]] = None  # (start_ns, batches)
        self._reported: set[str] = set()
        self._raw = None
        self._ctx = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "KVEventSubscriber":
        """Start the thread; returns once its socket is connected and subscribed (a failure
        to connect is a ``CollectorError``/``CollectorStatus`` event, not an exception)."""
        self._stop.clear()
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, name="kvdiag-vllm-kv-events",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(5.0)
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (it polls every ``poll_interval_s``: it ends within about that)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.duplicate_batches:
            self._record(CollectorError(ts_ns=time.time_ns(), collector=COLLECTOR,
                                        message=f"{DUPLICATE_BATCH_MESSAGE}: seqs received twice",
                                        count=self.duplicate_batches))
        if self.malformed > 1:
            self._record(CollectorError(ts_ns=time.time_ns(), collector=COLLECTOR,
                                        message=f"{self.malformed} undecodable KV event batches "
                                                "in all (the first was reported)",
                                        count=self.malformed - 1))
        try:
            self.sink.flush()
        except Exception:
            pass

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            import zmq
        except ImportError:
            self._record(CollectorStatus(ts_ns=time.time_ns(), collector=COLLECTOR, available=False,
                                         hint="pip install pyzmq"))
            self._ready.set()
            return
        self._ctx = zmq.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        try:
            if self.raw_path is not None:
                from kvdiag.paths import open_private
                self._raw = open_private(self.raw_path, "a", encoding="utf-8", buffering=1)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            (sub.bind if self.bind else sub.connect)(self.endpoint)
        except Exception as exc:
            self._error(f"cannot subscribe to {self.endpoint}: {type(exc).__name__}: {exc}")
            self._ready.set()
            self._close(sub)
            return
        self._ready.set()
        poll_ms = max(1, int(self.poll_interval_s * 1000))
        try:
            while not self._stop.is_set():
                if sub.poll(poll_ms):
                    frames = sub.recv_multipart()
                    try:
                        self._on_message(frames)
                    except Exception as exc:  # one odd message must not end the subscriber
                        self._error(f"message: {type(exc).__name__}: {exc}")
        except Exception as exc:  # zmq failures end the thread, reported, never raised
            self._error(f"subscriber stopped: {type(exc).__name__}: {exc}")
        finally:
            self._close(sub)

    def _close(self, sub) -> None:
        sub.close(0)
        if self._raw is not None:
            try:
                self._raw.close()
            except OSError:
                pass
            self._raw = None
        self._ctx.term()

    # ------------------------------------------------------------ messages

    def _on_message(self, frames: list[bytes]) -> None:
        """One multipart message of the PUB socket: (topic, seq, payload)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed(f"expected 3 frames (topic, 8-byte seq, payload), got "
                            f"{len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big")
        if seq > INT64_MAX:  # vLLM counts from 0; -1 (all ones) only ends a replay
            self._malformed(f"seq {seq}: expected a sequence number 0..{INT64_MAX}")
            return
        expected = self._seq.expected
        if expected is not None and seq < expected and self._duplicate(seq, frames[2]):
            self.duplicate_batches += 1  # already received: not a restart, not recorded again
            return
        step, _ = self._seq.observe(seq)
        if step == "first" and self.replay_history and self.replay_endpoint and seq > 0:
            self._fill(0, seq, report=False)
        elif step == "gap":
            self._fill(expected, seq, report=True)
        elif step == "restart":
            self.restarts += 1
            self.tally.restarted()
            self._record(CollectorError(
                ts_ns=time.time_ns(), collector=COLLECTOR,
                message=f"sequence went back from {expected - 1} to {seq}: the publisher "
                        "restarted; following its new sequence"))
        self._batch(seq, frames[2])

    def _duplicate(self, seq: int, payload: bytes) -> bool:
        """A batch already received (same seq, same timestamp): counted by :attr:`health`."""
        try:
            ts, _, _, _ = decode_batch(payload, seq)
        except MalformedBatch:
            return False
        ts_ns = int(ts * 1e9)
        return self.health.seen(seq, ts_ns) and not self.health.batch(seq, ts_ns)

    def _fill(self, start: int, stop: int, report: bool) -> None:
        """Batches ``start..stop-1`` were not received: replay what the publisher still has,
        in order; with ``report``, record the rest as one gap."""
        got = self._replay(start, stop) if self.replay_endpoint else {}
        before_ns = self._last_ts_ns
        for seq in sorted(got):
            self.replayed_batches += 1
            self._batch(seq, got[seq])
        missing = (stop - start) - len(got)
        if report and missing > 0:
            self.gaps += 1
            self.dropped_batches += missing
            self._pending_gap = (before_ns, missing)
        else:
            self._pending_gap = None

    def _replay(self, start: int, stop: int) -> dict[int, bytes]:
        """Payloads of seqs in ``[start, stop)`` from vLLM's ROUTER replay endpoint: send the
        start seq, read (topic, seq, payload) replies until the end marker, waiting at most
        ``replay_timeout_s`` for each reply."""
        import zmq

        got: dict[int, bytes] = {}
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            wait_ms = max(1, int(self.replay_timeout_s * 1000))
            while not self._stop.is_set() and dealer.poll(wait_ms):
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if start <= seq < stop:
                    got[seq] = payload
        except Exception as exc:
            self._error(f"replay from {self.replay_endpoint}: {type(exc).__name__}: {exc}")
        finally:
            dealer.close(0)
        return got

    def _batch(self, seq: int, payload: bytes) -> None:
        """Decode one batch, record its events (after the gap before it, if any)."""
        try:
            ts, raw, events, rank = decode_batch(payload, seq)
        except MalformedBatch as exc:
            self._malformed(str(exc))
            self._write_raw({"seq": seq, "ts": None, "events": [], "error": str(exc)})
            self._flush_gap(time.time_ns())
            return
        ts_ns = int(ts * 1e9)
        self._flush_gap(ts_ns)
        if not self.health.batch(seq, ts_ns):
            self.duplicate_batches += 1
            return
        self.batches += 1
        line = {"seq": seq, "ts": ts, "events": _jsonable(raw)}
        if rank is not None:
            line["data_parallel_rank"] = rank
        self._write_raw(line)
        for ev in events:
            self.tally.feed(ev)
            self.health.event(ev)
            if self._record(ev):
                self.events += 1
        self._last_ts_ns = ts_ns

    def _flush_gap(self, end_ns: int) -> None:
        if self._pending_gap is None:
            return
        before_ns, missing = self._pending_gap
        self._pending_gap = None
        self._record(CollectorGap(ts_ns=end_ns, collector=COLLECTOR,
                                  start_ns=end_ns if before_ns is None else before_ns,
                                  end_ns=end_ns, dropped_events=missing))

    # ------------------------------------------------------------ health

    def _write_raw(self, line: dict) -> None:
        if self._raw is None:
            return
        try:
            self._raw.write(json.dumps(line, separators=(",", ":")) + "\n")
        except (OSError, TypeError, ValueError) as exc:
            self._error(f"raw recording to {self.raw_path}: {type(exc).__name__}: {exc}")

    def _malformed(self, message: str) -> None:
        self.malformed += 1
        if self.malformed == 1:
            self._error(f"undecodable KV event batch: {message}", once=False)
        else:
            self.errors += 1

    def _error(self, message: str, once: bool = True) -> None:
        self.errors += 1
        key = message.split(":")[0]
        if once and key in self._reported:
            return
        self._reported.add(key)
        self._record(CollectorError(ts_ns=time.time_ns(), collector=COLLECTOR, message=message))

    def _record(self, event: Event) -> bool:
        try:
            self.sink.record(event)
            return True
        except Exception as exc:  # a sink must not raise; if it does, count it and go on
            self.errors += 1
            if "sink" not in self._reported:
                self._reported.add("sink")
                try:
                    self.sink.record(CollectorError(ts_ns=time.time_ns(), collector=COLLECTOR,
                                                    message=f"sink: {type(exc).__name__}: {exc}"))
                except Exception:
                    pass
            return False
