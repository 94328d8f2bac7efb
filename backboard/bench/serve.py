"""`backboard bench serve`: measure one OpenAI-compatible server at one point, as InferenceX does.

One run: an untimed test request, `num_warmups` untimed copies of the first request (at the same
concurrency), then `num_prompts` random prompts in a closed loop of `concurrency` requests."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlparse

from tqdm import tqdm

from backboard.bench.client import get_backend, make_client, run_closed_loop, send_backend_request
from backboard.bench.dataset import BenchRequest, load_tokenizer, sample_random_requests
from backboard.bench.metrics import LATENCY_METRICS, PERCENTILES, compute_metrics, percentile_key

MAX_FAILED_FRACTION = 0.05


class BenchError(RuntimeError):
    """The run could not be made (server unreachable, bad answers to the test request, ...)."""


@dataclass
class ServeConfig:
    base_url: str
    model: str
    input_len: int
    output_len: int
    concurrency: int
    tokenizer: str | None = None
    range_ratio: float = 0.8
    num_prompts: int | None = None  # default 10 * concurrency
    num_warmups: int | None = None  # default 2 * concurrency
    seed: int = 0
    api_key: str | None = None
    disable_tqdm: bool = False
    backend: str = "vllm"  # InferenceX's --backend: vllm / openai (completions), openai-chat

    def __post_init__(self) -> None:
        check_base_url(self.base_url)
        get_backend(self.backend)
        for name in ("input_len", "output_len", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be >= 1")
        if self.num_prompts is None:
            self.num_prompts = 10 * self.concurrency
        if self.num_warmups is None:
            self.num_warmups = 2 * self.concurrency
        if self.num_prompts < 1 or self.num_warmups < 0:
            raise ValueError("number of prompts must be >= 1 and of warmups >= 0")
        if not 0.0 <= self.range_ratio <= 1.0:
            raise ValueError(f"range ratio must be in [0, 1], got {self.range_ratio}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + get_backend(self.backend).path

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None


def check_base_url(url: str) -> None:
    p = urlparse(url)
    if p.scheme not in ("http", "https") or not p.netloc:
        raise ValueError(f"base URL must look like http://HOST:PORT, got {url!r}")


def run_serve(cfg: ServeConfig, tokenizer=None) -> dict:
    """Make the run; returns the InferenceX result dict (plus `failed`, `errors`, `run_failed`).

    Raises BenchError when the server cannot be reached or fails the untimed test request."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer or cfg.model)
    requests = sample_random_requests(tokenizer, cfg.input_len, cfg.output_len, cfg.num_prompts,
                                      cfg.range_ratio, cfg.seed)
    outputs, duration = asyncio.run(_run(cfg, requests))
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": cfg.backend,
        "model_id": cfg.model,
        "tokenizer_id": cfg.tokenizer or cfg.model,
        "best_of": 1,
        "num_prompts": cfg.num_prompts,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": cfg.concurrency,
    }
    result.update(compute_metrics(outputs, duration))
    failed = sum(not o.success for o in outputs)
    result.update({
        "random_input_len": cfg.input_len,
        "random_output_len": cfg.output_len,
        "random_range_ratio": cfg.range_ratio,
        "seed": cfg.seed,
        "num_warmups": cfg.num_warmups,
        "failed": failed,
        "errors": [o.error for o in outputs],
        "run_failed": failed > MAX_FAILED_FRACTION * len(outputs),
    })
    return result


async def _run(cfg: ServeConfig, requests: list[BenchRequest]):
    first = requests[0]
    backend = get_backend(cfg.backend)
    async with make_client(cfg.concurrency) as client:
        test = await send_backend_request(client, cfg.base_url, backend, cfg.model, first,
                                          cfg.headers)
        if not test.success:
            raise BenchError(f"the test request to {cfg.url} failed: {test.error}")
        if cfg.num_warmups:
            await run_closed_loop(client, cfg.base_url, backend, cfg.model,
                                  [first] * cfg.num_warmups, cfg.concurrency, cfg.headers)
        with tqdm(total=len(requests), disable=cfg.disable_tqdm, desc="requests",
                  file=sys.stderr) as bar:
            return await run_closed_loop(client, cfg.base_url, backend, cfg.model, requests,
                                         cfg.concurrency, cfg.headers,
                                         on_done=lambda _o: bar.update(1))


def format_result(r: dict) -> str:
    """A human summary in the layout of the reference client."""
    lines = [
        "{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="),
        f"{'Successful requests:':<44}{r['completed']:>16}",
        f"{'Failed requests:':<44}{r['failed']:>16}",
        f"{'Maximum request concurrency:':<44}{r['max_concurrency']:>16}",
        f"{'Benchmark duration (s):':<44}{r['duration']:>16.2f}",
        f"{'Total input tokens:':<44}{r['total_input_tokens']:>16}",
        f"{'Total generated tokens:':<44}{r['total_output_tokens']:>16}",
        f"{'Request throughput (req/s):':<44}{r['request_throughput']:>16.2f}",
        f"{'Output token throughput (tok/s):':<44}{r['output_throughput']:>16.2f}",
        f"{'Total token throughput (tok/s):':<44}{r['total_token_throughput']:>16.2f}",
    ]
    for m in LATENCY_METRICS:
        lines.append("{s:{c}^60}".format(s=f" {m.upper()} (ms) ", c="-"))
        for stat in ["mean", "median"] + [percentile_key(p) for p in PERCENTILES]:
            key = f"{stat}_{m}_ms"
            lines.append(f"{stat + ':':<44}{r[key]:>16.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def failure_summary(r: dict, limit: int = 3) -> str:
    errs = [e for e in r["errors"] if e]
    shown = "\n".join(f"  - {e}" for e in errs[:limit])
    return (f"{r['failed']} of {len(r['errors'])} requests failed "
            f"(limit {MAX_FAILED_FRACTION:.0%}); first errors:\n{shown}")


def write_json(path: str, data: dict) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
