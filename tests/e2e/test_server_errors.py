"""Bad requests: each gets the right 4xx with OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import API_KEY, SERVED_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON_AUTH = {**AUTH, "content-type": "application/json"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (id, path, body (dict, or raw bytes), headers, status, expected param, expected code, text in message)
CASES = [
    ("malformed-json", CMPL, b'{"prompt": "hi",', JSON_AUTH, 400, None, None, "not valid JSON"),
    ("body-not-object", CMPL, b'[1, 2, 3]', JSON_AUTH, 400, None, None, "JSON object"),
    ("missing-prompt", CMPL, {"max_tokens": 3}, AUTH, 400, "prompt", None, "prompt"),
    ("wrong-type-max-tokens", CMPL, {"prompt": "hi", "max_tokens": "many"}, AUTH, 400, "max_tokens", None,
     "max_tokens"),
    ("wrong-type-prompt", CMPL, {"prompt": {"text": "hi"}}, AUTH, 400, "prompt", None, "prompt"),
    ("negative-max-tokens", CMPL, {"prompt": "hi", "max_tokens": 0}, AUTH, 400, "max_tokens", None, ">= 1"),
    ("temperature-range", CMPL, {"prompt": "hi", "temperature": 101}, AUTH, 400, "temperature", None,
     "[0, 100]"),
    ("top-p-range", CMPL, {"prompt": "hi", "top_p": 1.5}, AUTH, 400, "top_p", None, "(0, 1]"),
    ("penalty-range", CMPL, {"prompt": "hi", "presence_penalty": 3}, AUTH, 400, "presence_penalty", None,
     "[-2, 2]"),
    ("logprobs-range", CMPL, {"prompt": "hi", "logprobs": 50}, AUTH, 400, "logprobs", None, "[0, 20]"),
    ("n-zero", CMPL, {"prompt": "hi", "n": 0}, AUTH, 400, "n", None, ">= 1"),
    ("n-huge", CMPL, {"prompt": "hi", "n": 10 ** 9}, AUTH, 400, "n", None, "128"),
    ("min-over-max", CMPL, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, AUTH, 400, "min_tokens",
     None, "min_tokens"),
    ("empty-prompt", CMPL, {"prompt": ""}, AUTH, 400, "prompt", None, "empty"),
    ("empty-token-list", CMPL, {"prompt": []}, AUTH, 400, "prompt", None, "empty"),
    ("token-out-of-range", CMPL, {"prompt": [1, 10 ** 7]}, AUTH, 400, "prompt", None, "out of range"),
    ("prompt-too-long", CMPL, {"prompt": list(range(3, 603))}, AUTH, 400, "prompt", None, "context"),
    ("prompt-plus-max-tokens", CMPL, {"prompt": "hi", "max_tokens": 1000}, AUTH, 400, "max_tokens", None,
     "exceeds"),
    ("batch-of-prompts", CMPL, {"prompt": ["a", "b"]}, AUTH, 400, "prompt", None, "batch"),
    ("echo", CMPL, {"prompt": "hi", "echo": True}, AUTH, 400, "echo", None, "echo"),
    ("stream-options-without-stream", CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, AUTH,
     400, "stream_options", None, "stream"),
    ("unknown-model", CMPL, {"model": "gpt-17", "prompt": "hi"}, AUTH, 404, "model", "model_not_found",
     "gpt-17"),
    ("missing-api-key", CMPL, {"prompt": "hi"}, {}, 401, None, "invalid_api_key", "API key"),
    ("wrong-api-key", CMPL, {"prompt": "hi"}, {"Authorization": "Bearer nope"}, 401, None, "invalid_api_key",
     "API key"),
    ("chat-no-messages", CHAT, {"messages": []}, AUTH, 400, "messages", None, "messages"),
    ("chat-messages-wrong-type", CHAT, {"messages": "hi"}, AUTH, 400, "messages", None, "messages"),
    ("chat-top-logprobs-without-logprobs", CHAT, {"messages": MSGS, "top_logprobs": 2}, AUTH, 400,
     "top_logprobs", None, "logprobs"),
    ("chat-image-content", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, AUTH,
     400, "messages", None, "image_url"),
    ("chat-unknown-model", CHAT, {"model": "nope", "messages": MSGS}, AUTH, 404, "model", "model_not_found",
     "nope"),
    ("chat-stop-wrong-type", CHAT, {"messages": MSGS, "stop": 5}, AUTH, 400, "stop", None, "stop"),
]


def _good(url: str) -> None:
    r = httpx.post(url + CMPL, headers=AUTH, timeout=60,
                   json={"model": SERVED_NAME, "prompt": "still serving", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(api_server, case):
    _, path, body, headers, status, param, code, text = case
    if isinstance(body, bytes):
        r = httpx.post(api_server.url + path, content=body, headers=headers, timeout=30)
    else:
        r = httpx.post(api_server.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and text in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["code"] == code, err
    _good(api_server.url)


def test_unknown_route_is_an_openai_error(api_server):
    r = httpx.get(api_server.url + "/v1/nothing-here", headers=AUTH)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    _good(api_server.url)
