"""`backboard tiny-model ARCH OUT_DIR`: write a small deterministic checkpoint."""

from __future__ import annotations

import argparse

from backboard.models.tiny import ARCHS, PRESETS, build_tiny_checkpoint


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tiny-model", help="write a small random-weight checkpoint for tests and demos")
    p.add_argument("arch", choices=ARCHS)
    p.add_argument("out_dir")
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--no-mtp", action="store_true", help="leave out the MTP head weights")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = build_tiny_checkpoint(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed,
                                 dtype=args.dtype, mtp=not args.no_mtp)
    print(f"wrote {args.arch} ({args.preset}) checkpoint to {path}")
    return 0
