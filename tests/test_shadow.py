"""The shadow runner: a raising compressor changes nothing served and is counted; sampling
respects the time budget; metrics agree with a direct computation on real KV."""

import pytest
import torch

from kvdiag.kernels.methods import Method, parse_method
from kvdiag.kernels.shadow import ShadowRunner
from kvdiag.kernels.shadow_hf import shadow_generate
from kvdiag.schema import CollectorError, ShadowBudget, ShadowCompression, ShadowLocality
from kvdiag.sinks import ListSink

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
    errors = [e for e in sink.events if isinstance(e, CollectorError)]
    assert len(errors) == steps * layers and errors[-1].count == steps * layers
    assert "compressor failed" in errors[0].message
    # the healthy method next to it still measured every layer and kv head
    ok = [e for e in sink.events if isinstance(e, ShadowCompression)]
    assert len(ok) == steps * layers * model.config.num_key_value_heads


def test_time_budget_limits_sampling():
    now = [0]
    runner = ShadowRunner(ListSink(), ["fp16"], sample_rate=1.0, budget_frac=0.1,
                          clock=lambda: now[0])
    assert runner.should_sample()  # first step: nothing spent yet
    runner.spent_ns = runner.last_run_ns = 50
    now[0] = 900
    assert not runner.should_sample()  # 50 + 50 > 0.1 * 900
    now[0] = 1000
    assert runner.should_sample()  # 50 + 50 <= 0.1 * 1000
    assert runner.skipped_budget == 1


def test_each_sampled_step_reports_the_budget_and_the_exporter_serves_it():
    """ShadowBudget after each sampled step, with an injected clock: the counts the runner
    made and spent / (budget x elapsed) as kvdiag_shadow_budget_used_ratio."""
    from kvdiag.exporter import PrometheusSink

    now = [0]
    sink = ListSink()
    runner = ShadowRunner(sink, ["fp16"], sample_rate=1.0, budget_frac=0.1, clock=lambda: now[0])
    costs = iter([30, 40])
    runner._measure = lambda snapshot: now.__setitem__(0, now[0] + next(costs))  # a run's cost
    _, kv = prefill_kv()
    queries = [torch.randn(1, 9, 1, 64) for _ in kv[:1]]
    assert runner.maybe_run(0, kv[:1], queries)      # offered at 0, ran 0..30
    now[0] = 1000
    assert runner.maybe_run(1, kv[:1], queries)      # offered at 1000 (30 + 30 <= 100), ran ..1040
    now[0] = 1090
    assert not runner.maybe_run(2, kv[:1], queries)  # offered at 1090: 70 + 40 > 0.1 x 1090
    budgets = [e for e in sink.events if isinstance(e, ShadowBudget)]
    assert [(b.steps_offered, b.steps_sampled, b.steps_skipped_budget, b.spent_ns, b.elapsed_ns)
            for b in budgets] == [(1, 1, 0, 30, 30), (2, 2, 0, 70, 1040)]
    exporter = PrometheusSink()
    for ev in sink.events:
        exporter.record(ev)
    served = {s.name: s.value for m in exporter.collect() for s in m.samples}
    exporter.close()
    assert served["kvdiag_shadow_budget_used_ratio"] == pytest.approx(70 / (0.1 * 1040))
    assert served["kvdiag_shadow_steps_sampled_total"] == 2
    assert served["kvdiag_shadow_seconds_total"] == pytest.approx(70e-9)


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
