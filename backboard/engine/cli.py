"""`backboard generate MODEL --prompt ...`: generate in-process, streaming to the terminal."""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import Field, fields
from typing import Any

from backboard.config import EngineArgs


def engine_flags() -> list[Field]:
    """The EngineArgs fields that are command-line flags."""
    return [f for f in fields(EngineArgs) if f.metadata.get("cli", True)]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags shared by `generate` and `serve`: one per EngineArgs field."""
    group = p.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for f in engine_flags():
        flag, help_ = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if hints[f.name] is bool:     # on by default: --flag / --no-flag
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument(flag, action=action, default=f.default, help=help_)
        else:
            group.add_argument(flag, type=_scalar(hints[f.name]), default=f.default,
                               choices=f.metadata["choices"], help=help_)


def _scalar(hint) -> type:
    """The argparse type of a field: `int | None` -> int; anything else (JSON, Any) -> str."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0] if args[0] in (int, float, str) else str


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Parsed flags -> the keywords of EngineConfig.create / LLM."""
    return {f.name: getattr(args, f.name) for f in engine_flags()}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text in-process, streaming to the terminal")
    p.add_argument("model", help="checkpoint folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from backboard.config import ConfigError
    from backboard.engine.llm import LLM
    from backboard.models.loader import CheckpointError
    from backboard.sampling_params import SamplingParams

    try:
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, ignore_eos=args.ignore_eos,
                            stop=args.stop, seed=args.seed)
        llm = LLM(args.model, **engine_kwargs(args))
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt}])
    llm.add_request(prompt, sp)
    final = None
    while llm.has_unfinished_requests():
        for o in llm.step():
            sys.stdout.write(o.outputs[0].delta_text)
            sys.stdout.flush()
            final = o
    c = final.outputs[0]
    sys.stdout.write("\n")
    print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]", file=sys.stderr)
    return 0
