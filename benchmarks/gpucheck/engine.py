"""The whole engine on the device: CUDA graphs, eager and MTP speculation must agree token for
token; a configuration that should replay graphs fails loudly when capture fell back to eager."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from benchmarks.gpucheck.budget import CLOCK, skipped
from benchmarks.gpucheck.plan import Plan


def engine_check(plan: Plan) -> list[dict]:
    """The engine end to end on the device: greedy outputs identical with CUDA graphs (replayed
    decode and verify steps, the profiling pass sizing the cache), eagerly, and with MTP
    speculation; output tokens/s of each. On a GPU a configuration that should replay graphs
    fails loudly when the runner fell back to eager (a failed capture is only logged there)."""
    import tempfile

    from backboard import SamplingParams
    from backboard.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(os.path.join(tempfile.mkdtemp(), "tiny"), arch="qwen3_5")
    rng = np.random.default_rng(0)
    n_prompts, n_tokens = (8, 12) if plan.smoke else (24, 64)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(5, 120, n_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
    on_gpu = plan.device.type == "cuda"
    out, ref = [], None
    for name, kw in (("eager", dict(enforce_eager=True)), ("graphs", {}),
                     ("graphs+mtp k=3", dict(speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                                                 "adaptive": False}))):
        if CLOCK.past("engine"):
            out.append(skipped(f"engine {name}", "engine"))
            continue
        ck, toks = _engine_run(path, name, kw, prompts, sp, on_gpu)
        ref = ref or toks
        ck["ok"] = toks == ref and not ck.get("error")
        out.append(ck)
    return out


def graph_fallback(name: str, on_gpu: bool, graphs: bool) -> str | None:
    """The error of an engine run that should have replayed CUDA graphs but ran eagerly."""
    if on_gpu and "graphs" in name and not graphs:
        return "CUDA graph capture failed: the runner fell back to eager (see its warning above)"
    return None


def _engine_run(path: str, name: str, kw: dict, prompts, sp, on_gpu: bool) -> tuple[dict, list]:
    from backboard import LLM
    t0 = time.time()
    llm = LLM(path, device="cuda" if on_gpu else "cpu", dtype="float32", max_model_len=256,
              max_num_seqs=16, gpu_memory_utilization=0.3, **kw)
    start_s = time.time() - t0
    llm.generate(prompts[:2], sp)
    t0 = time.time()
    toks = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    dt = time.time() - t0
    graphs = llm.engine.runner.graphs is not None
    ck = dict(name=f"engine {name}", what="tokens", rel_l2=0.0, tol=0.0, max_abs=0.0,
              tok_per_s=sum(map(len, toks)) / dt, startup_s=start_s, graphs=graphs,
              kv_blocks=llm.engine.runner.num_blocks)
    err = graph_fallback(name, on_gpu, graphs)
    if err:
        ck["error"] = err
        print(f"  !!! engine {name}: {err}", flush=True)
    print(f"  engine {name:<16} {ck['tok_per_s']:8.1f} tok/s graphs={graphs} kv_blocks={ck['kv_blocks']} "
          f"start-up {start_s:.1f} s", flush=True)
    del llm
    if on_gpu:
        torch.cuda.empty_cache()
    return ck, toks
