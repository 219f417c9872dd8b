"""The vLLM entry point hands the agent to the vLLM collector's hooks (the collector never
imports the agent): on a stand-in scheduler (vLLM's attribute names, no vLLM needed), the
hooks start and stop exactly the agent API they were given, and start nothing without one."""

from __future__ import annotations

import importlib.util
import types

import pytest

from kvdiag.agent import vllm_entry
from kvdiag.collectors import vllm_agent_setup, vllm_plugin as vp
from kvdiag.collectors.vllm_hook_state import ENGINE, Hooks
from kvdiag.collectors.vllm_scheduler_hooks import _shutdown
from kvdiag.events.sinks import ListSink


class FakeAgentAPI:
    """``start``/``stop`` of :mod:`kvdiag.agent`, recording their calls."""

    def __init__(self) -> None:
        self.started: list[dict] = []
        self.stopped = 0
        self.agent = types.SimpleNamespace(name="agent")

    def start(self, **kwargs):
        self.started.append(kwargs)
        return self.agent

    def stop(self) -> None:
        self.stopped += 1


def _scheduler(block_size_tokens: int = 16):
    spec = types.SimpleNamespace(block_size=block_size_tokens)
    return types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(model="some/model")),
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec)]))


def test_the_hooks_start_the_agent_they_were_handed(monkeypatch):
    monkeypatch.delenv("KVDIAG_LOG", raising=False)
    monkeypatch.delenv("KVDIAG_SOCKET", raising=False)
    monkeypatch.setattr(vllm_agent_setup.atexit, "register", lambda fn: None)  # the stand-in outlives no process
    api = FakeAgentAPI()
    h = Hooks()
    h.agent_api = api
    vllm_agent_setup.start_agent(h, _scheduler(16))
    assert len(api.started) == 1
    kwargs = api.started[0]
    assert (kwargs["engine"], kwargs["model"], kwargs["block_size_tokens"]) == (ENGINE, "some/model", 16)
    assert h.agent is api.agent
    # the adapter the agent installs records through the hooks into the agent's sink
    sink = ListSink()
    adapter = kwargs["adapter"](sink, record_token_ids=True)
    assert isinstance(adapter, vllm_agent_setup.VllmAdapter)
    assert h.sink is sink and h.record_token_ids is True
    # a second scheduler in the same process starts no second agent
    vllm_agent_setup.start_agent(h, _scheduler(16))
    assert len(api.started) == 1
    # vLLM's Scheduler.shutdown stops it
    _shutdown(h)(None, None, _scheduler())
    assert api.stopped == 1


def test_without_an_agent_api_the_hooks_start_nothing():
    h = Hooks()
    vllm_agent_setup.start_agent(h, _scheduler())
    assert h.agent is None
    _shutdown(h)(None, None, _scheduler())  # nothing started: nothing to stop


def test_the_entry_point_does_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv("KVDIAG_AGENT", raising=False)
    monkeypatch.setattr(vp, "install_hooks", lambda agent_api=None: pytest.fail("hooks installed"))
    assert vllm_entry.register() is None


def test_the_entry_point_hands_kvdiag_agent_to_the_hooks(monkeypatch):
    import kvdiag.agent

    handed = []
    monkeypatch.setenv("KVDIAG_AGENT", "1")
    monkeypatch.setattr(vp, "install_hooks", lambda agent_api=None: handed.append(agent_api))
    vllm_entry.register()
    assert handed == [kvdiag.agent]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is importable here")
def test_without_vllm_the_entry_point_says_so_and_returns(monkeypatch, capsys):
    monkeypatch.setenv("KVDIAG_AGENT", "1")
    monkeypatch.setattr(vp, "_HOOKS", None)
    vllm_entry.register()
    assert "kvdiag: vLLM plugin not installed: ModuleNotFoundError" in capsys.readouterr().err
