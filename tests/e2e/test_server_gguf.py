"""`backboard serve MODEL.gguf` on the real SmolLM2-135M-Instruct (fetched once into pytest's
cache, converted there on first use): the chat answer is words; a GGUF we cannot serve stops
start-up with one line naming why."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from backboard.models.smollm2 import fetch_smollm2
from tests.e2e.conftest import SERVED_NAME, start_server


@pytest.fixture(scope="module")
def smollm2_cache(request):
    cache = str(request.config.cache.mkdir("backboard-smollm2"))
    return cache, fetch_smollm2(cache)


def test_served_gguf_answers_in_words(smollm2_cache, tmp_path, monkeypatch):
    cache, gguf = smollm2_cache
    monkeypatch.setenv("BACKBOARD_CACHE", cache)          # the conversion is cached with the file
    server = start_server(gguf, tmp_path, "--max-model-len", "1024", "--dtype", "bfloat16")
    try:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": SERVED_NAME, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        assert "converted to" in server.log()
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_an_unsupported_gguf_stops_start_up_with_one_line(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "gpt.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("w", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = subprocess.run([sys.executable, "-m", "backboard.cli", "serve", str(path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1
    assert "GGUF architecture 'gpt2' is not supported" in r.stderr and "Traceback" not in r.stderr
