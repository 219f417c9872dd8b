"""The shadow runner: a raising compressor changes nothing served and is counted; sampling
respects the CPU budget and adapts its rate to it; metrics agree with a direct computation on real KV."""

import threading

import pytest
import torch

from kvdiag.kernels.methods import Method, parse_method
from kvdiag.shadow.runner import ShadowRunner
from kvdiag.shadow.hf_decoder import shadow_generate
from kvdiag.events.schema import CollectorError, ShadowBudget, ShadowCompression, ShadowLocality
from kvdiag.events.sinks import ListSink

from kv_model import model_and_tokenizer, prefill_kv

pytestmark = pytest.mark.model


class Raising(Method):
    def compress(self, k, v, attn_mass=None):
        k.mul_(0)  # must only ever see a copy
        raise RuntimeError("compressor failed")


def test_raising_compressor_does_not_change_served_output_and_is_counted():
    model, tok = model_and_tokenizer()
    prompts = ["What is the capital of France?"]
    plain = shadow_generate(model, tok, prompts, None, max_new_tokens=8)
    sink = ListSink()
    runner = ShadowRunner(sink, [Raising("raising", "raising"), parse_method("int8")],
                          sample_rate=1.0, budget_frac=None, locality=False)
    shadowed = shadow_generate(model, tok, prompts, runner, max_new_tokens=8)
    assert shadowed.texts == plain.texts
    assert "Paris" in plain.texts[0]
    steps = len(shadowed.step_ns)
    layers = model.config.num_hidden_layers
    assert runner.runs == steps
    assert runner.errors["shadow:raising"] == steps * layers
    # the first error is reported at once, the others only counted (kvdiag.events.hooks)
    errors = [e for e in sink.events if isinstance(e, CollectorError)]
    assert [(e.collector, e.count) for e in errors] == [("shadow:raising", 1)]
    assert errors[0].message == "RuntimeError: compressor failed"
    runner.close()  # ... and the rest when the runner closes: the counts add up
    errors = [e for e in sink.events if isinstance(e, CollectorError)]
    assert [(e.collector, e.count) for e in errors] == [("shadow:raising", 1),
                                                        ("shadow:raising", steps * layers - 1)]
    # the healthy method next to it still measured every layer and kv head
    ok = [e for e in sink.events if isinstance(e, ShadowCompression)]
    assert len(ok) == steps * layers * model.config.num_key_value_heads


class FakeCpu:
    """An injected CPU clock: the test moves ``now`` (process and thread CPU alike)."""

    def __init__(self) -> None:
        self.now = 0

    def process_ns(self) -> int:
        return self.now

    def thread_ns(self) -> int:
        return self.now


def test_budget_guard_skips_a_step_that_would_overrun_the_cpu_budget():
    cpu = FakeCpu()
    runner = ShadowRunner(ListSink(), ["fp16"], sample_rate=1.0, budget_frac=0.1, cpu_clock=cpu)
    assert runner.should_sample()  # first step: nothing spent, no cost known yet
    runner.spent_ns, runner.run_ns = 50, 50.0  # as after two runs of 25 and 50 (estimate 50)
    cpu.now = 50 + 900  # engine CPU = 900 outside the 50 of shadow work
    assert not runner.should_sample()  # 50 + 50 > 0.1 * 900
    cpu.now = 50 + 1000
    assert runner.should_sample()  # 50 + 50 <= 0.1 * 1000
    assert runner.skipped_budget == 1


def test_rate_adapts_to_the_cpu_budget_and_shadow_cpu_stays_within_it():
    """A fake engine spends 1,000 ns of CPU per step and a shadow run costs 20,000 ns: a 2%
    budget affords one run per 1,000 steps. The runner must lower its 0.05 ceiling to about
    0.001, spread its samples over the run, and keep spent <= budget x engine CPU + one run."""
    cpu = FakeCpu()
    sink = ListSink()
    runner = ShadowRunner(sink, ["fp16"], sample_rate=0.05, budget_frac=0.02, cpu_clock=cpu, seed=3)
    runner._snapshot = lambda kv, q, layers: None
    runner._measure = lambda snapshot, layers: setattr(cpu, "now", cpu.now + 20_000)
    steps, engine_step_ns = 400_000, 1_000
    sampled_at = []
    for step in range(steps):
        cpu.now += engine_step_ns
        if runner.maybe_run(step, [], []):
            sampled_at.append(step)
        assert runner.spent_ns <= 0.02 * runner.engine_ns() + 20_000
    assert runner.engine_ns() == (steps - 1) * engine_step_ns  # counted from the first offer
    expected = 0.02 * engine_step_ns / 20_000  # 0.001
    assert runner.rate == pytest.approx(expected)
    # Binomial(400k, 0.001): 400 +- 20; the guard skips a few draws near the limit
    assert 300 <= len(sampled_at) <= 460
    assert runner.spent_ns / runner.engine_ns() > 0.015  # the budget is used, not wasted
    quarters = [sum(1 for s in sampled_at if q * steps // 4 <= s < (q + 1) * steps // 4) for q in range(4)]
    assert min(quarters) >= 60, quarters  # no bursts: every quarter of the run gets its share
    last = [e for e in sink.events if isinstance(e, ShadowBudget)][-1]
    assert last.clock == "cpu" and last.sample_rate == pytest.approx(expected) and last.sample_rate_max == 0.05
    assert last.steps_offered >= sampled_at[-1] + 1 and last.steps_sampled == len(sampled_at)
    assert last.spent_ns == 20_000 * len(sampled_at)
    runner.close()  # the final counts, current to the last offered step
    final = [e for e in sink.events if isinstance(e, ShadowBudget)][-1]
    assert (final.steps_offered, final.steps_sampled) == (steps, len(sampled_at))
    assert final.elapsed_ns == (steps - 1) * engine_step_ns


def test_a_run_the_worker_still_measures_counts_against_the_budget():
    """In the background, a queued run's measurement is not yet spent when the next step is
    offered: the guard counts it at the cost of a run, so a budget that affords one more run
    does not admit two; once the worker is done, the next run is admitted."""
    cpu = FakeCpu()
    runner = ShadowRunner(ListSink(), ["fp16"], sample_rate=1.0, budget_frac=0.1, cpu_clock=cpu, background=True)
    release, measuring = threading.Event(), threading.Event()
    runner._snapshot = lambda kv, q, layers: None
    runner._measure = lambda snapshot, layers: (measuring.set(), release.wait(10))
    try:
        assert runner.should_sample()  # the first offer, at CPU 0
        runner.spent_ns, runner.run_ns = 50, 50.0  # as after two runs of 25 and 50
        cpu.now = 50 + 1_000  # engine CPU 1,000: the budget is 100
        assert runner.maybe_run(1, [], [], sampled=True) and measuring.wait(10)  # the clock stands: 0 ns
        assert not runner.should_sample()  # 50 spent + (1 in flight + 1) x 50 > 100
        release.set()
        runner.wait()  # measured: the worker accounts it
        assert runner.should_sample()  # 50 spent + 1 x 50 <= 100
        assert runner.skipped_budget == 1
    finally:
        release.set()
        runner.close()


def test_after_the_warm_up_the_first_run_sets_the_estimates():
    """``warm_up`` pays the one-time costs, so the first run's cost is a typical one and the
    budget's estimates start with it (without a warm-up they start with the second)."""
    runs = {}
    for warm in (False, True):
        cpu = FakeCpu()
        runner = ShadowRunner(ListSink(), ["int4"], sample_rate=1.0, budget_frac=0.1, cpu_clock=cpu)
        if warm:
            runner.warm_up(kv_heads=2, query_heads=4, head_dim=64)
        runner._snapshot = lambda kv, q, layers: None
        runner._measure = lambda snapshot, layers: setattr(cpu, "now", cpu.now + 5_000)
        assert runner.maybe_run(0, [], [])
        runs[warm] = runner.run_ns
        runner.close()
    assert runs == {False: None, True: 5_000}


def test_first_run_one_time_cost_does_not_set_the_rate():
    """The first run pays one-time costs (1 ms here, 100x a warm run): it counts as spent, but
    the estimate starts with the second run, so the rate is the warm one from then on."""
    cpu = FakeCpu()
    runner = ShadowRunner(ListSink(), ["fp16"], sample_rate=1.0, budget_frac=0.01, cpu_clock=cpu)
    runner._snapshot = lambda kv, q, layers: None
    costs = iter([1_000_000] + [10_000] * 1000)
    runner._measure = lambda snapshot, layers: setattr(cpu, "now", cpu.now + next(costs))
    for step in range(300_000):
        cpu.now += 1_000
        runner.maybe_run(step, [], [])
    assert runner.run_ns == 10_000
    assert runner.rate == pytest.approx(0.01 * 1_000 / 10_000)
    assert runner.spent_ns <= 0.01 * runner.engine_ns() + 10_000


def test_ceiling_holds_when_the_budget_affords_more():
    cpu = FakeCpu()
    runner = ShadowRunner(ListSink(), ["fp16"], sample_rate=0.05, budget_frac=0.5, cpu_clock=cpu)
    runner._snapshot = lambda kv, q, layers: None
    runner._measure = lambda snapshot, layers: setattr(cpu, "now", cpu.now + 10)
    for step in range(20_000):
        cpu.now += 1_000
        runner.maybe_run(step, [], [])
    assert runner.rate == 0.05
    assert 0.04 < runner.sampled / runner.offered < 0.06


def test_each_sampled_step_reports_the_budget_and_the_exporter_serves_it():
    """ShadowBudget after each sampled step, with an injected CPU clock: the counts the runner
    made and spent / (budget x engine CPU) as kvdiag_shadow_budget_used_ratio."""
    from kvdiag.prometheus.exporter import PrometheusSink

    cpu = FakeCpu()
    sink = ListSink()
    runner = ShadowRunner(sink, ["fp16"], sample_rate=1.0, budget_frac=0.1, cpu_clock=cpu)
    costs = iter([30, 40])
    runner._measure = lambda snapshot, layers: setattr(cpu, "now", cpu.now + next(costs))  # a run's cost
    _, kv = prefill_kv()
    queries = [torch.randn(1, 9, 1, 64) for _ in kv[:1]]
    assert runner.maybe_run(0, kv[:1], queries)      # offered at 0, ran 0..30
    cpu.now = 1030                                   # engine CPU 1000
    assert runner.maybe_run(1, kv[:1], queries)      # 30 + 30 <= 100: ran ..1070
    cpu.now = 1070 + 5                               # engine CPU 1005
    assert not runner.maybe_run(2, kv[:1], queries)  # 70 + 40 (estimate: the second run) > 0.1 x 1005
    budgets = [e for e in sink.events if isinstance(e, ShadowBudget)]
    assert [(b.steps_offered, b.steps_sampled, b.steps_skipped_budget, b.spent_ns, b.elapsed_ns)
            for b in budgets] == [(1, 1, 0, 30, 0), (2, 2, 0, 70, 1000)]
    exporter = PrometheusSink()
    for ev in sink.events:
        exporter.record(ev)
    served = {s.name: s.value for m in exporter.collect() for s in m.samples}
    exporter.close()
    assert served["kvdiag_shadow_budget_used_ratio"] == pytest.approx(70 / (0.1 * 1000))
    assert served["kvdiag_shadow_steps_sampled_total"] == 2
    assert served["kvdiag_shadow_seconds_total"] == pytest.approx(70e-9)


def test_real_cpu_budget_holds_around_real_work():
    """Real clocks, real KV, a real matmul as the engine's step: shadow CPU stays within the
    budget plus one run, whatever the machine's speed (the guard is exact in CPU time)."""
    _, kv = prefill_kv()
    kv = kv[:2]
    queries = [torch.randn(1, 9, 1, 64) for _ in kv]
    ShadowRunner(ListSink(), ["int8", "int4"], locality=False).run(0, kv, queries)  # one-time costs
    runner = ShadowRunner(ListSink(), ["int8", "int4"], sample_rate=1.0, budget_frac=0.05, locality=False)
    a = torch.randn(256, 256)
    longest = 0
    for step in range(300):
        for _ in range(4):
            a = torch.tanh(a @ a)
        before = runner.spent_ns
        runner.maybe_run(step, kv, queries)
        longest = max(longest, runner.spent_ns - before)
    assert runner.sampled >= 2
    assert runner.spent_ns <= 0.05 * runner.engine_ns() + longest
    assert runner.sampled < runner.offered  # the budget, not the rate of 1.0, decided


def test_metrics_on_real_kv_match_direct_computation():
    _, kv = prefill_kv()
    torch.manual_seed(0)
    sink = ListSink()
    runner = ShadowRunner(sink, ["int4", "streaming:keep=0.5"], locality=True)
    layers = kv[:2]
    queries = [torch.randn(1, 9, 1, 64) * 3 for _ in layers]
    before = [k.clone() for k, _ in layers]
    runner.run(0, layers, queries)
    assert all(torch.equal(b, k) for b, (k, _) in zip(before, layers))  # live tensors untouched
    comp = [e for e in sink.events if isinstance(e, ShadowCompression)]
    assert len(comp) == 2 * 2 * 3 and len([e for e in sink.events if isinstance(e, ShadowLocality)]) == 2 * 9
    # direct: layer 1, kv head 2, int4 (KIVI): K per channel, V per token
    from kvdiag.kernels.quant import QuantSpec, dequantize, quantize

    k, v = layers[1]
    k_hat = dequantize(quantize(k, QuantSpec("int4", "channel"), "torch"), "torch")
    v_hat = dequantize(quantize(v, QuantSpec("int4", "token"), "torch"), "torch")
    q = queries[1][:, 6:9]  # query heads of kv head 2
    def attend(kk, vv):
        p = torch.softmax((q @ kk[:, 2:3].transpose(-1, -2)) / 8.0, dim=-1)
        return p, p @ vv[:, 2:3]
    p, o = attend(k, v)
    p_hat, o_hat = attend(k_hat, v_hat)
    ev = next(e for e in comp if e.layer == 1 and e.head == 2 and e.method == "int4")
    assert abs(ev.k_rel_error - float((k - k_hat)[:, 2].norm() / k[:, 2].norm())) < 1e-6
    assert abs(ev.v_rel_error - float((v - v_hat)[:, 2].norm() / v[:, 2].norm())) < 1e-6
    assert abs(ev.attn_score_error - float(0.5 * (p - p_hat).abs().sum(-1).mean())) < 1e-6
    assert abs(ev.attn_out_rel_error - float((o - o_hat).norm() / o.norm())) < 1e-5
    # sparse: the stored-bytes ratio counts the int16 indices
    t = k.shape[2]
    kept = round(0.5 * t)
    sev = next(e for e in comp if e.method == "streaming:keep=0.5")
    assert abs(sev.ratio - (2 * 3 * t * 64 * 4) / (2 * 3 * kept * 64 * 4 + 3 * kept * 2)) < 1e-9


def _key(ev):
    return (type(ev).__name__, ev.layer, ev.head, getattr(ev, "method", ""),
            round(getattr(ev, "k_rel_error", getattr(ev, "recent_mass", 0.0)), 12))


def test_background_worker_measures_the_same_as_inline_and_copies_first():
    _, kv = prefill_kv()
    layers = [(k.clone(), v.clone()) for k, v in kv[:3]]
    torch.manual_seed(2)
    queries = [torch.randn(1, 9, 1, 64) for _ in layers]
    inline, background = ListSink(), ListSink()
    ShadowRunner(inline, ["int4", "h2o"], budget_frac=None).maybe_run(0, layers, queries, sampled=True)
    runner = ShadowRunner(background, ["int4", "h2o"], budget_frac=None, background=True)
    try:
        runner.maybe_run(0, lambda: layers, lambda: queries, sampled=True)
        for k, v in layers:  # the server overwrites its cache right after the step
            k.zero_()
            v.zero_()
        runner.wait()
    finally:
        runner.close()
    assert runner.runs == 1 and not runner.errors
    measured = lambda events: [e for e in events if not isinstance(e, ShadowBudget)]  # noqa: E731
    assert sorted(map(_key, measured(inline.events))) == sorted(map(_key, measured(background.events)))


def test_layers_of_run_rotate_through_every_layer_evenly():
    runner = ShadowRunner(ListSink(), ["fp16"], layers_per_run=3)
    runs = [runner.layers_of_run(30, k) for k in range(30)]
    assert runs[0] == [0, 10, 20] and runs[1] == [1, 11, 21]
    counts = [sum(layer in r for r in runs) for layer in range(30)]
    assert counts == [3] * 30  # each layer measured equally often
    assert all(len(r) == 3 for r in runs)
    odd = [runner.layers_of_run(32, k) for k in range(32)]
    assert [sum(layer in r for r in odd) for layer in range(32)] == [3] * 32
    assert ShadowRunner(ListSink(), ["fp16"]).layers_of_run(30, 5) == list(range(30))
    assert runner.layers_of_run(2, 0) == [0, 1]
    with pytest.raises(ValueError, match="layers_per_run"):
        ShadowRunner(ListSink(), ["fp16"], layers_per_run=0)


def test_sampled_steps_measure_only_their_layers_on_real_kv():
    _, kv = prefill_kv()
    queries = [torch.randn(1, 9, 1, 64) for _ in kv]
    sink = ListSink()
    runner = ShadowRunner(sink, ["int8"], sample_rate=1.0, budget_frac=None, locality=False, layers_per_run=3)
    for step in range(4):
        assert runner.maybe_run(step, kv, queries)
    comp = [e for e in sink.events if isinstance(e, ShadowCompression)]
    by_step = {}
    for e in comp:
        by_step.setdefault(e.ts_ns, set()).add(e.layer)
    n = len(kv)
    assert sorted(sorted(v) for v in by_step.values()) == sorted(runner.layers_of_run(n, k) for k in range(4))


def test_budget_is_reported_while_no_step_is_sampled(monkeypatch):
    """A runner the budget holds back still records its counts (every BUDGET_REPORT_S of wall
    time), so a log's last ShadowBudget is not the stale one of its last sampled step."""
    from kvdiag.shadow import runner as shadow

    monkeypatch.setattr(shadow, "BUDGET_REPORT_S", 0.0)
    cpu = FakeCpu()
    sink = ListSink()
    runner = ShadowRunner(sink, ["fp16"], sample_rate=0.0, budget_frac=0.01, cpu_clock=cpu)
    for _ in range(5):
        cpu.now += 1_000
        assert not runner.should_sample()
    budgets = [e for e in sink.events if isinstance(e, ShadowBudget)]
    assert [b.steps_offered for b in budgets] == [1, 2, 3, 4, 5]
    assert budgets[-1].steps_sampled == 0 and budgets[-1].elapsed_ns == 4_000


def test_per_layer_inputs_are_gathered_only_for_the_measured_layers():
    """An engine hands KV and queries as PerLayer: a run with three layers fetches exactly
    those three, once each (the gather of the other layers is never paid)."""
    from kvdiag.shadow.runner import PerLayer

    _, kv = prefill_kv()
    queries = [torch.randn(1, 9, 1, 64) for _ in kv]
    fetched = {"kv": [], "q": []}

    def fetch(what, values):
        return lambda layer: fetched[what].append(layer) or values[layer]

    runner = ShadowRunner(ListSink(), ["int8"], sample_rate=1.0, budget_frac=None, locality=False, layers_per_run=3)
    assert runner.maybe_run(0, lambda: PerLayer(len(kv), fetch("kv", kv)),
                            lambda: PerLayer(len(queries), fetch("q", queries)))
    expected = runner.layers_of_run(len(kv), 0)
    assert fetched["kv"] == expected and fetched["q"] == expected
