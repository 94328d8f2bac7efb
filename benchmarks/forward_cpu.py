"""Our flat-batch forward against transformers' forward on the same Qwen3.5-shaped model
(hidden 1024, 8 layers: 6 GDN + 2 gated attention, 0.8B layer shapes), side by side in one run.

Prints, for fp32 and bf16:
  prefill tokens/s of one prompt (ours / transformers, as a ratio);
  decode of 16 requests: our ONE flat-batch step vs 16 separate transformers decode calls
  (each request with its own cache) -- the figure that must be > 1x;
  decode of 1 request: step time, ours vs transformers.
The floor it is measured against is transformers' eager forward on the same machine and threads.

    python benchmarks/forward_cpu.py [--prompt-len 512] [--ctx 256] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard.config import ModelConfig  # noqa: E402
from backboard.forward_context import set_forward_context  # noqa: E402
from backboard.layers.linear import bf16_linear_weights  # noqa: E402
from backboard.models.loader import load_model, torch_dtype  # noqa: E402
from backboard.models.tiny import build_tiny_checkpoint  # noqa: E402
from backboard.ops import dispatch  # noqa: E402
from backboard.worker.input_batch import BatchRequest, prepare_batch  # noqa: E402
from backboard.worker.memory import allocate_caches  # noqa: E402


def best_of(fn, n: int = 3) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


class Ours:
    def __init__(self, path: str, dtype: str, num_reqs: int, ctx: int, bs: int = 16) -> None:
        self.cfg = ModelConfig.from_pretrained(path, dtype=dtype)
        self.model = load_model(self.cfg)
        self.bs = bs
        per = -(-(ctx + 64) // bs)
        self.caches = allocate_caches(self.cfg, per * num_reqs + 1, bs, num_reqs,
                                      torch_dtype(self.cfg.dtype))
        self.blocks = [list(range(i * per, (i + 1) * per)) for i in range(num_reqs)]
        # the weight copies the model runner makes after its caches (the decode rows' K-interleaved
        # ones, oneDNN's), so that steps here run as the engine's do
        dispatch.warm_cpu_gemm(torch.device("cpu"), bf16_linear_weights(self.model), per * bs,
                               self.model.lm_head.weight)

    @torch.inference_mode()
    def run(self, reqs: list[BatchRequest], logits_rows: int = 1) -> torch.Tensor:
        pb = prepare_batch(reqs, self.bs)
        with dispatch.fixed_selection():        # the whole step, logits too, as the model runner
            with set_forward_context(pb.meta, self.caches):
                h = self.model(pb.input_ids, pb.meta.positions)
            last = pb.query_start_loc[1:] - 1
            # a decode step needs every row: no gather (as the model runner's _logits)
            return self.model.compute_logits(h if len(last) == h.shape[0] else h[torch.from_numpy(last)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=256, help="context of each decoding request")
    ap.add_argument("--num-reqs", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--model", default=None, help="checkpoint (default: build the 'small' preset)")
    args = ap.parse_args()
    import transformers as tf

    path = args.model or os.path.join(tempfile.gettempdir(), "backboard-bench-small")
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"building the benchmark model in {path} ...", flush=True)
        build_tiny_checkpoint(path, arch="qwen3_5_text", preset="small", mtp=False)
    print(f"model {path}; torch threads {torch.get_num_threads()}; floor = transformers eager forward")
    rng = np.random.default_rng(0)
    B, ctx = args.num_reqs, args.ctx
    for dtype in args.dtypes.split(","):
        td = torch_dtype(dtype)
        hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=td).eval()
        ours = Ours(path, dtype, B, max(ctx, args.prompt_len))
        prompt = rng.integers(0, 1000, args.prompt_len).tolist()

        # prefill of one prompt
        t_ours = best_of(lambda: ours.run([BatchRequest(np.array(prompt), 0, ours.blocks[0], 0)]))
        with torch.inference_mode():
            t_hf = best_of(lambda: hf(input_ids=torch.tensor([prompt]), use_cache=True))
        print(f"[{dtype}] prefill {args.prompt_len} tokens: ours {args.prompt_len / t_ours:8.0f} tok/s, "
              f"transformers {args.prompt_len / t_hf:8.0f} tok/s  -> {t_hf / t_ours:5.2f}x")

        # B requests with ctx tokens of context each: fill caches, then time one decode step
        ctxs = [rng.integers(0, 1000, ctx).tolist() for _ in range(B)]
        ours.run([BatchRequest(np.array(c), 0, ours.blocks[i], i) for i, c in enumerate(ctxs)])
        nxt = [int(rng.integers(0, 1000)) for _ in range(B)]
        # the same step repeated: re-running position ctx overwrites its KV entry, so each call
        # is a genuine decode step over ctx tokens (GDN state advancing is part of the work)
        step = [BatchRequest(np.array([nxt[i]]), ctx, ours.blocks[i], i) for i in range(B)]
        t_ours_b = best_of(lambda: ours.run(step))
        t_ours_1 = best_of(lambda: ours.run(step[:1]))
        caches = []
        with torch.inference_mode():
            for c in ctxs:
                out = hf(input_ids=torch.tensor([c]), use_cache=True)
                caches.append(out.past_key_values)
        import copy

        # each call gets a fresh copy of its request's cache (copied outside the timed region), so
        # every call is a genuine ctx-long decode
        def hf_decode_fresh(n: int) -> float:
            total = 0.0
            with torch.inference_mode():
                for i in range(n):
                    cache = copy.deepcopy(caches[i])
                    t = time.perf_counter()
                    hf(input_ids=torch.tensor([[nxt[i]]]), past_key_values=cache, use_cache=True)
                    total += time.perf_counter() - t
            return total
        hf_decode_fresh(1)
        t_hf_b = min(hf_decode_fresh(B) for _ in range(2))
        t_hf_1 = min(hf_decode_fresh(1) for _ in range(3))
        print(f"[{dtype}] decode {B} requests (ctx {ctx}): ours one flat step {t_ours_b * 1e3:7.1f} ms, "
              f"transformers {B} calls {t_hf_b * 1e3:7.1f} ms  -> {t_hf_b / t_ours_b:5.2f}x")
        print(f"[{dtype}] decode 1 request  (ctx {ctx}): ours {t_ours_1 * 1e3:7.1f} ms, "
              f"transformers {t_hf_1 * 1e3:7.1f} ms  -> {t_hf_1 / t_ours_1:5.2f}x")


if __name__ == "__main__":
    main()
