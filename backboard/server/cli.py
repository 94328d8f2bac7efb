"""`backboard serve [MODEL]`: the OpenAI-compatible server.

MODEL is a checkpoint folder or a Hugging Face hub id (`org/name`, downloaded where the hub is
reachable); with none, the embedded demo model is served (built on first use into the cache)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from backboard.engine.cli import add_engine_args, engine_kwargs

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder or hub id (default: the embedded demo model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: MODEL as given)")
    g.add_argument("--api-key", default=os.environ.get("BACKBOARD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $BACKBOARD_API_KEY)")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed chunk (the last group and the finish always go out)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g.add_argument("--drain-timeout", type=float, default=600.0,
                   help="on SIGTERM, wait at most this many seconds for running requests")
    g.add_argument("--engine-address", default=None,
                   help="where the front end binds its sockets to the engine process: ipc://DIR, or "
                        "tcp://HOST:PORT (PORT and PORT+1; 0: any free ports) (default: ipc in a temp dir)")
    g.add_argument("--disable-frontend", action="store_true",
                   help="no page at / (chat playground, dashboard, scorecards) and no /api/ routes")
    g.add_argument("--scorecard-dir", default=None,
                   help="results folders the page's scorecard viewer lists (default: "
                        "benchmarks/results of a source checkout)")
    add_engine_args(p)
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="CPU device: torch threads in the engine process (default: all cores but one, "
                        "leaving one to the HTTP front end; or $OMP_NUM_THREADS)")
    p.set_defaults(func=run)


class StartupError(Exception):
    """Start-up stops with this one-line message (no traceback)."""


def resolve_model(model: str | None) -> tuple[str, str]:
    """MODEL -> (local folder, a line saying where it came from)."""
    if model is None:
        from backboard.models.tiny import ensure_demo_model

        path, built = ensure_demo_model()
        return path, f"no MODEL given: serving the embedded demo model at {path} ({'built now' if built else 'cached'})"
    if os.path.exists(model) or not _HUB_ID.match(model):
        return model, f"serving {model}"
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id=model, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                                "*.jinja", "*.model", "*.tiktoken"])
    except Exception as e:  # noqa: BLE001 - any hub failure ends start-up with one line
        raise StartupError(f"could not download model {model!r} from the Hugging Face hub "
                           f"({type(e).__name__}); pass a local checkpoint folder instead") from e
    return path, f"serving {model} (hub snapshot at {path})"


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("backboard.server")
    from backboard.config import ConfigError, EngineConfig
    from backboard.engine.tokenizer import Tokenizer, TokenizerError
    from backboard.engine.transport import EngineAddresses

    try:
        if args.stream_interval < 1:
            raise StartupError(f"--stream-interval must be >= 1; got {args.stream_interval}")
        if args.cpu_threads is not None and args.cpu_threads < 1:
            raise StartupError(f"--cpu-threads must be >= 1; got {args.cpu_threads}")
        if not 0 < args.port < 65536:
            raise StartupError(f"--port must be in 1..65535; got {args.port}")
        if args.engine_address is not None:
            EngineAddresses.parse(args.engine_address)     # a bad address stops start-up here
        path, where = resolve_model(args.model)
        log.info(where)
        cfg = EngineConfig.create(path, served_model_name=(args.served_model_name or [None])[0],
                                  **engine_kwargs(args))
        tokenizer = Tokenizer(args.tokenizer or path)
    except (StartupError, ConfigError, TokenizerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1

    from backboard.server.launcher import ServeOptions, serve

    names = tuple(args.served_model_name or [args.model or "backboard-demo"])
    opts = ServeOptions(host=args.host, port=args.port, served_names=names, api_key=args.api_key,
                        stream_interval=args.stream_interval, log_level=args.log_level,
                        access_log=args.access_log, drain_timeout_s=args.drain_timeout,
                        cpu_threads=args.cpu_threads, engine_address=args.engine_address,
                        disable_frontend=args.disable_frontend, scorecard_dir=args.scorecard_dir)
    return serve(cfg, tokenizer, opts)
