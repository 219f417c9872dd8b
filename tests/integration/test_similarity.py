"""Cross-request KV similarity on the real SmolLM2 model."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model_and_tokenizer(model_dir):
    import torch

    torch.set_num_threads(1)
    from kvdiag.demo.smollm import load_model

    return load_model(model_dir)


SYSTEMS = ["You are a meticulous travel agent who answers in two sentences and always names a "
           "concrete place to visit, with opening hours when you know them.",
           "You are a terse Linux administrator. Reply with shell commands only, no prose, and "
           "prefer POSIX tools that exist on every distribution."]
QUESTIONS = ["What should I see in Lyon?", "How do I list open ports?", "Plan a day in Kyoto.",
             "Find large files in /var."]


def _chats():
    return [[{"role": "system", "content": s}, {"role": "user", "content": q}]
            for s in SYSTEMS for q in QUESTIONS]


def test_similarity_groups_and_values(model_and_tokenizer):
    import torch

    from kvdiag.diagnosis.similarity import _token_ids, kv_similarity

    model, tok = model_and_tokenizer
    res = kv_similarity(model, tok, _chats(), positions=10, offset=0, min_shared_tokens=20)
    f = res.frame
    n_layers = model.config.num_hidden_layers
    assert len(f) == 2 * n_layers
    same, diff = f[f.same_prompt], f[~f.same_prompt]
    # 2 system prompts x 4 questions: C(4,2) pairs within each, 4x4 across
    assert set(same.pairs) == {12} and set(diff.pairs) == {16}
    # identical leading tokens give identical KV (causal attention), measured not assumed
    assert np.allclose(same.k_cosine, 1.0, atol=1e-5) and np.allclose(same.v_cosine, 1.0, atol=1e-5)

    # independent check of one cross-prompt pair from a full-length forward with torch
    ids = [_token_ids(tok, c) for c in _chats()]
    a, b = ids[0], ids[len(QUESTIONS)]
    ks = []
    for t in (a, b):
        out = model(input_ids=torch.tensor([t]), use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        ks.append(cache.layers[5].keys[0, :, :10])
    want = torch.nn.functional.cosine_similarity(ks[0], ks[1], dim=-1).mean().item()
    pair = kv_similarity(model, tok, [a, b], positions=10, min_shared_tokens=20).frame
    assert pair.loc[pair.layer == 5, "k_cosine"].item() == pytest.approx(want, abs=1e-5)
    # the cross-prompt group differs from identical prompts in at least the deeper layers
    assert (diff.k_cosine < 0.999).any()

    events = res.events(ts_ns=1)
    assert len(events) == 2 * n_layers and events[0].positions == 10


def test_replay_similarity_on_a_kvdiag_log(model_and_tokenizer, tmp_path, capsys):
    """`kvdiag replay LOG --similarity --json` on a log of real chat prompts: one event per layer
    and group, equal to the function's result on the same token ids."""
    import json

    from kvdiag.diagnosis.similarity import _token_ids, kv_similarity
    from kvdiag.cli import main
    from kvdiag.events.eventlog import make_header
    from kvdiag.events.log_writer import LogWriter
    from kvdiag.events.schema import RequestArrived

    model, tok = model_and_tokenizer
    ids = [_token_ids(tok, c) for c in _chats()]
    log = tmp_path / "chat.kvlog"
    with LogWriter(log, make_header(engine="test", block_size_tokens=16)) as w:
        for i, t in enumerate(ids):
            w.record(RequestArrived(ts_ns=i + 1, request_id=str(i), prompt_tokens=len(t),
                                    token_ids=t))
    assert main(["replay", str(log), "--similarity", "--json", "--offset", "12",
                 "--positions", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["skipped_lines"] == {"count": 0, "first": []}
    rows = out["similarity"]
    want = kv_similarity(model, tok, ids, positions=6, offset=12).frame
    assert len(rows) == len(want) == 2 * model.config.num_hidden_layers
    for row in rows:
        w = want[(want.layer == row["layer"]) & (want.same_prompt == row["same_prompt"])]
        assert row["type"] == "shadow_similarity" and row["positions"] == 6
        assert row["k_cosine"] == pytest.approx(w.k_cosine.item(), abs=1e-6)
        assert row["pairs"] == w.pairs.item()
