"""`backboard draft train | quantize | vocab`."""

from __future__ import annotations

import argparse
import sys

VOCAB_HELP = ("the tokens the INT8 LM head drafts over: auto (the fewest of the training answers' most frequent "
              "tokens that cover 99.9%% of them, a multiple of 1024), full (the whole vocabulary) or N (the N "
              "most frequent). Drafts stay checked over the whole vocabulary: lossless either way")


def _draft_vocab(spec: str) -> "str | int":
    from backboard.spec_decode.draft_vocab import parse_draft_vocab

    try:
        return parse_draft_vocab(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("draft", help="train or quantize a 4-bit draft head for speculative decoding")
    dsub = p.add_subparsers(dest="draft_command", metavar="SUBCOMMAND")
    t = dsub.add_parser("train", help="distil a draft head from the target on plain text, then quantize it")
    t.add_argument("--model", required=True, help="target checkpoint folder")
    t.add_argument("--data", required=False, help="plain-text file to train on (instead of the chat corpus)")
    t.add_argument("--out", required=True, help="folder for the draft head")
    t.add_argument("--self-generate", type=int, default=0, metavar="N",
                   help="also train on N continuations the target writes itself")
    t.add_argument("--self-generate-tokens", type=int, default=128)
    t.add_argument("--chat-prompts", type=int, default=None, metavar="N",
                   help="the default recipe (no --data / --self-generate): the target's answers to the first N "
                        "of the built-in chat prompts (topics x task forms; all by default), written once in "
                        "large batches and cached under ~/.cache/backboard/draft-corpus; loss on answer tokens")
    t.add_argument("--minutes", type=float, default=30.0, help="training time budget")
    t.add_argument("--steps", type=int, default=None, help="train exactly this many steps instead")
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--group-size", type=int, default=64, help="int4 group size (a multiple of 32)")
    t.add_argument("--chain-frac", type=float, default=0.5,
                   help="share of positions trained as chained drafts (the head's own output as hidden)")
    t.add_argument("--feat-weight", type=float, default=0.1,
                   help="weight of EAGLE's feature regression beside the token loss")
    t.add_argument("--loss-vocab-top", type=int, default=8, metavar="K",
                   help="normalise the loss over the text's tokens and the teacher's top K only (faster)")
    t.add_argument("--qat-frac", type=float, default=0.2,
                   help="share of the budget, at its end, trained through the int4 values (quantization-aware)")
    t.add_argument("--teacher-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the target's pass that writes the distillation targets (bfloat16: the "
                        "serving numerics, several times faster on CPUs with native bf16)")
    t.add_argument("--init", default="mtp", metavar="mtp|random|DIR",
                   help="start from the checkpoint's MTP head when it has one (mtp), from random weights, "
                        "or from a draft head folder saved for this model (training goes on from it)")
    t.add_argument("--draft-vocab", default="auto", metavar="auto|full|N", type=_draft_vocab, help=VOCAB_HELP)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=run_train)
    q = dsub.add_parser("quantize", help="the checkpoint's own MTP head as a 4-bit draft head")
    q.add_argument("--model", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--group-size", type=int, default=64)
    q.set_defaults(func=run_quantize)
    v = dsub.add_parser("vocab", help="give a saved draft head's INT8 LM head a draft vocabulary (the chat "
                                      "corpus's most frequent answer tokens)")
    v.add_argument("--model", required=True, help="the target checkpoint the head was trained for")
    v.add_argument("--head", required=True, help="the draft head folder (rewritten in place)")
    v.add_argument("--draft-vocab", default="auto", metavar="auto|full|N", type=_draft_vocab, help=VOCAB_HELP)
    v.add_argument("--chat-prompts", type=int, default=None, metavar="N",
                   help="count the answers to the first N built-in chat prompts (as `draft train` does)")
    v.set_defaults(func=run_vocab)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def run_train(args: argparse.Namespace) -> int:
    from backboard.spec_decode.corpus import chat_training_corpus
    from backboard.spec_decode.train import self_generated_text, train_draft_head

    text = ""
    if args.data:
        try:
            with open(args.data, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            print(f"error: cannot read --data: {e}", file=sys.stderr)
            return 2
    if args.self_generate:
        text += "\n" + self_generated_text(args.model, args.self_generate, args.self_generate_tokens, args.seed)
    try:
        data, held = (text, None) if text else chat_training_corpus(args.model, args.chat_prompts, args.seed)
        train_draft_head(args.model, data, args.out, held_text=held, minutes=args.minutes, steps=args.steps,
                         seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                         group_size=args.group_size, init=args.init, seed=args.seed, chain_frac=args.chain_frac,
                         loss_vocab_top=args.loss_vocab_top, feat_weight=args.feat_weight,
                         teacher_dtype=args.teacher_dtype, qat_frac=args.qat_frac, draft_vocab=args.draft_vocab)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run_quantize(args: argparse.Namespace) -> int:
    from backboard.spec_decode.train import quantize_mtp_head

    try:
        info = quantize_mtp_head(args.model, args.out, args.group_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the int4 MTP head to {args.out} ({info})")
    return 0


def run_vocab(args: argparse.Namespace) -> int:
    from backboard.config import ConfigError, ModelConfig
    from backboard.spec_decode.corpus import chat_training_corpus
    from backboard.spec_decode.draft_head import read_draft_config
    from backboard.spec_decode.train import set_vocab_from_corpus

    try:      # a wrong folder stops here, before the corpus (written once: most of an hour)
        read_draft_config(args.head, ModelConfig.from_pretrained(args.model, dtype="float32"))
        train, held = chat_training_corpus(args.model, args.chat_prompts)
        stats = set_vocab_from_corpus(args.model, args.head, train, held, args.draft_vocab)
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.head}: INT8 LM head over {stats['draft_vocab_size'] or 'the whole vocabulary'} tokens ({stats})")
    return 0
