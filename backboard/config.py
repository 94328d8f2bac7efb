"""Engine configuration: frozen dataclasses, and every validation of user settings.

Nothing here imports torch: `core/` reads these configs and must stay tensor-free. Dtypes are
carried as strings ("float32", "bfloat16", "float16") and resolved to torch dtypes in the worker.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

# model_type (top level of config.json) -> what it is
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "qwen3_5": "Qwen3.5 / Qwen3.6 hybrid, vision-language layout (text_config)",
    "qwen3_5_text": "Qwen3.5 / Qwen3.6 hybrid, text-only layout",
    "qwen3_next": "Qwen3-Next hybrid with mixture-of-experts MLPs",
    "qwen3": "Qwen3 dense transformer (plain attention, q/k norm)",
    "qwen2": "Qwen2 / Qwen2.5 dense transformer (q/k/v bias)",
    "llama": "Llama dense transformer (Llama 2/3, SmolLM2, ...)",
}
# the dense decoders, one config-driven class: q/k norm, biases and tied embeddings as the config says
DENSE_ARCHITECTURES = ("qwen3", "qwen2", "llama")

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "float32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "float16": "float16",
}


class ConfigError(ValueError):
    """A user setting or a checkpoint's config.json cannot be used; the message says what to fix."""


def normalize_dtype(dtype: str | None, checkpoint_dtype: str | None = None) -> str:
    """Resolve "auto" / aliases to one of DTYPES."""
    if dtype is None or str(dtype) == "auto":
        dtype = checkpoint_dtype or "float32"
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_ALIASES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return _DTYPE_ALIASES[name]


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a checkpoint (the text part of it)."""

    path: str
    model_type: str                      # top-level model_type of config.json
    text_model_type: str                 # model_type of the text part
    architectures: tuple[str, ...]
    dtype: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]         # "linear_attention" | "full_attention" per layer
    attn_output_gate: bool
    norm_zero_centered: bool             # Norm0: x_hat * (1 + w) (Qwen3.5 / Next) vs x_hat * w (Qwen3)
    tie_word_embeddings: bool
    # dense attention variants (the hybrids have q/k norm and no biases)
    qk_norm: bool = True                 # per-head RMSNorm of q and k (Qwen3, hybrids; not Llama / Qwen2)
    qkv_bias: bool = False               # q/k/v projections with bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False                 # o_proj with bias (Llama's attention_bias)
    # Gated DeltaNet
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    gdn_projection_layout: str = "split"  # "split" (Qwen3.5 in_proj_qkv/z/b/a) | "grouped" (Next qkvz/ba)
    # Mixture of experts (Qwen3-Next)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # MTP head
    mtp_num_hidden_layers: int = 0
    # generation
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0

    # ---- derived -------------------------------------------------------------------------
    @property
    def attn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def is_hybrid(self) -> bool:
        return bool(self.gdn_layer_ids)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the causal conv: [q | k | v]."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, dtype: str | None = "auto",
                        max_model_len: int | None = None) -> "ModelConfig":
        path = os.fspath(path)
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ConfigError(f"model path {path!r} is not a directory (expected a checkpoint folder "
                              "with config.json and *.safetensors)")
        if not os.path.isfile(cfg_file):
            raise ConfigError(f"{path!r} has no config.json: is it a Hugging Face checkpoint folder?")
        try:
            with open(cfg_file) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from e
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            supported = "\n".join(f"  {k}: {v}" for k, v in SUPPORTED_ARCHITECTURES.items())
            raise ConfigError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={raw.get('architectures')}) in {cfg_file}. Supported:\n{supported}")
        return cls.from_dict(raw, path=path, dtype=dtype, max_model_len=max_model_len)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: str = "", dtype: str | None = "auto",
                  max_model_len: int | None = None) -> "ModelConfig":
        from transformers import AutoConfig  # transformers normalises defaults and rope fields

        model_type = raw["model_type"]
        try:
            hf = AutoConfig.for_model(**raw)
        except Exception as e:  # noqa: BLE001 - any parse failure is a config problem
            raise ConfigError(f"config.json of {path or 'the checkpoint'} could not be parsed by "
                              f"transformers ({type(e).__name__}: {e})") from e
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        raw_text = raw.get("text_config", raw)

        def get(name: str, default: Any = None) -> Any:
            if name in raw_text:
                return raw_text[name]
            return getattr(text, name, default)

        rope = dict(getattr(text, "rope_parameters", None) or {})
        rope_theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0)))
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ("default", None):
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
        num_layers = int(get("num_hidden_layers"))
        layer_types = get("layer_types")
        hybrid = model_type not in DENSE_ARCHITECTURES
        if layer_types is None:
            if hybrid:
                interval = int(get("full_attention_interval", 4))
                layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                               for i in range(num_layers)]
            else:
                layer_types = ["full_attention"] * num_layers
        layer_types = tuple(str(t) for t in layer_types)[:num_layers]
        bad = sorted({t for t in layer_types} - {"linear_attention", "full_attention"})
        if bad:
            raise ConfigError(f"unsupported layer types {bad}; expected linear_attention / full_attention")
        if not hybrid and "linear_attention" in layer_types:
            raise ConfigError(f"{model_type} (dense) checkpoints cannot have linear_attention layers")
        head_dim = get("head_dim") or int(get("hidden_size")) // int(get("num_attention_heads"))
        eos = raw.get("eos_token_id", get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or get("dtype") or get("torch_dtype")
        max_pos = int(get("max_position_embeddings", 32768))
        if max_model_len is not None and max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive; got {max_model_len}")
        if max_model_len is not None and max_model_len > max_pos:
            raise ConfigError(f"max_model_len={max_model_len} exceeds the model's "
                              f"max_position_embeddings={max_pos}")
        kw: dict[str, Any] = dict(
            path=path,
            model_type=model_type,
            text_model_type=str(raw_text.get("model_type", model_type)),
            architectures=tuple(raw.get("architectures") or ()),
            dtype=normalize_dtype(dtype, str(ckpt_dtype) if ckpt_dtype else None),
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=int(get("num_key_value_heads") or get("num_attention_heads")),
            head_dim=int(head_dim),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            max_position_embeddings=max_pos,
            layer_types=layer_types,
            attn_output_gate=bool(get("attn_output_gate", hybrid)),
            norm_zero_centered=hybrid,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", get("tie_word_embeddings", False))),
            **_attention_variant(model_type, get),
            mtp_num_hidden_layers=int(get("mtp_num_hidden_layers", 0) or 0),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            max_model_len=int(max_model_len or max_pos),
        )
        if hybrid:
            kw.update(
                linear_num_key_heads=int(get("linear_num_key_heads")),
                linear_num_value_heads=int(get("linear_num_value_heads")),
                linear_key_head_dim=int(get("linear_key_head_dim")),
                linear_value_head_dim=int(get("linear_value_head_dim")),
                linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
                gdn_projection_layout="grouped" if model_type == "qwen3_next" else "split",
            )
            if kw["linear_num_value_heads"] % kw["linear_num_key_heads"]:
                raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if model_type == "qwen3_next":
            kw.update(
                num_experts=int(get("num_experts", 0)),
                num_experts_per_tok=int(get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(get("moe_intermediate_size", 0)),
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0)),
                norm_topk_prob=bool(get("norm_topk_prob", True)),
                decoder_sparse_step=int(get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(get("mlp_only_layers") or ()),
            )
        if kw["num_attention_heads"] % kw["num_key_value_heads"]:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        return cls(**kw)


def _attention_variant(model_type: str, get: Callable[..., Any]) -> dict[str, bool]:
    """q/k norm and biases of the attention layers, as each architecture's config means them."""
    if get("mlp_bias", False):
        raise ConfigError(f"{model_type}: mlp_bias=true is not supported (MLPs without bias only)")
    if model_type == "llama":
        bias = bool(get("attention_bias", False))
        return dict(qk_norm=False, qkv_bias=bias, o_bias=bias)
    if model_type == "qwen2":
        return dict(qk_norm=False, qkv_bias=True, o_bias=False)
    bias = bool(get("attention_bias", False))
    return dict(qk_norm=True, qkv_bias=bias, o_bias=bias)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache and recurrent-state slots."""

    block_size: int = 16
    num_kv_blocks: int | None = None        # None: sized from the memory budget
    num_state_slots: int | None = None      # None: max_num_seqs * (1 + num_speculative_tokens)
    kv_cache_memory_gib: float | None = None  # CPU budget for KV blocks (None: a default)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    checkpoint_interval: int = 1024         # hybrid: a GDN state checkpoint every this many prompt tokens (0: none)
    num_checkpoint_slots: int | None = None  # hybrid: state slots for checkpoints (None: max_num_seqs)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two; got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1; got {self.num_kv_blocks}")
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ConfigError(f"num_state_slots must be >= 1; got {self.num_state_slots}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory_gib must be > 0; got {self.kv_cache_memory_gib}")
        if self.checkpoint_interval < 0 or self.checkpoint_interval % self.block_size:
            raise ConfigError(f"prefix_cache_checkpoint_interval must be 0 or a multiple of block_size "
                              f"({self.block_size}); got {self.checkpoint_interval}")
        if self.num_checkpoint_slots is not None and self.num_checkpoint_slots < 0:
            raise ConfigError(f"prefix_cache_checkpoints must be >= 0; got {self.num_checkpoint_slots}")


FAIRNESS_MODES = ("request", "user", "off")     # core/fairness.py


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0   # >0: cap the tokens one prefill takes per step
    policy: str = "fcfs"                    # "fcfs" | "priority"
    fairness: str = "request"               # core/fairness.py: what shares are counted over
    max_prefill_share: float = 0.5          # of max_num_batched_tokens, per group per step, contended

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        if self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1; got {self.max_model_len}")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling policy must be 'fcfs' or 'priority'; got {self.policy!r}")
        if self.fairness not in FAIRNESS_MODES:
            raise ConfigError(f"fairness must be one of {', '.join(FAIRNESS_MODES)}; got {self.fairness!r}")
        if not 0.0 < self.max_prefill_share <= 1.0:
            raise ConfigError(f"max_prefill_share must be in (0, 1]; got {self.max_prefill_share}")


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (ranks of one engine, distributed/), data parallelism (engines behind
    one front end) and what places the processes (multiprocessing or Ray)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    data_parallel_rank: int = 0             # which engine this is (set per engine, not a setting)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}; "
                              f"got {self.distributed_executor_backend!r}")

    def check_model(self, mc: "ModelConfig") -> None:
        """Every split head count must divide by the TP size (KV heads may be fewer: replicated)."""
        tp = self.tensor_parallel_size
        counts = {"num_attention_heads": mc.num_attention_heads, "intermediate_size": mc.intermediate_size}
        if mc.is_hybrid:
            counts.update(linear_num_key_heads=mc.linear_num_key_heads,
                          linear_num_value_heads=mc.linear_num_value_heads)
        if mc.num_key_value_heads >= tp:
            counts["num_key_value_heads"] = mc.num_key_value_heads
        for name, n in counts.items():
            if n % tp:
                raise ConfigError(f"the model's {name} ({n}) is not divisible by tensor_parallel_size ({tp}); "
                                  f"choose a TP size that divides it")
        if mc.num_key_value_heads < tp and tp % mc.num_key_value_heads:
            raise ConfigError(f"tensor_parallel_size {tp} must be a multiple of num_key_value_heads "
                              f"{mc.num_key_value_heads} when the KV heads are fewer (they are replicated)")


SPEC_METHODS = ("mtp", "draft_head", "ngram")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: `{"method": ..., "num_speculative_tokens": k, ...}`."""

    method: str
    num_speculative_tokens: int = 3
    draft_model: str | None = None          # draft_head: folder of the trained 4-bit head
    adaptive: bool = True                   # choose k per step from batch size and acceptance
    ngram_min: int = 1
    ngram_max: int = 4
    int8_lm_head: bool = True               # draft_head: INT8 LM head for proposing

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(SPEC_METHODS)}; "
                              f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("num_speculative_tokens must be in [1, 16]; "
                              f"got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max; got {self.ngram_min}, {self.ngram_max}")

    @classmethod
    def parse(cls, value: "SpecConfig | dict | str | None") -> "SpecConfig | None":
        if value is None or isinstance(value, SpecConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ConfigError("speculative config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known - {"model"})
        if unknown:
            raise ConfigError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        value = dict(value)
        if "model" in value and "draft_model" not in value:
            value["draft_model"] = value.pop("model")
        if "method" not in value:
            raise ConfigError("speculative config needs a 'method' (one of mtp, draft_head, ngram)")
        return cls(**value)


def _setting(default: Any, help: str, *, choices: tuple[str, ...] | None = None, cli: bool = True):
    """A user setting: its default, and what the command line shows (cli=False: not a flag)."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


@dataclass(frozen=True)
class EngineArgs:
    """Every engine setting a user chooses, defined once: `EngineConfig.create(model, **kw)` and
    `LLM(model, **kw)` take them as keywords, `backboard serve` / `generate` as flags
    (`--max-num-seqs` for max_num_seqs; engine/cli.py builds the flags from these fields). Adding a
    setting is adding a field here (and reading it in EngineConfig.create)."""

    tokenizer: str | None = _setting(None, "tokenizer folder (default: the model's)")
    dtype: str = _setting("auto", "auto, float32, bfloat16, float16 (aliases: fp32, bf16, fp16, half)")
    max_model_len: int | None = _setting(None, "context length (default: the model's, at most 32768)")
    max_num_seqs: int = _setting(64, "requests in the running batch, at most")
    max_num_batched_tokens: int | None = _setting(
        None, "tokens computed per step, at most (default: max(2048, min(max_model_len, 8192)))")
    block_size: int = _setting(16, "tokens per KV cache block (a power of two)")
    num_kv_blocks: int | None = _setting(None, "KV cache blocks (default: sized from the memory budget)")
    kv_cache_memory_gib: float | None = _setting(None, "CPU: memory for the KV cache in GiB (default: 4)")
    gpu_memory_utilization: float = _setting(0.9, "CUDA: fraction of the GPU's memory the engine may use")
    seed: int = _setting(0, "the engine's random seed (requests without a seed of their own)")
    speculative_config: Any = _setting(None, 'JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'')
    device: str = _setting("auto", "auto, cpu, cuda, cuda:N")
    scheduling_policy: str = _setting("fcfs", "the waiting queue's order", choices=("fcfs", "priority"))
    long_prefill_token_threshold: int = _setting(0, "cap on the tokens one prefill takes per step (0: none)")
    fairness: str = _setting(
        "request", "fair shares of sequence slots and prefill budget, counted per request (its n completions "
                   "together) or per the requests' `user` field; off: plain FCFS / priority (core/fairness.py)",
        choices=FAIRNESS_MODES)
    max_prefill_share: float = _setting(
        0.5, "while others have prompt tokens to compute, one request's (group's) prefill takes at most this "
             "fraction of --max-num-batched-tokens per step")
    enforce_eager: bool = _setting(False, "no CUDA graphs")
    cpu_threads: int | None = _setting(
        None, "CPU: compute threads of the engine, per tensor-parallel rank (default: every core this process "
              "may run on divided by --tensor-parallel-size x --data-parallel-size, or $OMP_NUM_THREADS; the "
              "HTTP front end keeps one torch thread)")
    enable_prefix_caching: bool = _setting(
        True, "reuse the KV blocks and GDN states of prefixes seen before (--no-enable-prefix-caching: off)")
    prefix_cache_checkpoint_interval: int = _setting(
        1024, "hybrid models: checkpoint the GDN state every this many prompt tokens (0: only at prompt "
        "ends, finished requests and branch points; a multiple of --block-size)")
    prefix_cache_checkpoints: int | None = _setting(
        None, "hybrid models: state slots for prefix-cache checkpoints beside the running requests' "
        "(default: max_num_seqs)")
    tensor_parallel_size: int = _setting(
        1, "tensor parallelism: ranks (one process each) that split every layer's heads and channels")
    data_parallel_size: int = _setting(
        1, "data parallelism: engines behind the one HTTP front end, each request to the least loaded")
    distributed_executor_backend: str = _setting(
        "mp", "what starts the TP ranks and DP engines: multiprocessing on this machine, or a Ray cluster",
        choices=EXECUTOR_BACKENDS)
    served_model_name: str | None = _setting(None, "the model's name in responses", cli=False)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "EngineArgs":
        unknown = sorted(set(kwargs) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"unknown engine setting(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig | None = None
    device: str = "cpu"
    seed: int = 0
    served_model_name: str | None = None
    tokenizer: str | None = None            # defaults to the model folder
    enforce_eager: bool = False             # no CUDA graphs
    cpu_threads: int | None = None          # CPU: torch threads of the engine (None: every core)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def num_spec_tokens(self) -> int:
        return self.spec.num_speculative_tokens if self.spec else 0

    @classmethod
    def create(cls, model: str, **settings: Any) -> "EngineConfig":
        """The checkpoint at `model` with the user's settings (keywords: the fields of EngineArgs)."""
        a = EngineArgs.from_kwargs(settings)
        mc = ModelConfig.from_pretrained(model, dtype=a.dtype, max_model_len=a.max_model_len)
        if a.max_model_len is None:
            # a sensible default context on small machines; the model's own limit otherwise
            mc = replace(mc, max_model_len=min(mc.max_position_embeddings, 32768))
        max_num_batched_tokens = a.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, min(mc.max_model_len, 8192))
        spec = _check_spec(SpecConfig.parse(a.speculative_config), mc, model)
        if a.cpu_threads is not None and a.cpu_threads < 1:
            raise ConfigError(f"cpu_threads (--cpu-threads) must be >= 1; got {a.cpu_threads}")
        parallel = ParallelConfig(a.tensor_parallel_size, a.data_parallel_size, a.distributed_executor_backend)
        parallel.check_model(mc)
        return cls(
            model=mc,
            cache=CacheConfig(block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
                              kv_cache_memory_gib=a.kv_cache_memory_gib,
                              gpu_memory_utilization=a.gpu_memory_utilization,
                              enable_prefix_caching=a.enable_prefix_caching,
                              checkpoint_interval=a.prefix_cache_checkpoint_interval,
                              num_checkpoint_slots=a.prefix_cache_checkpoints),
            scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=mc.max_model_len, policy=a.scheduling_policy,
                                      long_prefill_token_threshold=a.long_prefill_token_threshold,
                                      fairness=a.fairness, max_prefill_share=a.max_prefill_share),
            spec=spec,
            device=resolve_device(a.device),
            seed=a.seed,
            served_model_name=a.served_model_name,
            tokenizer=a.tokenizer,
            enforce_eager=a.enforce_eager,
            cpu_threads=a.cpu_threads,
            parallel=parallel,
        )


def _check_spec(spec: SpecConfig | None, mc: ModelConfig, model: str) -> SpecConfig | None:
    """What a speculative method needs from the checkpoint and the settings."""
    if spec is not None and spec.method == "mtp" and mc.mtp_num_hidden_layers < 1:
        raise ConfigError(f"method 'mtp' needs a checkpoint with an MTP head "
                          f"(mtp_num_hidden_layers >= 1); {model} has none")
    if spec is not None and spec.method == "draft_head" and not spec.draft_model:
        raise ConfigError("method 'draft_head' needs 'draft_model': the folder written by "
                          "`backboard draft train` or `backboard draft quantize`")
    return spec


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        try:
            import torch  # local: config.py itself stays importable without torch
            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:  # pragma: no cover
            return "cpu"
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise ConfigError(f"device must be auto, cpu or cuda[:N]; got {device!r}")
    return str(device)
