"""The server's `prompt_logprobs` under preemption and chunked prefill: one entry per prompt token,
equal to transformers' fp32 logprobs (the offline path is tested in tests/models/)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import torch

from tests.conftest import hf_reference

NUM_TOP = 2
TOL = 2e-3


def _preemptions(url: str, wait_s: float = 5.0) -> float:
    """backboard:num_preemptions_total once the engine's stats have caught up (they are sent at
    most every 0.5 s, so the count can lag the last response)."""
    deadline = time.monotonic() + wait_s
    while True:
        metrics = httpx.get(url + "/metrics", timeout=10).text
        n = next(float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines()
                 if x.startswith("backboard:num_preemptions_total"))
        if n >= 1 or time.monotonic() > deadline:
            return n
        time.sleep(0.2)


def test_prompt_logprobs_under_preemption(server_factory, server_model):
    # 24 blocks of 8 tokens for six concurrent ~80-token requests, 32-token chunks
    server = server_factory("--max-model-len", "128", "--block-size", "8", "--num-kv-blocks", "24",
                            "--max-num-batched-tokens", "32", "--max-num-seqs", "6")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(50, 80, 6)]

    def ask(ids: list[int]) -> dict:
        r = httpx.post(server.url + "/v1/completions", timeout=300,
                       json={"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                             "prompt_logprobs": NUM_TOP})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        choices = list(pool.map(ask, prompts))
    assert _preemptions(server.url) >= 1
    ref = hf_reference(server_model)
    for ids, choice in zip(prompts, choices):
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        with torch.no_grad():
            lp = torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        for i in range(1, len(ids)):
            entries = {int(t): e["logprob"] for t, e in plp[i].items()}
            assert abs(entries[ids[i]] - float(lp[i - 1, ids[i]])) < TOL, i
            for t, v in entries.items():
                assert abs(v - float(lp[i - 1, t])) < TOL, (i, t)
            assert set(lp[i - 1].topk(NUM_TOP).indices.tolist()) <= set(entries), i
