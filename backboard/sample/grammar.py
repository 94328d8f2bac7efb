"""Structured output on xgrammar: a request's StructuredOutputsParams -> a grammar.

Two halves, on the two sides of the process boundary:
    check_structured_outputs   the server: builds the grammar without a tokenizer (cheap), so a bad
                               schema, regex or grammar is a 400 that names the field
    GrammarCompiler            the engine process: compiles against the model's vocabulary on a
                               thread of its own (never on the step loop), cached by the spec's key
                               (kind, text); compiling releases the GIL

JSON is generated compact (no free whitespace): a weak model given free whitespace can spend its
whole budget on newlines. The vocabulary's tables (xgrammar's TokenizerInfo: 5-7 s of a core for a
248K vocabulary on a 2-core Zen 3, with transformers' import) are built on the compile thread when
the first constrained request arrives, as vLLM does: built at start-up they ran right after
/health said ready and took one of two cores from the first requests' steps for ~8 s, whether or not
anyone asked for structured output."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

from backboard.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A spec that does not make a grammar; `param` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _xgr():
    import xgrammar

    return xgrammar


def xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without its time stamp and C++ source position."""
    return _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of the strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def bounded_strings(schema):
    """The schema with each length-bounded string as a pattern: xgrammar's rule for minLength /
    maxLength strings admits raw control characters (invalid JSON); the pattern excludes them."""
    if isinstance(schema, list):
        return [bounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings(v) for k, v in schema.items()}
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = '^[^"\\\\\\x00-\\x1f]{%d,%s}$' % (lo, "" if hi is None else int(hi))
    return out


def to_grammar(so: StructuredOutputsParams):
    """The xgrammar Grammar of a spec (no tokenizer needed). Raises what xgrammar raises."""
    xgr = _xgr()
    kind = so.kind
    if kind == "json":
        schema = bounded_strings(json.loads(so.json))
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(so.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(so.choice))
    if kind == "grammar":
        if "::=" in so.grammar:
            return xgr.Grammar.from_ebnf(so.grammar)
        return xgr.Grammar.from_lark(so.grammar)
    return xgr.Grammar.from_structural_tag(so.structural_tag)


def check_structured_outputs(so: StructuredOutputsParams, param: str | None = None) -> None:
    """Raise GrammarError (naming `param`, or the spec's kind) when the spec makes no grammar."""
    try:
        to_grammar(so)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own
        what = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
                "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}[so.kind]
        raise GrammarError(f"invalid {what}: {xgrammar_message(e)}", param or so.kind) from e


class GrammarCompiler:
    """Compiles specs against one vocabulary on a background thread; futures are cached by key.

    vocab_size is the model's (the logits' width: ids past the tokenizer are never allowed);
    stop_token_ids end a grammar (after it completes, only they are allowed)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: Sequence[int],
                 max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_cached = max_cached
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._compiler = None
        self._ready: Future | None = None      # the vocabulary's tables, started by the first compile
        self.num_compiled = 0
        self.compile_time_s = 0.0

    def _load_vocabulary(self) -> None:
        import time

        from transformers import AutoTokenizer

        xgr = _xgr()
        t0 = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        logger.info("grammar vocabulary ready (%d tokens) in %.2f s", self.vocab_size, time.perf_counter() - t0)

    def submit(self, so: StructuredOutputsParams) -> Future:
        """A future of the CompiledGrammar (done at once when cached); compile errors surface as
        GrammarError from future.result()."""
        key = so.key
        with self._lock:
            self._start_vocabulary()
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, so)
            self._cache[key] = fut
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return fut

    def get(self, so: StructuredOutputsParams):
        """The compiled grammar of a spec submitted before (blocks until it is done)."""
        return self.submit(so).result()

    def _compile(self, so: StructuredOutputsParams):
        import time

        self._ready.result()
        t0 = time.perf_counter()
        try:
            grammar = to_grammar(so)
            compiled = self._compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001
            raise GrammarError(f"cannot compile the {so.kind} grammar: {xgrammar_message(e)}", so.kind) from e
        self.compile_time_s += time.perf_counter() - t0
        self.num_compiled += 1
        return compiled

    def _start_vocabulary(self) -> None:
        """Queue the vocabulary's tables as the compile thread's first job, once (under _lock)."""
        if self._ready is None:
            self._ready = self._pool.submit(self._load_vocabulary)

    @property
    def vocabulary_started(self) -> bool:
        return self._ready is not None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Build the vocabulary's tables now and block until they exist (tests, benchmarks)."""
        with self._lock:
            self._start_vocabulary()
        self._ready.result(timeout)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
