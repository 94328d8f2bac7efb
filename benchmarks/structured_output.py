"""Structured output on the CPU: what grammars cost and what they leave of speculation.

1. Grammar compile time (xgrammar, the engine's backend; llguidance beside it when installed) for a
   few JSON schemas, on the tiny vocabulary and (--real-vocab) the real 248K Qwen3.5 one; and the
   per-token mask time of each.
2. The sampler's grammar overhead: a batch of 64 logit rows (tiny and real vocabulary) with 0, 1,
   16 and 64 constrained rows (matchers spread over a JSON document: structure and string states),
   mask fill + apply + argmax, against the argmax alone (the floor).
3. Engine decode steps with 0, 1, 16 and 64 of 64 running requests constrained (tiny hybrid):
   mean step time, the floor being 0 constrained.
4. Speculation (n-gram, k = 3) on constrained vs unconstrained requests: mean acceptance length,
   and whether greedy output is identical to speculation off.

Numbers on the shared 2-core development machines are noisy; the ratios in one run are what count.

    python benchmarks/structured_output.py [--real-vocab] [--steps 32] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backboard.models.tiny import build_tiny_checkpoint, build_tokenizer  # noqa: E402
from backboard.ops.token_bitmask import apply_token_bitmask  # noqa: E402
from backboard.sample.grammar import to_grammar  # noqa: E402
from backboard.sample.grammar_mask import fill_step_bitmask  # noqa: E402
from backboard.sample.grammar_state import RequestGrammar  # noqa: E402
from backboard.sampling_params import StructuredOutputsParams as SO  # noqa: E402

NESTED = {"type": "object", "properties": {
    "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "status": {"enum": ["open", "closed", "pending"]},
    "owner": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
              "required": ["name"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["sku", "qty"]}}},
    "required": ["id", "tags", "status", "owner", "items"]}
NESTED_DOC = {"id": 7, "tags": ["alpha", "beta"], "status": "open", "owner": {"name": "Ada Lovelace",
              "email": "ada@example.com"}, "items": [{"sku": "X-1", "qty": 2, "price": 3.5}, {"sku": "Y", "qty": 1}]}
SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}, {"name": "Ada", "age": 36}),
    "nested": (NESTED, NESTED_DOC),
    "wide30": ({"type": "object", "properties": {f"f{i}": {"type": ["string", "integer", "number"][i % 3]}
                                                 for i in range(30)}, "required": [f"f{i}" for i in range(30)]},
               {f"f{i}": ["v", i, 1.5][i % 3] for i in range(30)}),
}


def timed(fn, reps: int = 1) -> float:
    """Seconds per call: the median of `reps` calls after one warm-up (the machine is shared)."""
    if reps > 1:
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


# ---- 1. compile ------------------------------------------------------------------------------------
def compile_times(tok_path: str, vocab_size: int) -> dict:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_path)
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    t_info = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos]))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos])
    ll = _llguidance(hf, vocab_size)
    print(f"\n[compile] vocabulary {vocab_size}: xgrammar tables {t_info * 1e3:.0f} ms (once per engine)")
    rows = {}
    for name, (schema, doc) in SCHEMAS.items():
        so = SO(json=json.dumps(schema))
        comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        tc = timed(lambda: comp.compile_grammar(to_grammar(so)))
        ids = hf.encode(json.dumps(doc), add_special_tokens=False) + [eos]
        g = RequestGrammar(comp.compile_grammar(to_grammar(so)), so)
        bm = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        t = time.perf_counter()
        for tid in ids:
            g.fill(bm, 0)
            assert g.accept(tid), (name, tid)
        tm = (time.perf_counter() - t) / len(ids)
        line = f"  {name:7s} xgrammar compile {tc * 1e3:7.1f} ms, mask+accept {tm * 1e6:6.1f} us/token"
        if ll is not None:
            lc, lm = ll(schema, ids)
            line += f" | llguidance compile {lc * 1e3:6.1f} ms, mask+accept {lm * 1e6:6.1f} us/token"
        print(line)
        rows[name] = (tc, tm)
    return rows


def _llguidance(hf, vocab_size: int):
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as llt
    except ImportError:
        return None
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)

    def run(schema, ids):
        t = time.perf_counter()
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))
        tc = time.perf_counter() - t
        bm = llt.allocate_token_bitmask(1, vocab_size)
        t = time.perf_counter()
        for tid in ids:
            llt.fill_next_token_bitmask(m, bm, 0)
            m.consume_token(tid)
        return tc, (time.perf_counter() - t) / len(ids)

    return run


# ---- 2. the sampler's overhead ---------------------------------------------------------------------
def sampler_overhead(tok_path: str, vocab_size: int, R: int = 64, reps: int = 21) -> None:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_path)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    so = SO(json=json.dumps(NESTED))
    cg = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(to_grammar(so))
    doc = hf.encode(json.dumps(NESTED_DOC), add_special_tokens=False)
    logits = torch.randn(R, vocab_size)
    print(f"\n[sampler] {R} logit rows x vocabulary {vocab_size}: copy + mask + argmax (the floor: 0 rows)")
    floor = None
    for n in (0, 1, 16, 64):
        grammars = [None] * R
        for i in range(n):           # states spread over the document: punctuation and strings
            g = RequestGrammar(cg, so)
            g.accept_committed(doc[:(i * 7) % len(doc)])
            grammars[i] = g
        ones = np.ones(R, dtype=np.int64)
        start = np.arange(R, dtype=np.int64)

        def step():
            x = logits.clone()
            if n:
                bm, rows = fill_step_bitmask(grammars, [[]] * R, start, ones, vocab_size)
                apply_token_bitmask(x, bm, rows)
            x.argmax(-1)

        t = timed(step, reps)
        floor = floor or t
        print(f"  {n:2d} constrained rows: {t * 1e3:7.2f} ms  ({t / floor:5.2f} x the floor)")


# ---- 3. engine steps, 4. speculation ---------------------------------------------------------------
def _step_time(llm, prompts, so, n: int, steps: int) -> float:
    """Mean seconds per engine step while 64 requests (the first n constrained) decode `steps` tokens."""
    from backboard import SamplingParams

    sps = [SamplingParams(max_tokens=steps, min_tokens=steps, ignore_eos=True, temperature=0,
                          structured_outputs=so if i < n else None) for i in range(64)]
    llm.generate(prompts[:2], sps[:2])          # the grammar compiled and cached
    s0, t = llm.engine.num_steps, time.perf_counter()
    outs = llm.generate(prompts, sps)
    assert all(len(o.outputs[0].token_ids) == steps for o in outs)
    return (time.perf_counter() - t) / (llm.engine.num_steps - s0)


def engine_runs(model: str, steps: int, rounds: int) -> None:
    from backboard import LLM, SamplingParams

    prompts = [f"Record number {i}: the engine, the model and the cache" for i in range(64)]
    so = SO(json=json.dumps(NESTED))
    print(f"\n[engine] tiny hybrid, 64 running requests, {steps} decode tokens each, greedy")
    llm = LLM(model, max_num_seqs=64, max_model_len=512)
    times: dict[int, list[float]] = {n: [] for n in (0, 1, 16, 64)}
    for _ in range(rounds):                      # interleaved rounds: noise hits every n alike
        for n in times:
            times[n].append(_step_time(llm, prompts, so, n, steps))
    floor = float(np.median(times[0]))
    for n, ts in times.items():
        t = float(np.median(ts))
        print(f"  {n:2d} of 64 constrained: {t * 1e3:7.2f} ms per step ({t / floor:5.2f} x the floor; "
              f"rounds {', '.join(f'{x * 1e3:.0f}' for x in ts)} ms)")
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    print("\n[speculation] n-gram k=3, 16 requests of 96 tokens, greedy")
    for label, s in (("unconstrained", None), ("constrained (JSON)", so)):
        sps = [SamplingParams(max_tokens=96, temperature=0, structured_outputs=s)] * 16
        base = [o.outputs[0].token_ids for o in LLM(model, max_model_len=512).generate(prompts[:16], sps)]
        lsp = LLM(model, max_model_len=512, speculative_config=spec)
        got = [o.outputs[0].token_ids for o in lsp.generate(prompts[:16], sps)]
        st = lsp.stats()
        print(f"  {label:19s} mean acceptance length {st.get('spec_mean_acceptance_length', 0):.2f} "
              f"(drafts {st.get('spec_num_draft_tokens', 0)}, accepted {st.get('spec_num_accepted_tokens', 0)}); "
              f"greedy identical to speculation off: {got == base}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real-vocab", action="store_true", help="also the real 248K Qwen3.5 vocabulary")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine a second thread mostly waits)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch threads: {a.threads}; xgrammar and llguidance single-threaded")
    tmp = tempfile.mkdtemp(prefix="bb-structured-")
    tiny_tok = os.path.join(tmp, "tok")
    build_tokenizer(tiny_tok)
    vocabs = [(tiny_tok, 1024)]
    if a.real_vocab:
        from backboard.bench.checkpoint import VOCAB_SIZE, build_qwen35_tokenizer

        build_qwen35_tokenizer(os.path.join(tmp, "qwen35"))
        vocabs.append((os.path.join(tmp, "qwen35"), VOCAB_SIZE))
    for path, V in vocabs:
        compile_times(path, V)
    for path, V in vocabs:
        sampler_overhead(path, V)
    if not a.skip_engine:
        model = build_tiny_checkpoint(os.path.join(tmp, "model"), arch="qwen3_5_text", init_std=0.02)
        engine_runs(model, a.steps, a.rounds)


if __name__ == "__main__":
    main()
