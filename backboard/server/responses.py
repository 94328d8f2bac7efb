"""OpenAI response shapes, built as plain dicts (cheap to serialize for every streamed chunk):
completions and chat completions (whole and chunked), usage, and both logprobs formats."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Iterator

from backboard.core.outputs import TokenLogprobs

_MIN_LOGPROB = -9999.0          # -inf is not JSON; vLLM clamps the same way


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


_SLICE = 256                    # list items per piece when a large body is encoded in pieces
_PIECE_DEPTH = 4                # containers this deep or deeper are encoded whole (or sliced)


class RawJSON(str):
    """JSON text already encoded (a large body's logprobs): dumps_pieces emits it as it is."""


def dumps_pieces(obj: Any, depth: int = 0) -> Iterator[str]:
    """dumps(obj), in pieces that concatenate to it: long lists are encoded a slice at a time, so
    the encoder never runs long without letting go of the GIL (large bodies are encoded on a
    worker thread while the event loop keeps serving). RawJSON values go out as they are."""
    if isinstance(obj, RawJSON):
        yield obj
    elif isinstance(obj, list) and len(obj) > _SLICE and not isinstance(obj[0], (dict, list, RawJSON)):
        yield "["
        for i in range(0, len(obj), _SLICE):
            yield ("," if i else "") + dumps(obj[i:i + _SLICE])[1:-1]
        yield "]"
    elif isinstance(obj, dict) and depth < _PIECE_DEPTH:
        yield "{"
        for i, (k, v) in enumerate(obj.items()):
            yield ("," if i else "") + dumps(k) + ":"
            yield from dumps_pieces(v, depth + 1)
        yield "}"
    elif isinstance(obj, list) and depth < _PIECE_DEPTH:
        yield "["
        for i, v in enumerate(obj):
            if i:
                yield ","
            yield from dumps_pieces(v, depth + 1)
        yield "]"
    else:
        yield dumps(obj)


def sse(obj: Any) -> bytes:
    """One server-sent event: `data: {json}\\n\\n`."""
    return b"data: " + dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache
    served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# ---- token text for logprobs ----------------------------------------------------------------
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted (byte-level BPE token strings -> raw bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Token id -> the text logprobs show (the token decoded alone) and its exact bytes."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._bytes_map = _byte_decoder()
        self.piece = lru_cache(maxsize=1 << 16)(self._piece)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _piece(self, token_id: int) -> str:
        return self.tok.id_to_piece(token_id)

    def _bytes(self, token_id: int) -> list[int]:
        raw = self.tok.hf.convert_ids_to_tokens(token_id)
        if isinstance(raw, str) and raw and all(ch in self._bytes_map for ch in raw) \
                and token_id not in self.tok.hf.all_special_ids:
            return [self._bytes_map[ch] for ch in raw]
        return list(self.piece(token_id).encode("utf-8"))


def _lp(x: float) -> float:
    return max(float(x), _MIN_LOGPROB)


def completion_logprobs(lps: list[TokenLogprobs], tt: TokenText, text_offset: int,
                        as_text: bool = False) -> tuple[dict | RawJSON, int]:
    """OpenAI's completions format {tokens, token_logprobs, top_logprobs, text_offset}; returns it
    and the text offset after these tokens (to continue across streamed chunks). `as_text`: as
    encoded JSON (see chat_logprobs)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        piece = tt.piece(lp.token_id)
        tokens.append(piece)
        token_lps.append(_lp(lp.logprob))
        top = {tt.piece(t): _lp(v) for t, v in lp.top}
        top.setdefault(piece, _lp(lp.logprob))
        tops.append(dumps(top) if as_text else top)
        offsets.append(text_offset)
        text_offset += len(piece)
    if as_text:
        return RawJSON(f'{{"tokens":{dumps(tokens)},"token_logprobs":{dumps(token_lps)},"top_logprobs":'
                       f'[{",".join(tops)}],"text_offset":{dumps(offsets)}}}'), text_offset
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, text_offset


def chat_logprobs(lps: list[TokenLogprobs], tt: TokenText, as_text: bool = False) -> dict | RawJSON:
    """OpenAI's chat format {content: [{token, logprob, bytes, top_logprobs: [...]}]}.

    `as_text`: the same as encoded JSON, each token's entry encoded as it is made: a large body
    then holds a few strings per token instead of ~2 + top-n dicts and lists that the garbage
    collector's full passes would scan (holding the GIL, stalling the event loop)."""
    if as_text:
        entries = ",".join(dumps(_chat_entry(lp, tt)) for lp in lps)
        return RawJSON(f'{{"content":[{entries}],"refusal":null}}')
    return {"content": [_chat_entry(lp, tt) for lp in lps], "refusal": None}


def _chat_entry(lp: TokenLogprobs, tt: TokenText) -> dict:
    return {"token": tt.piece(lp.token_id), "logprob": _lp(lp.logprob), "bytes": tt.bytes(lp.token_id),
            "top_logprobs": [{"token": tt.piece(t), "logprob": _lp(v), "bytes": tt.bytes(t)} for t, v in lp.top]}


def prompt_logprobs(plps: list[dict[int, float] | None] | None, tt: TokenText) -> list | None:
    """vLLM's prompt_logprobs: per prompt token, None (the first) or {id: {logprob, decoded_token}}."""
    if plps is None:
        return None
    return [None if d is None else {str(t): {"logprob": _lp(v), "decoded_token": tt.piece(t)}
                                    for t, v in d.items()} for d in plps]


# ---- bodies ------------------------------------------------------------------------------------
def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: int | str | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, text: str | None, logprobs: dict | None, finish_reason: str | None,
                stop_reason: int | str | None = None, reasoning: str | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text, "refusal": None, "tool_calls": tool_calls or []}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return {"index": index, "message": message,
            "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_delta_choice(index: int, text: str | None, first: bool, logprobs: dict | None,
                      finish_reason: str | None, stop_reason: int | str | None = None,
                      reasoning: str | None = None, tool_calls: list[dict] | None = None) -> dict:
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    if tool_calls:
        delta["tool_calls"] = tool_calls
    if text is not None:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def body(object_: str, request_id: str, created: int, model: str, choices: list[dict],
         usage_: dict | None = None) -> dict:
    d: dict[str, Any] = {"id": request_id, "object": object_, "created": created, "model": model,
                         "choices": choices}
    if usage_ is not None:
        d["usage"] = usage_
    return d
