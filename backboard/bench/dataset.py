"""InferenceX's `random` dataset: prompts of random token ids, the same for the same seed,
tokenizer, lengths and count."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_FIT_ROUNDS = 10


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, counted by the client's tokenizer
    output_len: int  # max_tokens sent (all generated with ignore_eos)


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def sample_lengths(length: int, range_ratio: float, n: int) -> np.ndarray:
    """[n] lengths uniform in [int(length * r), length], from numpy's global legacy generator
    (the reference client's rule, for its input and output lengths alike)."""
    return np.random.randint(int(length * range_ratio), length + 1, size=n)


def sample_random_requests(tokenizer, input_len: int, output_len: int, num_prompts: int,
                           range_ratio: float = 0.8, seed: int = 0) -> list[BenchRequest]:
    """Lengths uniform in [int(L * r), L]; request i is the ids (offset_i + i + j) % vocab, decoded,
    then re-encoded (without special tokens), padded with random ids or truncated and decoded again,
    up to 10 rounds, until the text re-encodes to exactly its drawn length.

    Uses numpy's global legacy generator (`numpy.random.seed`), as the reference client does; the
    vocabulary is the tokenizer's base vocabulary (`tokenizer.vocab_size`, no added tokens)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    if input_len < 1 or output_len < 1 or num_prompts < 1:
        raise ValueError("input length, output length and number of prompts must be >= 1")
    np.random.seed(seed)
    vocab = tokenizer.vocab_size
    input_lens = sample_lengths(input_len, range_ratio, num_prompts)
    output_lens = sample_lengths(output_len, range_ratio, num_prompts)
    offsets = np.random.randint(0, vocab, size=num_prompts)
    requests = []
    for i in range(num_prompts):
        target = max(int(input_lens[i]), 1)
        ids = [int((offsets[i] + i + j) % vocab) for j in range(target)]
        prompt, n = _fit_to_length(tokenizer, tokenizer.decode(ids), target, vocab)
        requests.append(BenchRequest(prompt, n, max(int(output_lens[i]), 1)))
    return requests


def _fit_to_length(tokenizer, prompt: str, target: int, vocab: int) -> tuple[str, int]:
    """Re-encode / pad-or-truncate / decode until `prompt` re-encodes to `target` tokens.

    Returns the prompt and its token count (== target unless 10 rounds did not converge)."""
    for _ in range(MAX_FIT_ROUNDS):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if len(ids) == target:
            return prompt, target
        if len(ids) < target:
            ids = ids + np.random.randint(0, vocab, size=target - len(ids)).tolist()
        else:
            ids = ids[:target]
        prompt = tokenizer.decode(ids)
    return prompt, len(tokenizer.encode(prompt, add_special_tokens=False))
