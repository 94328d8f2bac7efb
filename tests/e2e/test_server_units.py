"""In-process checks of the server's pieces (no engine process): request translation, error
descriptions, metrics from engine stats, and readiness before the model loads."""

from __future__ import annotations

import pytest

from backboard.core.outputs import SchedulerStats, TokenLogprobs
from backboard.engine.messages import EngineStats
from backboard.server import responses as R
from backboard.server.errors import APIError, describe_validation_error
from backboard.server.metrics import ServerMetrics
from backboard.server.protocol import ChatCompletionRequest, CompletionRequest


def test_request_translation():
    sp = CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "stop": "a", "logprobs": 2,
                                           "ignore_eos": True, "top_k": -1}).sampling_params()
    assert sp.greedy and sp.stop == ["a"] and sp.logprobs == 2 and sp.ignore_eos and sp.top_k == 0
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 9, "max_completion_tokens": 4,
                                                 "logprobs": True})
    sp = chat.sampling_params()
    assert sp.max_tokens == 4 and sp.logprobs == 0 and sp.temperature == 1.0
    with pytest.raises(APIError) as e:
        CompletionRequest.model_validate({"prompt": "x", "top_p": 2}).sampling_params()
    assert e.value.status == 400 and e.value.param == "top_p"
    assert CompletionRequest.model_validate({"prompt": [[1, 2]]}).single_prompt() == [1, 2]


def test_validation_error_description():
    msg, param = describe_validation_error([{"type": "int_parsing", "loc": ("body", "max_tokens"),
                                             "msg": "Input should be a valid integer", "input": "x"}])
    assert param == "max_tokens" and "max_tokens" in msg
    msg, param = describe_validation_error([{"type": "missing", "loc": ("body", "messages"), "msg": "x"}])
    assert param == "messages" and "required" in msg


def test_logprob_formats_clamp_and_offsets():
    class Tok:
        def id_to_piece(self, i):
            return {1: "ab", 2: "c"}[i]

    tt = R.TokenText(Tok())
    lps = [TokenLogprobs(1, -0.5, 1, [(1, -0.5), (2, float("-inf"))]), TokenLogprobs(2, -1.0, 2, [(1, -0.1)])]
    body, end = R.completion_logprobs(lps, tt, 10)
    assert body["tokens"] == ["ab", "c"] and body["text_offset"] == [10, 12] and end == 13
    assert body["top_logprobs"][0] == {"ab": -0.5, "c": -9999.0}
    assert body["top_logprobs"][1] == {"ab": -0.1, "c": -1.0}
    R.dumps(body)                                  # valid JSON (no -inf)


def test_logprobs_as_text_encode_exactly_like_the_dicts():
    """A large body's logprobs are encoded as they are made (no tree of small objects for the
    collector); the bytes are the same."""
    class TT:
        piece = staticmethod(lambda t: {1: "ab", 2: 'c"', 3: "ab"}[t])
        bytes = staticmethod(lambda t: [t, 7])

    lps = [TokenLogprobs(1, -0.5, 1, [(1, -0.5), (2, float("-inf")), (3, -2.0)]),
           TokenLogprobs(2, -1.0, 2, [(1, -0.1)])]
    for fmt in (lambda text: R.chat_logprobs(lps, TT, text), lambda text: R.completion_logprobs(lps, TT, 3, text)[0]):
        body = R.body("x", "id", 0, "m", [R.chat_choice(0, "t", fmt(False), "stop")] * 3)
        raw = R.body("x", "id", 0, "m", [R.chat_choice(0, "t", fmt(True), "stop")] * 3)
        assert "".join(R.dumps_pieces(raw)) == R.dumps(body)


def test_a_large_bodys_logprobs_leave_the_collector_little_to_scan():
    """n=8 x 1500 tokens x top-20 logprobs (about the largest non-streamed chat body the default
    limits allow), as the front end holds them: decoded from the engine's frames, then encoded by
    the body thread. Each full collection scans every tracked object with the GIL held; before
    the fix these were ~24 per token (TokenLogprobs and its list, then the body's entry dict, top
    list and 20 top dicts: 290,000 here) and /health stalled up to 0.9 s (issue 14). Now a few."""
    import gc
    import time

    import msgspec

    from backboard.core.outputs import EngineCoreOutput

    n, tokens, top = 8, 1500, 20
    enc = msgspec.msgpack.Encoder()
    frames = [enc.encode([EngineCoreOutput(f"r{i}", [t], [TokenLogprobs(t, -0.5, 1, tuple(
        (t + j, -1.0 - j) for j in range(top)))]) for i in range(n)]) for t in range(tokens)]
    pieces = {t: f"t{t}" for t in range(tokens + top)}
    raw = {t: list(p.encode()) for t, p in pieces.items()}

    class TT:
        piece = staticmethod(pieces.__getitem__)
        bytes = staticmethod(raw.__getitem__)

    dec = msgspec.msgpack.Decoder(list[EngineCoreOutput])
    gc.collect()
    before = len(gc.get_objects())
    held: list[list[TokenLogprobs]] = [[] for _ in range(n)]
    for f in frames:
        for i, eco in enumerate(dec.decode(f)):
            held[i].extend(eco.new_logprobs)
    body = R.body("chat.completion", "id", 0, "m", [R.chat_choice(i, "x", R.chat_logprobs(held[i], TT, True), "length")
                                                     for i in range(n)])
    gc.collect()
    tracked = len(gc.get_objects()) - before
    t0 = time.perf_counter()
    gc.collect()
    print(f"tracked objects added: {tracked}; a full collection: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    assert tracked < 1000, tracked
    assert len("".join(R.dumps_pieces(body))) > 10_000_000


def test_metrics_follow_engine_stats():
    m = ServerMetrics("m", num_spec_tokens=2)

    def stats(running, kv, drafts, per_pos, step_time, steps):
        return EngineStats(SchedulerStats(num_running=running, kv_cache_usage=kv, spec_num_drafts=drafts,
                                          spec_accepted_per_position=per_pos), steps, step_time)

    m.update_engine(stats(3, 0.5, 4, [2, 1], 1.0, 10))
    m.update_engine(stats(0, 0.0, 6, [3, 1], 1.5, 12))
    text = m.render().decode()
    assert 'backboard:num_requests_running{model_name="m"} 0.0' in text
    assert 'backboard:spec_decode_num_drafts_total{model_name="m"} 6.0' in text
    assert 'backboard:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3.0' in text
    assert 'backboard:engine_step_time_seconds_total{model_name="m"} 1.5' in text
    assert "_created" not in text


def test_not_ready_is_503(server_model):
    from fastapi.testclient import TestClient

    from backboard.engine.tokenizer import Tokenizer
    from backboard.server.api import ServerState, build_app

    class Loading:
        state, error, num_unfinished = "starting", None, 0

    state = ServerState(Loading(), Tokenizer(server_model), ["m"], server_model, 512, ServerMetrics("m"))
    client = TestClient(build_app(state))
    assert client.get("/health").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert client.get("/openapi.json").status_code == 200


def test_api_key_from_the_environment(monkeypatch):
    """The key can stay out of the command line (`ps` shows it there)."""
    import argparse

    from backboard.server.cli import api_key_of

    monkeypatch.setenv("BACKBOARD_API_KEY", "from-env")
    assert api_key_of(argparse.Namespace(api_key=None)) == "from-env"
    assert api_key_of(argparse.Namespace(api_key="flag")) == "flag"
    monkeypatch.setenv("BACKBOARD_API_KEY", "")
    assert api_key_of(argparse.Namespace(api_key=None)) is None


def test_a_bug_is_a_500_with_an_error_id_not_its_text(server_model, caplog):
    """An unexpected exception while serving: the client gets a 500 naming an error id; the
    exception's text and traceback go to the log under that id. A wrong API key is a 401."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from backboard.engine.tokenizer import Tokenizer
    from backboard.server.api import ServerState, build_app

    class Broken:
        state, error, num_unfinished = "ready", None, 0
        cfg = SimpleNamespace(scheduler=SimpleNamespace(fairness="request"))

        def add_request(self, *args, **kw):
            raise RuntimeError("secret internal detail")

    state = ServerState(Broken(), Tokenizer(server_model), ["m"], server_model, 512, ServerMetrics("m"),
                        api_key="k")
    client = TestClient(build_app(state), raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert "secret" not in r.text and "RuntimeError" not in r.text and err["type"] == "server_error"
    eid = r.headers["x-error-id"]
    assert eid in err["message"]
    assert any(eid in rec.getMessage() and rec.exc_info for rec in caplog.records)
    wrong = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer kk"})
    assert wrong.status_code == 401


@pytest.mark.parametrize("mode", ["request", "user"])
def test_fair_share_groups(server_model, mode):
    """--fairness user counts a request under its `user` field (one client's many requests share
    one group); otherwise, and without a user, under the request itself."""
    from types import SimpleNamespace

    from backboard.engine.tokenizer import Tokenizer
    from backboard.server.serving import GenerationHandler

    engine = SimpleNamespace(cfg=SimpleNamespace(scheduler=SimpleNamespace(fairness=mode)))
    gen = GenerationHandler(engine, Tokenizer(server_model), "m")
    alice = CompletionRequest.model_validate({"prompt": "x", "user": "alice"})
    anon = CompletionRequest.model_validate({"prompt": "x"})
    assert gen.group_of(alice, "cmpl-1") == ("user:alice" if mode == "user" else "cmpl-1")
    assert gen.group_of(anon, "cmpl-2") == "cmpl-2"
