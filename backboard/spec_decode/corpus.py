"""Training text for a draft head: the target's own answers to varied chat prompts, as token ids
with a mask of the answer tokens (the positions serving drafts; the chat template and the prompt
never are), written by the engine in large batches and cached on disk so that reruns reuse it.

    corpus = chat_corpus(model, asks=chat_asks(TRAIN_TOPICS), cache_dir=...)
    corpus.ids [N] int64, corpus.answer [N] bool (sequences concatenated, each ending in EOS)

Prompts are topics x task forms; topics are split so that no held-out topic (the benchmark's
HELD_OUT_TOPICS, and DEV_TOPICS for the offline statistics) is ever trained on."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

FORMS = ["Explain {} to a ten-year-old.", "Write a short paragraph about {}.", "List five facts about {}.",
         "What are the most common misconceptions about {}?", "Write a haiku about {}.",
         "Give me three questions a student might ask about {}, with answers.",
         "Summarize the history of {} in a few sentences.", "Why is {} important?",
         "Write a short story that involves {}.", "Compare {} with something similar and explain the differences.",
         "What should a beginner know about {}?", "Describe {} in simple terms, step by step.",
         # second set (2026-12-03): twice the text for the same topics, in other registers
         "Tell me something surprising about {}.", "Write a limerick about {}.",
         "What are the pros and cons of {}?", "Explain {} as if I were a university student.",
         "Write a short dialogue between two friends talking about {}.",
         "How has {} changed over the last hundred years?", "Give me a quiz with four questions about {}.",
         "What is the future of {}?", "Write an encyclopedia-style introduction to {}.",
         "Describe a day in the life of someone who works with {}.",
         "What are three key terms related to {}, and what do they mean?", "Write a tweet about {}."]
# the first 28 are benchmarks/spec_decode.py's training topics; its held-out topics come last
TRAIN_TOPICS = [
    "the ocean", "volcanoes", "the French Revolution", "photosynthesis", "black holes", "jazz",
    "the Roman Empire", "machine learning", "coffee", "the human heart", "bees", "chess",
    "the moon landing", "rainforests", "electricity", "the printing press", "glaciers",
    "vaccines", "the piano", "deserts", "earthquakes", "the internet", "dinosaurs", "tea",
    "the Great Wall of China", "bicycles", "honey", "lightning",
    "gravity", "the immune system", "ancient Egypt", "climate change", "the water cycle", "DNA",
    "the stock market", "recycling", "the solar system", "Shakespeare", "football", "mountains",
    "sleep", "the brain", "airplanes", "chocolate", "the Amazon river", "democracy", "robots",
    "the Industrial Revolution", "butterflies", "cheese", "the violin", "Mars", "nutrition",
    "trains", "the Vikings", "spiders", "hurricanes", "cryptography", "the Moon", "wolves",
    "the Eiffel Tower", "rice", "photography", "the Cold War", "coral reefs", "batteries",
    "yoga", "the Silk Road", "owls", "tornadoes", "mathematics", "poetry", "the Sahara",
    "antibiotics", "elephants", "the printing of money", "Greek mythology", "the periodic table",
    "computers", "languages", "friendship", "gardening", "bridges", "the Arctic", "sharks",
    "social media", "electric cars", "the camera", "forests", "ants", "music theory", "soap",
    "the calendar", "cooking pasta", "marathons", "the telephone", "volcanic islands", "clouds",
    "salt", "the alphabet", "castles", "kangaroos", "the heart of a star", "wind energy",
    # third set (2026-12-05): new topics, twice the text again (head v4 overfit its 473k answer tokens)
    "the Byzantine Empire", "origami", "submarines", "tigers", "jellyfish", "the saxophone", "glass",
    "the Aztecs", "fungi", "earthworms", "the Pacific Ocean", "skyscrapers", "paper", "the Mongol Empire",
    "frogs", "the guitar", "the Inca Empire", "hot air balloons", "plastic", "tides", "snow", "the Milky Way",
    "dreams", "the human skeleton", "bats", "comets", "the Himalayas", "the Great Barrier Reef", "cotton",
    "wine making", "tennis", "basketball", "the Titanic", "the steam engine", "vitamins", "the lungs",
    "the kidneys", "sound waves", "rainbows", "the ozone layer", "oil", "nuclear energy", "the Apollo program",
    "ancient Greece", "the samurai", "the Maya civilization", "pirates", "knights", "libraries", "museums",
    "board games", "video games", "architecture", "the Colosseum", "the Statue of Liberty", "Antarctica",
    "the Andes", "lakes", "caves", "fossils", "evolution", "genetics", "bacteria", "viruses", "the human eye",
    "memory", "emotions", "habits", "running", "cycling races", "opera", "ballet", "painting", "sculpture",
    "film", "radio", "television", "newspapers", "the postal service", "money", "banks", "inflation", "taxes",
    "maps", "compasses", "lighthouses", "ships", "highways", "cities", "farming", "potatoes", "tomatoes",
    "oranges", "bananas", "sugar", "spices", "sushi", "pizza", "horses", "dogs", "cats", "parrots",
    "crocodiles", "snakes", "turtles", "eagles", "the cheetah", "gorillas", "pandas", "zebras", "time zones",
    "clocks", "the speed of light", "rockets", "satellites", "the International Space Station", "Jupiter",
    "Saturn's rings", "eclipses", "meteor showers", "weather forecasting", "fog", "bamboo", "sunflowers",
    "oak trees", "mushrooms",
]
DEV_TOPICS = ["octopuses", "the pyramids", "magnets", "apples"]       # offline held-out statistics
HELD_OUT_TOPICS = ["the Olympic Games", "rivers", "penguins", "the telescope", "bread", "the Renaissance",
                   "solar power", "whales"]                        # the benchmark's held-out prompts
ASSISTANT_TAG = "<|im_start|>assistant\n"


def chat_asks(topics: list[str], forms: list[str] = FORMS) -> list[str]:
    """Every form of every topic, topic-major."""
    return [f.format(t) for t in topics for f in forms]


def chat_prompt_ids(tok, asks: list[str]) -> list[list[int]]:
    """User messages as chat-templated token ids (tok: a Hugging Face tokenizer)."""
    return [tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for a in asks]


@dataclass
class TokenCorpus:
    """Sequences concatenated: ids [N], answer [N] (True where the token is part of an answer,
    i.e. a token serving would draft), starts [S] (where each sequence begins)."""

    ids: np.ndarray
    answer: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, seqs: list[tuple[list[int], list[int]]]) -> "TokenCorpus":
        """(prompt ids, answer ids) pairs -> the corpus."""
        ids = [np.asarray(p + a, dtype=np.int64) for p, a in seqs]
        answer = [np.r_[np.zeros(len(p), bool), np.ones(len(a), bool)] for p, a in seqs]
        starts = np.cumsum([0] + [len(x) for x in ids[:-1]])
        return cls(np.concatenate(ids), np.concatenate(answer), starts.astype(np.int64))

    @classmethod
    def from_text(cls, ids: list[int]) -> "TokenCorpus":
        """Plain text: every token counts."""
        a = np.asarray(ids, dtype=np.int64)
        return cls(a, np.ones(len(a), bool), np.zeros(1, np.int64))

    def __len__(self) -> int:
        return len(self.ids)

    def answer_ids(self) -> np.ndarray:
        """The answer tokens [A] (the tokens drafts name)."""
        return self.ids[self.answer.astype(bool)]

    def save(self, path: str) -> None:
        np.savez(path, ids=self.ids, answer=self.answer, starts=self.starts)

    @classmethod
    def load(cls, path: str) -> "TokenCorpus":
        z = np.load(path)
        return cls(z["ids"], z["answer"], z["starts"])

    @classmethod
    def join(cls, parts: list["TokenCorpus"]) -> "TokenCorpus":
        offs = np.cumsum([0] + [len(p) for p in parts[:-1]])
        return cls(np.concatenate([p.ids for p in parts]), np.concatenate([p.answer for p in parts]),
                   np.concatenate([p.starts + o for p, o in zip(parts, offs)]))


def model_fingerprint(model: str, sample: int = 1 << 20) -> str:
    """What the model's answers depend on, not where it lies: its config.json and, for each
    weight file, its size and its first and last `sample` bytes (the header and weights: a
    fine-tune of the same shapes differs there). The same GGUF converted twice (the conversion's
    folder is named after the file's path and time) gives the same fingerprint."""
    h = hashlib.sha256()
    with open(os.path.join(model, "config.json"), "rb") as f:
        h.update(f.read())
    for name in sorted(n for n in os.listdir(model) if n.endswith((".safetensors", ".bin"))):
        path = os.path.join(model, name)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            h.update(f"{name}|{size}".encode() + f.read(sample))
            f.seek(max(0, size - sample))
            h.update(f.read(sample))
    return h.hexdigest()[:16]


def _shard_path(folder: str, fingerprint: str, asks: list[str], s0: int, **gen) -> str:
    """A shard's file, named by the model (model_fingerprint), its own prompts, their first index
    (the seeds and temperatures follow it) and the generation settings: a longer or shorter prompt
    list reuses every shard it shares with one written before."""
    blob = json.dumps([fingerprint, asks, s0, sorted(gen.items())])
    return os.path.join(folder, f"shard-{hashlib.sha256(blob.encode()).hexdigest()[:12]}.npz")


def chat_corpus(model: str, asks: list[str], cache_dir: str, *, max_tokens: int = 256, sample_every: int = 3,
                seed: int = 0, max_num_seqs: int = 128, shard: int = 256, log=print) -> TokenCorpus:
    """The target's answers to `asks` (chat template applied; greedy, and every sample_every-th at
    T = 0.7), written in shards of `shard` prompts under cache_dir (_shard_path) and read back from
    there when present (an interrupted run resumes at the first missing shard)."""
    from backboard.engine.llm import LLM
    from backboard.models.gguf import resolve_model_path
    from backboard.sampling_params import SamplingParams

    os.makedirs(cache_dir, exist_ok=True)
    parts, llm, fingerprint = [], None, model_fingerprint(resolve_model_path(model))
    for s0 in range(0, len(asks), shard):
        path = _shard_path(cache_dir, fingerprint, asks[s0:s0 + shard], s0, max_tokens=max_tokens,
                           sample_every=sample_every, seed=seed)
        if not os.path.isfile(path):
            if llm is None:
                llm = LLM(model, max_num_seqs=max_num_seqs, max_model_len=max_tokens + 256, seed=seed)
            prompts = chat_prompt_ids(llm.get_tokenizer().hf, asks[s0:s0 + shard])
            params = [SamplingParams(max_tokens=max_tokens, seed=seed + s0 + i,
                                     temperature=0.7 if (s0 + i) % sample_every == 0 else 0.0)
                      for i in range(len(prompts))]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            TokenCorpus.of([(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]).save(path)
            log(f"corpus shard {s0 // shard}: {len(prompts)} answers written to {path}")
        parts.append(TokenCorpus.load(path))
    return TokenCorpus.join(parts)


def chat_training_corpus(model: str, num: int | None = None, seed: int = 0,
                         cache_dir: str | None = None, log=print) -> tuple[TokenCorpus, TokenCorpus]:
    """`backboard draft train`'s default text: the target's answers to the first `num` (all by
    default) of TRAIN_TOPICS x FORMS in a fixed shuffled order, and the answers for DEV_TOPICS
    (held out, for the statistics). -> (train, held)."""
    from backboard.models.tiny import default_cache_dir

    folder = os.path.join(cache_dir or default_cache_dir(), "draft-corpus")
    asks = chat_asks(TRAIN_TOPICS)
    asks = [asks[i] for i in np.random.default_rng(0).permutation(len(asks))][:num]
    held = chat_corpus(model, chat_asks(DEV_TOPICS), folder, seed=seed, log=log)
    return chat_corpus(model, asks, folder, seed=seed, log=log), held
