"""`backboard generate MODEL --prompt ...`: generate in-process, streaming to the terminal."""

from __future__ import annotations

import argparse
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine settings shared by `generate` and `serve` (the keywords of EngineConfig.create)."""
    e = p.add_argument_group("engine")
    e.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    e.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--kv-cache-memory-gib", type=float, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'')
    e.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    e.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    e.add_argument("--long-prefill-token-threshold", type=int, default=0)
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gib=args.kv_cache_memory_gib,
                gpu_memory_utilization=args.gpu_memory_utilization,
                speculative_config=args.speculative_config, device=args.device, seed=args.seed,
                tokenizer=args.tokenizer, scheduling_policy=args.scheduling_policy,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                enforce_eager=args.enforce_eager)


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
