"""The one hook helper of engine adapters (kvdiag.events.hooks): error policy, signature check,
restoring, step phases."""

from __future__ import annotations

import pytest

from kvdiag.events.hooks import HookErrors, MethodHooks, step_phase
from kvdiag.events.schema import CollectorError, CollectorStatus
from kvdiag.events.sinks import ListSink, NullSink


class Engine:
    def step(self, batch, budget=0):
        return batch * 2

    def fail(self, batch):
        raise KeyError("the engine's own error")


class SubEngine(Engine):
    pass


def _hooks(sink=None):
    sink = sink if sink is not None else ListSink()
    return sink, MethodHooks(HookErrors(sink, "test-engine", clock_ns=lambda: 7))


def test_a_failing_hook_never_reaches_the_caller_is_counted_and_reported_once_per_kind():
    sink, hooks = _hooks()
    kinds = iter([ValueError, ValueError, TypeError, ValueError, TypeError])

    def after(note, result, engine, batch, budget=0):
        raise next(kinds)(f"batch {batch}")

    assert hooks.wrap(Engine, "step", after, params=("batch",))
    try:
        assert [Engine().step(n) for n in range(5)] == [0, 2, 4, 6, 8]  # served unchanged
    finally:
        hooks.restore()
    assert hooks.errors.errors == {"Engine.step": 5}
    errors = [e for e in sink.events if isinstance(e, CollectorError)]
    assert [(e.collector, e.message, e.count) for e in errors] == [
        ("test-engine:Engine.step", "ValueError: batch 0", 1),
        ("test-engine:Engine.step", "TypeError: batch 2", 1)]
    hooks.errors.report_totals()
    errors = [e for e in sink.events if isinstance(e, CollectorError)]
    assert [(e.message, e.count) for e in errors[2:]] == [("5 errors in all", 3)]
    assert sum(e.count for e in errors) == 5  # the events add up to the errors counted
    hooks.errors.report_totals()  # nothing new to tell
    assert len([e for e in sink.events if isinstance(e, CollectorError)]) == 3


def test_a_failing_before_still_runs_the_engine_and_after_gets_no_note():
    sink, hooks = _hooks()
    notes = []

    def before(engine, batch, budget=0):
        raise RuntimeError("before broke")

    hooks.wrap(Engine, "step", lambda note, result, *a, **kw: notes.append((note, result)), before)
    try:
        assert Engine().step(3, budget=1) == 6
    finally:
        hooks.restore()
    assert notes == [(None, 6)]
    assert hooks.errors.errors == {"Engine.step": 1}


def test_the_engines_own_errors_pass_through_untouched():
    _, hooks = _hooks()
    called = []
    hooks.wrap(Engine, "fail", lambda *a, **kw: called.append(a))
    try:
        with pytest.raises(KeyError, match="the engine's own error"):
            Engine().fail(1)
    finally:
        hooks.restore()
    assert called == [] and hooks.errors.total == 0


def test_a_changed_signature_is_skipped_and_said_not_a_crash():
    sink, hooks = _hooks()
    original = Engine.__dict__["step"]
    assert not hooks.wrap(Engine, "step", lambda *a, **kw: None, params=("batch", "request"))
    assert not hooks.wrap(Engine, "gone", lambda *a, **kw: None)
    assert Engine.__dict__["step"] is original and not hooks.installed
    statuses = hooks.statuses()
    assert all(isinstance(s, CollectorStatus) and not s.available and s.ts_ns == 7 for s in statuses)
    assert {s.collector: s.hint for s in statuses} == {
        "test-engine:Engine.step": "hook not installed: parameters ['request'] not in this "
                                   "engine's signature",
        "test-engine:Engine.gone": "hook not installed: no such method in this engine version"}
    assert Engine().step(2) == 4


def test_restore_puts_back_own_attributes_and_removes_inherited_ones():
    _, hooks = _hooks()
    original = Engine.__dict__["step"]
    hooks.wrap(Engine, "step", lambda *a, **kw: None)
    hooks.wrap(SubEngine, "fail", lambda *a, **kw: None)
    assert Engine.__dict__["step"] is not original and "fail" in SubEngine.__dict__
    hooks.restore()
    assert Engine.__dict__["step"] is original and "fail" not in SubEngine.__dict__


def test_fault_injection_names_the_method_whose_after_raises():
    sink = ListSink()
    hooks = MethodHooks(HookErrors(sink, "test-engine"), fail_hook="step")
    hooks.wrap(Engine, "step", lambda *a, **kw: None)
    try:
        assert Engine().step(1) == 2
    finally:
        hooks.restore()
    errors = [e for e in sink.events if isinstance(e, CollectorError)]
    assert len(errors) == 1 and "KVDIAG_FAIL_HOOK" in errors[0].message


def test_a_failing_sink_is_counted_never_raised():
    class Broken:
        def record(self, event):
            raise OSError("disk full")

    errors = HookErrors(Broken(), "test-engine")
    assert errors.record(object()) is False
    errors.failed("x", ValueError("v"))  # its report fails too
    assert errors.errors == {"sink": 2, "x": 1}


def test_nobody_listening_prints_the_first_of_each_kind_on_stderr(capsys):
    errors = HookErrors(NullSink(), "test-engine")
    for _ in range(3):
        with errors.guard("hook"):
            raise ValueError("boom")
    assert capsys.readouterr().err == "kvdiag: test-engine:hook: ValueError: boom\n"
    assert errors.errors == {"hook": 3}


@pytest.mark.parametrize("prefill, decode, phase", [(10, 0, "prefill"), (0, 3, "decode"),
                                                    (10, 3, "mixed"), (0, 0, "prefill")])
def test_step_phase(prefill, decode, phase):
    assert step_phase(prefill, decode) == phase
