"""Serving metrics exactly as the InferenceX client computes them.

Per request (times from `time.perf_counter()`, `st` taken just before the POST, after the client's
concurrency semaphore, so queueing inside the server is included):

- TTFT (time to first token): first token chunk - st. A token chunk is any stream chunk with a
  non-empty `choices` list, even if its text is empty.
- E2EL (end-to-end latency): last token chunk - st. The usage chunk and `[DONE]` do not count.
- TPOT (time per output token): (E2EL - TTFT) / (output_tokens - 1), only for requests with more
  than one output token; `output_tokens` comes only from the server's `usage.completion_tokens`.
- ITL (inter-token latency): the gaps between consecutive token chunks; the gaps of all requests are
  pooled. With several tokens per chunk it is per chunk, not per token.

Over the run: `duration` is the wall time of the timed phase; output throughput = output tokens /
duration; total token throughput = (input tokens, counted by the client's tokenizer, + output) /
duration; request throughput = completed / duration. Each latency is summarised by its mean,
median, population std (ddof 0) and the 90th / 99th / 99.9th percentiles (numpy's linear
interpolation), all in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (90.0, 99.0, 99.9)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestOutput:
    """What the client observed of one request (seconds)."""

    prompt_len: int = 0
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0  # E2EL
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0  # from usage.completion_tokens only; 0 when the server sent none
    generated_text: str = ""
    error: str = ""


def percentile_key(p: float) -> str:
    """90.0 -> 'p90', 99.9 -> 'p99.9' (InferenceX's field names)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize_ms(name: str, values_s: list[float],
                 percentiles: tuple[float, ...] = PERCENTILES) -> dict[str, float]:
    """mean / median / std (ddof 0) / percentiles of `values_s` (seconds) as `<stat>_<name>_ms`.

    An empty list summarises as zeros, as the reference client does."""
    v = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(v)),
        f"median_{name}_ms": float(np.median(v)),
        f"std_{name}_ms": float(np.std(v)),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(v, p, method="linear"))
    return out


def request_tpot(out: RequestOutput) -> float | None:
    """(E2EL - TTFT) / (output_tokens - 1); None for failed requests or <= 1 output token."""
    if not out.success or out.output_tokens <= 1:
        return None
    return (out.latency - out.ttft) / (out.output_tokens - 1)


def compute_metrics(outputs: list[RequestOutput], duration_s: float,
                    percentiles: tuple[float, ...] = PERCENTILES) -> dict:
    """The InferenceX summary of one timed run: counts, throughputs and latency statistics.

    Failed requests count 0 output tokens and contribute to no latency metric; `input_lens`,
    `output_lens`, `ttfts` and `e2els` keep one entry per request (output 0, latencies None when
    failed)."""
    ttfts, tpots, itls, e2els = [], [], [], []
    output_lens = []
    completed = total_input = 0
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            continue
        completed += 1
        total_input += out.prompt_len
        output_lens.append(out.output_tokens)
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        itls.extend(out.itl)
        tpot = request_tpot(out)
        if tpot is not None:
            tpots.append(tpot)
    total_output = sum(output_lens)
    result = {
        "duration": duration_s,
        "completed": completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput:": None,  # (sic) InferenceX's key; no goodput SLOs are set
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        # per request, in input_lens' order (seconds, as vLLM's detailed results; None: failed), so
        # that an outlier behind a p99 can be traced to its prompt
        "ttfts": [o.ttft if o.success else None for o in outputs],
        "e2els": [o.latency if o.success else None for o in outputs],
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(summarize_ms(name, values, percentiles))
    return result
