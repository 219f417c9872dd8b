"""Shared fixtures (the real model, fetched once into the kvdiag cache and reused), the two
lanes the suite runs in (:func:`pytest_collection_modifyitems`) and the CI rule on skips: with
``KVDIAG_CI=1`` a run fails when any test was skipped for a reason other than missing GPU
hardware (reasons that start with :data:`HARDWARE_SKIP`)."""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

# hypothesis keeps its example database outside the repository (tests write nothing there)
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), f"kvdiag-tests-hypothesis-{os.getuid()}"))
# no per-example deadline: a deadline is a timing test, and the suite shares two cores with
# real servers (benchmarks/ measures speed). `pytest --hypothesis-profile=soak`: property tests
# that bound their examples for CI run 2,000 each instead; tests that take the profile's count
# keep 100 by default.
settings.register_profile("kvdiag", deadline=None)
settings.register_profile("soak", parent=settings.get_profile("kvdiag"), max_examples=2_000)
settings.load_profile("kvdiag")


def hypothesis_examples(ci: int) -> int:
    """``ci`` examples, or the loaded profile's count where a soak profile asks for more."""
    return max(ci, settings().max_examples) if settings().max_examples > 100 else ci


HARDWARE_SKIP = "needs a GPU"
"""Prefix of the only skip reason CI accepts: hardware this machine does not have."""

_unexpected_skips: list[str] = []


@pytest.fixture(scope="session")
def model_dir(pytestconfig):
    """The converted SmolLM2 folder. The first test that needs it fetches it, with the
    progress bar shown on the terminal (a fetch takes a minute); later sessions reuse it."""
    from kvdiag.demo.smollm import default_model_dir, model_ready

    if model_ready():
        return default_model_dir()
    from kvdiag.commands.fetch_model import resolve_with_progress

    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        return resolve_with_progress(None)


VLLM_LANE = "vllm"
"""The xdist group of every module with a test that runs a real vLLM server."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Two lanes (``-n 2 --dist loadgroup``, pyproject.toml): every module with a test that
    needs vLLM runs in one worker, one after another, as the memory allows (a vLLM server holds
    ~4.3 GB; a module starts at most two at once); every other module runs whole (its module
    fixtures set up once) in whichever worker is free. The modules that use the session's
    servers (:func:`session_vllms`, up until the session ends) run after those that start
    their own: at most three servers at once instead of four."""
    def module(item) -> str:
        return item.nodeid.split("::", 1)[0]

    vllm_modules = {module(item) for item in items
                    if item.get_closest_marker("vllm") is not None or "vllm_python" in item.fixturenames}
    session_modules = {module(item) for item in items if "session_vllms" in item.fixturenames}
    for item in items:
        name = module(item)
        item.add_marker(pytest.mark.xdist_group(VLLM_LANE if name in vllm_modules else name))
    items.sort(key=lambda item: module(item) in session_modules)  # stable: modules stay whole


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not reason.startswith(HARDWARE_SKIP):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("KVDIAG_CI") == "1" and _unexpected_skips and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("KVDIAG_CI") == "1" and _unexpected_skips:
        terminalreporter.section("skipped in CI (only missing GPU hardware may skip)", red=True)
        for line in _unexpected_skips:
            terminalreporter.write_line(line)


VLLM_SKIP = "needs vLLM: run `kvdiag fetch-engine vllm` (.ci/run always does)"


@pytest.fixture(scope="session")
def vllm_python():
    """The interpreter of vLLM's environment (``kvdiag fetch-engine vllm``), or a skip."""
    from kvdiag.demo.vllm_env import check_vllm_python, vllm_python as find

    python = find()
    if python is None:
        pytest.skip(VLLM_SKIP)
    problem = check_vllm_python(python)
    if problem:
        pytest.fail(problem)
    return python


@pytest.fixture(scope="session")
def session_vllms(request, vllm_python, model_dir, tmp_path_factory):
    """The session's real vLLM servers, started at once, each where a collected test needs it:
    ``vllm_server`` (kvdiag's plugin on) and ``plain_vllm`` (without it)."""
    from vllm_harness import collected_tests_use, running_vllms

    from kvdiag.demo.server_process import free_port

    prometheus_port = free_port()  # kvdiag's own metrics, served by the plugin in the engine core
    configs = {"vllm_server": (tmp_path_factory.mktemp("vllm-main"),
                               {"extra_env": {"KVDIAG_PROMETHEUS": f"127.0.0.1:{prometheus_port}"}}),
               "plain_vllm": (tmp_path_factory.mktemp("vllm-plain"), {"plugin": False})}
    wanted = {name: config for name, config in configs.items() if collected_tests_use(request, name)}
    with running_vllms(vllm_python, model_dir, wanted) as servers:
        if "vllm_server" in servers:
            servers["vllm_server"].kvdiag_metrics_url = f"http://127.0.0.1:{prometheus_port}/metrics"
        if "plain_vllm" in servers:
            assert not servers["plain_vllm"].socket_path.exists()
        yield servers


@pytest.fixture(scope="session")
def vllm_server(session_vllms):
    """One real vLLM server for the session: prefix caching, KV events and kvdiag's plugin on."""
    return session_vllms["vllm_server"]


@pytest.fixture(scope="session")
def plain_vllm(session_vllms):
    """One real vLLM server for the session without kvdiag's plugin (KV events on, as the harness
    starts it). Its tests tag their prompts or warm what they compare, so they may share it."""
    return session_vllms["plain_vllm"]
