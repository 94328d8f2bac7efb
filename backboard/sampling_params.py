"""User-facing sampling parameters (vLLM's names), validated with messages that name the
parameter and the allowed range."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backboard.constants import GREEDY_TEMPERATURE

GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's names; exactly one of the kinds): a JSON schema (as
    compact JSON text), any JSON object, a regex, one of several strings, a grammar (EBNF, or Lark),
    or an xgrammar structural tag (JSON text; what tool calls are constrained with).

    think_token_ids (<think>, </think>), set by the server's reasoning parser, holds the grammar
    off during the reasoning block: it applies from the token after </think>. think_open: the
    prompt opened the block (the output starts inside it); otherwise a <think> as the first token
    opens one."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    think_token_ids: tuple[int, int] | None = None
    think_open: bool = False

    def __post_init__(self) -> None:
        set_ = [k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(GRAMMAR_KINDS)}; "
                             f"got {', '.join(set_) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar depends on (the compile cache's key)."""
        v = getattr(self, self.kind)
        return self.kind, ("\x00".join(v) if isinstance(v, list) else "" if v is True else v)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16         # None: up to the context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None         # top-n logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (plus the prompt token)
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    # ---------------------------------------------------------------------------------------
    def validate(self) -> None:
        def bad(name: str, rng: str) -> ValueError:
            return ValueError(f"{name} must be {rng}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not _is_num(self.temperature) or self.temperature < 0 or self.temperature > 100:
            raise bad("temperature", "in [0, 100]")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0 / -1 to disable")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not _is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]")
        if not _is_num(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not _is_num(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad("seed", "an integer in [0, 2**63)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 (or None)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                             f"and max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer in [0, 20]")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes: Any) -> "SamplingParams":
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(changes)
        return SamplingParams(**d)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
