"""One source for the engine settings: the flags of `backboard serve` and `generate`, the keywords
of EngineConfig.create and LLM are EngineArgs' fields, with its defaults, types and choices."""

from __future__ import annotations

import dataclasses

import pytest

from backboard.cli import build_parser
from backboard.config import ConfigError, EngineArgs, EngineConfig
from backboard.engine.cli import engine_flags, engine_kwargs

COMMANDS = {"serve": ["serve", "m"], "generate": ["generate", "m", "--prompt", "x"]}


def _engine_group(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    group = next(g for g in sub._action_groups if g.title == "engine")
    return {s for a in group._group_actions for s in a.option_strings}


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_are_the_fields(command):
    want = {"--" + f.name.replace("_", "-") for f in engine_flags()}
    want |= {"--no-" + f.name.replace("_", "-") for f in engine_flags() if f.default is True}   # on by default
    assert _engine_group(command) == want
    cli = {f.name for f in dataclasses.fields(EngineArgs) if f.metadata["cli"]}
    assert cli == {f.name for f in engine_flags()} and "served_model_name" not in cli
    defaults = engine_kwargs(build_parser().parse_args(COMMANDS[command]))
    assert defaults == {f.name: f.default for f in engine_flags()}


def test_flags_parse_to_typed_keywords():
    args = build_parser().parse_args(
        COMMANDS["serve"] + ["--max-num-seqs", "3", "--kv-cache-memory-gib", "1.5", "--enforce-eager",
                             "--scheduling-policy", "priority", "--speculative-config", '{"method": "ngram"}',
                             "--max-model-len", "128"])
    kw = engine_kwargs(args)
    assert kw["max_num_seqs"] == 3 and kw["kv_cache_memory_gib"] == 1.5 and kw["enforce_eager"] is True
    assert kw["scheduling_policy"] == "priority" and kw["speculative_config"] == '{"method": "ngram"}'
    assert kw["max_model_len"] == 128 and kw["dtype"] == "auto"
    assert kw["enable_prefix_caching"] is True
    assert engine_kwargs(build_parser().parse_args(COMMANDS["serve"] + ["--no-enable-prefix-caching"])
                         )["enable_prefix_caching"] is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(COMMANDS["serve"] + ["--scheduling-policy", "lifo"])


def test_keywords_reach_the_config(hybrid_model):
    cfg = EngineConfig.create(hybrid_model, **{**engine_kwargs(build_parser().parse_args(COMMANDS["serve"])),
                                               "max_num_seqs": 5, "block_size": 32, "device": "cpu",
                                               "served_model_name": "tiny"})
    assert cfg.scheduler.max_num_seqs == 5 and cfg.cache.block_size == 32 and cfg.served_model_name == "tiny"
    with pytest.raises(ConfigError, match=r"unknown engine setting\(s\) \['max_num_seq'\]"):
        EngineConfig.create(hybrid_model, max_num_seq=5)
    from backboard import LLM

    with pytest.raises(ConfigError, match="unknown engine setting"):
        LLM(hybrid_model, max_batch=4)
