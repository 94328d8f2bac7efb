"""`backboard serve MODEL.gguf` on the real SmolLM2-135M-Instruct (fetched once into pytest's
cache, converted there on first use; conftest.smollm2_servers, shared with the other tests on it):
the chat answer is words; a GGUF we cannot serve stops start-up with one line naming why."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.e2e.conftest import SERVED_NAME


def test_served_gguf_answers_in_words(smollm2_servers):
    server = smollm2_servers["off"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": SERVED_NAME, "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    assert "converted to" in server.log()


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
