"""The page at / in headless Chromium against the shared server (tiny random-weight model, API
key): the key is asked for and sent, answers stream in, the stop button aborts the request on
the server (/metrics counts it), answers are formatted, the dashboard's plots move under load,
the scorecard viewer shows a report; on a 360 px phone and on a desktop, with no console error
and nothing loaded from elsewhere. Screenshots: test-artifacts/browser/ (see tests/e2e/browser.py)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.e2e.browser import DESKTOP, PHONE, Watched, chromium, screenshot  # noqa: F401 (fixture)
from tests.e2e.conftest import API_KEY, SERVED_NAME

VIEWPORTS = {"desktop": DESKTOP, "phone": PHONE}
ABORTED = 'backboard:request_success_total{finished_reason="abort"}'
RUNNING = "backboard:num_requests_running"


@pytest.fixture
def open_page(chromium, api_server):  # noqa: F811
    """open_page(path, viewport, key=True) -> (page, watcher); contexts closed afterwards."""
    contexts = []

    def open_(path: str = "/", viewport: dict = DESKTOP, key: bool = True):
        ctx = chromium.new_context(viewport=viewport)
        if key:
            ctx.add_init_script(f"localStorage.setItem('backboard.apiKey', {json.dumps(API_KEY)})")
        contexts.append(ctx)
        page = ctx.new_page()
        page.set_default_timeout(30_000)
        watched = Watched(api_server.url)
        watched.attach(page)
        page.goto(api_server.url + path)
        if key:
            page.wait_for_selector("body[data-ready='1']")
        return page, watched

    yield open_
    for ctx in contexts:
        ctx.close()


def _fits(page) -> None:
    width = page.evaluate("() => window.innerWidth")
    assert page.evaluate("() => document.documentElement.scrollWidth") <= width, "the page scrolls sideways"


def _wait_metric(server, key: str, pred, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if pred(m[key]):
            return m
        assert time.monotonic() < deadline, f"{key} stayed at {m[key]}"
        time.sleep(0.1)


def _settings(page, **fields) -> None:
    page.evaluate("() => { document.getElementById('settings').open = true; }")
    for name, value in fields.items():
        page.fill(f"#{name}", str(value))


ANSWER = ".msg.assistant:last-child"


@pytest.mark.parametrize("view", VIEWPORTS)
def test_chat_streams_and_stop_aborts_on_the_server(open_page, api_server, view):
    page, watched = open_page("/", VIEWPORTS[view], key=False)
    page.wait_for_selector("#key-dialog[open]")                 # the server has a key: asked first
    page.fill("#key-input", API_KEY)
    page.click("#key-save")
    page.wait_for_selector("body[data-ready='1']")
    assert page.input_value("#model") == SERVED_NAME
    _fits(page)
    _settings(page, **{"max-tokens": 480, "temperature": 0.8, "extra": '{"ignore_eos": true}'})
    before = _wait_metric(api_server, RUNNING, lambda v: v == 0)[ABORTED]

    page.fill("#prompt", "Tell me a long story")
    page.press("#prompt", "Enter")
    content = f"{ANSWER} .content"
    length = "([sel, n]) => (document.querySelector(sel)?.textContent.length ?? 0) > n"
    page.wait_for_function(length, arg=[content, 0])
    n = page.evaluate("(sel) => document.querySelector(sel).textContent.length", content)
    page.wait_for_function(length, arg=[content, n])                            # it streams
    assert page.is_visible("#stop") and page.is_disabled("#send")
    page.click("#stop")                  # at once: the engine's stats lag, the answer does not wait
    page.wait_for_selector(f"{ANSWER} .stats[data-finish='stopped']")
    after = _wait_metric(api_server, ABORTED, lambda v: v >= before + 1)
    assert after[ABORTED] == before + 1 and _wait_metric(api_server, RUNNING, lambda v: v == 0)
    assert page.is_hidden("#stop") and page.is_enabled("#send")
    stopped_tokens = int(page.get_attribute(f"{ANSWER} .stats", "data-tokens"))
    assert 0 < stopped_tokens < 480
    screenshot(page, f"chat-stopped-{view}")

    # a whole answer: its numbers, then the conversation survives a reload (kept in the browser)
    _settings(page, **{"max-tokens": 8})
    page.fill("#prompt", "And a short one")
    page.click("#send")
    stats = page.wait_for_selector(f"{ANSWER} .stats[data-finish='length']")
    assert stats.get_attribute("data-tokens") == "8" and float(stats.get_attribute("data-ttft-ms")) > 0
    assert "tok/s" in stats.text_content() and "TTFT" in stats.text_content()
    page.reload()
    page.wait_for_selector("body[data-ready='1']")
    assert page.locator(".msg.user .text").all_text_contents() == ["Tell me a long story", "And a short one"]
    assert page.locator(".msg.assistant .stats").count() == 2
    page.click("#clear")
    assert page.locator(".msg").count() == 0
    _fits(page)
    watched.check()


def _sse(*chunks) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def _delta(**d) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": SERVED_NAME,
            "choices": [{"index": 0, "delta": d, "finish_reason": None}]}


def test_reasoning_folded_json_and_tool_calls_formatted(open_page):
    """A scripted stream (random weights never write these) through the page's own parser."""
    page, watched = open_page("/")
    sent = []
    body = _sse(_delta(role="assistant", content="<think>The user wants"), _delta(content=" JSON.</think>"),
                _delta(content='{"a": 1, "b": [1, 2]}'),
                _delta(content='\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
                _delta(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "lookup", "arguments": '{"q": '}}]),
                _delta(tool_calls=[{"index": 0, "function": {"arguments": '"x"}'}}]),
                {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": SERVED_NAME,
                 "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}})

    def fulfil(route):
        sent.append(json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", fulfil)
    _settings(page, system="Be brief.", temperature=0.3, **{"top-p": 0.9, "max-tokens": 64, "extra": ""})
    page.fill("#prompt", "weather in Paris as JSON")
    page.press("#prompt", "Enter")
    page.wait_for_selector(f"{ANSWER} .stats[data-tokens='7']")
    reasoning = page.locator(f"{ANSWER} details.reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None   # folded
    assert reasoning.locator("pre").text_content() == "The user wants JSON."
    assert page.locator(f"{ANSWER} .block.json pre").text_content() == json.dumps({"a": 1, "b": [1, 2]}, indent=2)
    calls = [json.loads(t) for t in page.locator(f"{ANSWER} .block.tool_call pre").all_text_contents()]
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                     {"name": "lookup", "arguments": {"q": "x"}}]
    assert "<think>" not in page.locator(f"{ANSWER} .content").text_content()
    req = sent[0]
    assert req["model"] == SERVED_NAME and req["stream"] is True and req["stream_options"] == {"include_usage": True}
    assert (req["temperature"], req["top_p"], req["max_tokens"]) == (0.3, 0.9, 64)
    assert req["messages"] == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "weather in Paris as JSON"}]
    # the switch follows the template: enabled and sent where it has enable_thinking, else neither
    base = page.url.split("/", 3)
    info = httpx.get(f"{base[0]}//{base[2]}/api/info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    if info["thinking"]:
        assert set(req["chat_template_kwargs"]) == {"enable_thinking"} and not page.is_disabled("#thinking")
    else:
        assert "chat_template_kwargs" not in req and page.is_disabled("#thinking")
    # the next turn sends the answer without its reasoning
    page.fill("#prompt", "thanks")
    page.press("#prompt", "Enter")
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant .stats[data-finish]').length === 2")
    history = sent[1]["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user"]
    assert history[2]["content"].startswith('{"a": 1') and "<think>" not in history[2]["content"]
    # a bad "more fields" box is said, and nothing is sent
    _settings(page, extra="{oops")
    page.fill("#prompt", "again")
    page.press("#prompt", "Enter")
    assert "not JSON" in page.text_content("#chat-error") and len(sent) == 2
    screenshot(page, "chat-formatting-desktop")
    watched.check()


def test_thinking_switch_where_the_template_has_one(chromium, api_server):  # noqa: F811
    """A template with enable_thinking (the tiny one has none: /api/info is rewritten): the switch
    is sent, and what comes before </think> is reasoning, folded, while it streams too."""
    ctx = chromium.new_context(viewport=DESKTOP)
    ctx.add_init_script(f"localStorage.setItem('backboard.apiKey', {json.dumps(API_KEY)})")
    page = ctx.new_page()
    watched = Watched(api_server.url)
    watched.attach(page)
    sent = []

    def info(route):
        body = route.fetch().json()
        route.fulfill(json={**body, "thinking": True})

    def chat(route):
        sent.append(json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"content-type": "text/event-stream"},
                      body=_sse(_delta(content="Paris is"), _delta(content=" in France.</think>Paris.")))

    page.route("**/api/info", info)
    page.route("**/v1/chat/completions", chat)
    try:
        page.goto(api_server.url + "/")
        page.wait_for_selector("body[data-ready='1']")
        assert page.is_enabled("#thinking")
        page.check("#thinking")
        page.fill("#prompt", "Where is Paris?")
        page.press("#prompt", "Enter")
        page.wait_for_selector(f"{ANSWER} .stats[data-finish]")
        assert sent[0]["chat_template_kwargs"] == {"enable_thinking": True}
        assert page.locator(f"{ANSWER} details.reasoning pre").text_content() == "Paris is in France."
        assert page.locator(f"{ANSWER} .content").text_content() == "Paris."
        watched.check()
    finally:
        ctx.close()


class Load:
    """Closed-loop streaming completions on a few threads until stopped."""

    def __init__(self, server, concurrency: int = 4) -> None:
        self.server, self.stop = server, threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]
        self.done = 0

    def _run(self) -> None:
        payload = {"model": SERVED_NAME, "prompt": "the engine", "max_tokens": 48, "ignore_eos": True,
                   "stream": True}
        with httpx.Client(timeout=60, headers=self.server.headers) as c:
            while not self.stop.is_set():
                with c.stream("POST", self.server.url + "/v1/completions", json=payload) as r:
                    for _ in r.iter_lines():
                        pass
                self.done += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def _pixels(page, chart: str) -> str:
    return page.evaluate("(c) => document.querySelector(`[data-chart=${c}] canvas`).toDataURL()", chart)


def _latest(page, chart: str) -> dict:
    return json.loads(page.get_attribute(f"[data-chart={chart}] canvas", "data-latest") or "{}")


@pytest.mark.parametrize("view", VIEWPORTS)
def test_dashboard_plots_move_under_load(open_page, api_server, view):
    page, watched = open_page("/dashboard", VIEWPORTS[view])
    page.wait_for_selector("#engine-config tr")
    config = page.text_content("#engine-config")
    assert "float32" in config and "cpu" in config and "threads" in config and "kernels" in config
    with Load(api_server) as load:
        page.wait_for_function("() => Number(document.querySelector('[data-card=running] b').textContent) > 0")
        page.wait_for_function("() => JSON.parse(document.querySelector('[data-chart=throughput] canvas')"
                               ".dataset.latest || '{}').generation > 0", timeout=30_000)
        shots = {c: _pixels(page, c) for c in ("requests", "throughput", "phases")}
        points = int(page.get_attribute("[data-chart=requests] canvas", "data-points"))
        page.wait_for_function("(n) => Number(document.querySelector('[data-chart=requests] canvas')"
                               ".dataset.points) > n + 1", arg=points)       # two more samples drawn
        for c, before in shots.items():
            assert _pixels(page, c) != before, c
        # (a closed loop has instants with nothing running: wait for a busy sample)
        page.wait_for_function("() => ['phases', 'cache'].every((c) => Object.values(JSON.parse("
                               "document.querySelector(`[data-chart=${c}] canvas`).dataset.latest || '{}'))"
                               ".some((v) => v > 0))")
        assert _latest(page, "phases")["forward"] > 0 and _latest(page, "cache")["kv"] > 0
        assert page.text_content("[data-card=prefix] b").endswith("%")    # prefix caching is on by default
        screenshot(page, f"dashboard-load-{view}")
    assert load.done > 0
    page.wait_for_function("() => Number(document.querySelector('[data-card=running] b').textContent) === 0")
    page.wait_for_function("() => !document.querySelector('[data-card=ttft] b').textContent.startsWith('–')")
    _fits(page)
    watched.check()


@pytest.mark.parametrize("view", VIEWPORTS)
def test_tabs_fit_and_scorecards_show(open_page, api_server, view):
    page, watched = open_page("/", VIEWPORTS[view])
    for tab in ("dashboard", "scorecards", "chat"):
        page.click(f"#tabs a[data-tab={tab}]")
        page.wait_for_selector(f"body[data-tab={tab}]")
        shown = page.evaluate("() => [...document.querySelectorAll('section.tab')].filter((s) => !s.hidden)"
                              ".map((s) => s.id)")
        assert shown == [f"tab-{tab}"]
        _fits(page)
    listing = httpx.get(api_server.url + "/api/scorecards", headers=api_server.headers).json()
    page.click("#tabs a[data-tab=scorecards]")
    page.wait_for_selector("#scorecard-list[data-loaded='1']", state="attached")
    assert page.locator("#scorecard-list li").count() == len(listing["scorecards"])
    if not listing["scorecards"]:
        pytest.skip("no scorecard folder (not a source checkout)")
    first = listing["scorecards"][0]
    page.click("#scorecard-list li:first-child button")
    frame = page.frame_locator("#scorecard-frame")
    totals = first["totals"]["totals"]
    other, t = next(iter(totals.items()))
    frame.locator(f"text={first['totals']['ours']} vs {other}: {t['wins']}/{t['total']} wins").first.wait_for(
        timeout=180_000)                           # the report is built (plots and all) on demand
    assert frame.locator("img[src^='data:image/png;base64,']").count() >= 1
    _fits(page)
    screenshot(page, f"scorecard-{view}")
    watched.check()


def test_disable_frontend(server_factory):
    """`--disable-frontend`: no page, no /api/ routes; the OpenAI API and /metrics as before."""
    server = server_factory("--disable-frontend", "--max-num-seqs", "4", "--max-model-len", "256")
    for path in ("/", "/dashboard", "/static/app.js", "/api/dashboard", "/api/auth"):
        assert httpx.get(server.url + path, timeout=10).status_code == 404, path
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200


def test_browser_lookup_prefers_the_named_executable(monkeypatch, tmp_path):
    from tests.e2e import browser

    exe = tmp_path / "chrome"
    exe.write_text("#!/bin/sh\n")
    monkeypatch.setenv("BACKBOARD_CHROMIUM", str(exe))
    assert browser.find_chromium() == str(exe)
    monkeypatch.setenv("BACKBOARD_CHROMIUM", str(tmp_path / "missing"))
    assert browser.find_chromium() is None
