"""The tokenizer of a checkpoint folder (tokenizer.json + tokenizer_config.json + chat
template), loaded offline through transformers."""

from __future__ import annotations

import json
import os
from typing import Any


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(
                os.path.join(path, "tokenizer_config.json")):
            raise TokenizerError(f"no tokenizer in {path} (expected tokenizer.json and "
                                 "tokenizer_config.json); pass --tokenizer PATH")
        try:
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise TokenizerError(f"cannot load the tokenizer in {path}: {type(e).__name__}: {e}") from e
        self.path = path
        self.backend = getattr(self.hf, "backend_tokenizer", None)   # tokenizers.Tokenizer
        self.eos_token_ids = self._eos_ids(path)

    def _eos_ids(self, path: str) -> tuple[int, ...]:
        ids: list[int] = []
        if self.hf.eos_token_id is not None:
            ids.append(int(self.hf.eos_token_id))
        gen = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as f:
                e = json.load(f).get("eos_token_id")
            ids += [int(x) for x in (e if isinstance(e, list) else [e]) if x is not None]
        return tuple(dict.fromkeys(ids))

    # ---------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Base vocabulary (what InferenceX's prompt generator samples from)."""
        return int(self.hf.vocab_size)

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The text of one token as OpenAI-style logprobs show it."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if not self.has_chat_template:
            raise TokenizerError("this model's tokenizer has no chat template; use completions")
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
