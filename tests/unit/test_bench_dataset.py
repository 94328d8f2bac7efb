"""InferenceX's random prompts: reproducible, lengths as drawn, each prompt exactly its length."""

from __future__ import annotations

import numpy as np
import pytest

from backboard.bench.dataset import _fit_to_length, sample_random_requests


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from backboard.bench.dataset import load_tokenizer
    from backboard.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("bench-tok")), arch="qwen3_5_text",
                                 preset="tiny")
    return load_tokenizer(path)


def test_reproducible_and_seed_dependent(tokenizer):
    a = sample_random_requests(tokenizer, 64, 32, 8, 0.8, seed=0)
    b = sample_random_requests(tokenizer, 64, 32, 8, 0.8, seed=0)
    c = sample_random_requests(tokenizer, 64, 32, 8, 0.8, seed=1)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]


@pytest.mark.parametrize("input_len, ratio", [(64, 0.8), (200, 0.5), (17, 1.0)])
def test_lengths_follow_numpy_legacy_draws(tokenizer, input_len, ratio):
    n, output_len = 40, 40
    reqs = sample_random_requests(tokenizer, input_len, output_len, n, ratio, seed=0)
    np.random.seed(0)
    want_in = np.random.randint(int(input_len * ratio), input_len + 1, size=n)
    want_out = np.random.randint(int(output_len * ratio), output_len + 1, size=n)
    assert [r.output_len for r in reqs] == want_out.tolist()
    # as in InferenceX, 10 fitting rounds do not always converge (a U+FFFD cut in two re-decodes
    # to U+FFFD); the prompt then keeps its own, re-encoded, length, a token or two off
    got = np.array([r.prompt_len for r in reqs])
    assert np.mean(got == want_in) >= 0.7
    assert np.all(np.abs(got - want_in) <= 3)


def test_each_prompt_re_encodes_to_its_length(tokenizer):
    reqs = sample_random_requests(tokenizer, 256, 16, 20, 0.8, seed=0)
    for r in reqs:
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len


def test_ids_come_from_offsets_and_base_vocabulary(tokenizer):
    vocab = tokenizer.vocab_size
    assert vocab < len(tokenizer)  # the special tokens lie above the base vocabulary
    n = 5
    np.random.seed(0)
    lens = np.random.randint(int(48 * 0.8), 49, size=n)
    np.random.randint(int(8 * 0.8), 9, size=n)
    offsets = np.random.randint(0, vocab, size=n)
    reqs = sample_random_requests(tokenizer, 48, 8, n, 0.8, seed=0)
    for i, r in enumerate(reqs):
        ids = [int((offsets[i] + i + j) % vocab) for j in range(lens[i])]
        # the fitted prompt starts like the decoded id sequence
        first = tokenizer.decode(ids)
        head = tokenizer.decode(ids[: lens[i] // 2])
        assert r.prompt[:10] == first[:10] == head[:10]


class _SplittingTokenizer:
    """One token per character (a=0 ... z=25), except that id 25 decodes to two characters "xy",
    so a decoded id sequence can re-encode to more tokens than it had."""

    vocab_size = 26

    def decode(self, ids):
        return "".join("xy" if i == 25 else chr(ord("a") + i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) - ord("a") for ch in text]


def test_fit_truncates_and_pads():
    tok = _SplittingTokenizer()
    np.random.seed(0)
    prompt, n = _fit_to_length(tok, tok.decode([25, 1]), 2, tok.vocab_size)  # "xyb": 3 tokens
    assert (prompt, n) == ("xy", 2)
    prompt, n = _fit_to_length(tok, "b", 4, tok.vocab_size)  # too short: padded with random ids
    assert n == 4 and len(tok.encode(prompt)) == 4 and prompt.startswith("b")
    prompt, n = _fit_to_length(tok, "abc", 3, tok.vocab_size)  # already right: unchanged
    assert (prompt, n) == ("abc", 3)


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="range ratio"):
        sample_random_requests(tokenizer, 8, 8, 2, 1.5)
    with pytest.raises(ValueError, match=">= 1"):
        sample_random_requests(tokenizer, 0, 8, 2)
