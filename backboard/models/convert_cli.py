"""`backboard convert MODEL.gguf OUT_DIR`: a GGUF file as a Hugging Face folder."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="write a GGUF file as a Hugging Face folder (safetensors, config, "
                                       "tokenizer) that Backboard, transformers and vLLM load")
    p.add_argument("gguf", help="the .gguf file (llama, qwen2, qwen3; F32/F16/BF16/Q4_0/Q4_1/Q8_0/K-quants)")
    p.add_argument("out_dir")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from backboard.config import ConfigError
    from backboard.models.gguf import convert_gguf

    try:
        out = convert_gguf(args.gguf, args.out_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
