"""The timed sections: decode / verify / prefill steps of the 27B-shaped model against their floors,
eagerly, through the kernel path and as CUDA-graph replays."""

from __future__ import annotations

import traceback

import numpy as np
import torch

from backboard.config import ModelConfig
from backboard.forward_context import set_forward_context
from backboard.ops import dispatch as D
from backboard.worker.input_batch import BatchRequest, prepare_batch
from backboard.worker.memory import allocate_caches
from benchmarks.gpucheck.budget import CLOCK
from benchmarks.gpucheck.kernel_path import KernelPath, layers_wired
from benchmarks.gpucheck.plan import GB, Plan, build_model, model_config
from benchmarks.gpucheck.report import print_row
from benchmarks.gpucheck.timing import graph_time_ms, time_ms


# ==== section: timings ==========================================================================
def param_bytes(model: torch.nn.Module) -> dict:
    emb = model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(total=total, embedding=emb.numel() * emb.element_size())


def decode_floor(cfg: ModelConfig, model, plan: Plan, B: int, L: int, ctx: int, bw: float) -> dict:
    pb = param_bytes(model)
    it = plan.dtype.itemsize
    rows = B * L
    weights = pb["total"] - pb["embedding"] + rows * cfg.hidden_size * it      # embedding rows only
    n_attn, n_gdn = len(cfg.attn_layer_ids), len(cfg.gdn_layer_ids)
    kv = n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * it * B * (ctx + L)
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * it
    state = n_gdn * (ssm + conv) * (B + B * L)       # B states read; B (decode) or B*L (verify) written
    total = weights + kv + state
    return dict(weights=weights, kv=kv, state=state, total=total, floor_ms=total / bw * 1e3)


def prefill_floor(cfg: ModelConfig, model, T: int, rate: float) -> dict:
    pb = param_bytes(model)
    lm = model.lm_head.weight.numel()
    mat_params = (pb["total"] - pb["embedding"]) / 2 - lm                      # bf16 -> elements
    n_attn, n_gdn = len(cfg.attn_layer_ids), len(cfg.gdn_layer_ids)
    linear = 2 * mat_params * T + 2 * lm                                        # LM head: 1 row
    attn = n_attn * 2 * T * T * cfg.num_attention_heads * cfg.head_dim           # causal QK^T + PV
    nv, dk, dv, Cc = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, 64
    gdn = n_gdn * T * 2 * nv * (2 * Cc * dk + Cc * dv + 3 * dk * dv)           # chunked form, approx.
    total = linear + attn + gdn
    return dict(linear_flops=linear, attn_flops=attn, gdn_flops=gdn, total=total,
                floor_ms=total / rate * 1e3)


class Bench:
    def __init__(self, plan: Plan, calib: dict, results: dict, save, skip_eager_8k: bool = False) -> None:
        self.plan, self.calib, self.results, self.save = plan, calib, results, save
        self.skip_eager_8k = skip_eager_8k
        cfg = model_config(plan.dims, max_len=max(plan.contexts.values()) + max(plan.prefill_lens) + 64)
        self.cfg = cfg
        self.model = build_model(cfg, plan)
        self.kpath = KernelPath(self.model)
        self.wired = layers_wired()
        bs = plan.block_size
        max_ctx = max(max(plan.contexts.values()) + plan.verify[1], max(plan.prefill_lens))
        self.blocks_per_req = -(-max_ctx // bs)
        max_reqs = max(max(plan.batch_sizes), plan.verify[0])
        self.slots_per_req = plan.verify[1]
        self.caches = allocate_caches(cfg, max_reqs * self.blocks_per_req + 1, bs,
                                      max_reqs * self.slots_per_req, plan.dtype, plan.device)
        self.rng = np.random.default_rng(0)

    def batch(self, B: int, L: int, ctx: int, verify: bool):
        reqs = []
        for i in range(B):
            blocks = list(range(i * self.blocks_per_req, (i + 1) * self.blocks_per_req))
            slot = i * self.slots_per_req
            dst = [slot + j for j in range(L)] if verify else None
            reqs.append(BatchRequest(self.rng.integers(0, self.cfg.vocab_size, L), ctx, blocks, slot, dst))
        pb = prepare_batch(reqs, self.plan.block_size, self.plan.device)
        rows = torch.arange(pb.meta.num_tokens, device=self.plan.device)
        if ctx == 0:                                        # prefill: only the last token of each
            rows = torch.as_tensor(pb.query_start_loc[1:] - 1, device=self.plan.device)
        return pb, rows

    def step_fn(self, path: str, pb, rows):
        model, kpath = self.model, self.kpath
        fwd = kpath if path == "kernels" else model
        mode = "torch" if path == "eager" else "triton"

        @torch.no_grad()
        def step():
            with set_forward_context(pb.meta, self.caches), D.override(mode):
                hidden = fwd(pb.input_ids, pb.meta.positions)
                return model.compute_logits(hidden[rows])
        return step

    def paths(self) -> list[str]:
        return ["eager", "kernels"] + (["wired"] if self.wired else [])

    def run_one(self, entry: dict, path: str, fn, floor_ms: float, section: str) -> None:
        if CLOCK.past(section):
            entry[f"{path}_ms"] = None
            entry.setdefault("skipped", []).append(path)
            return
        try:
            ms = time_ms(fn, self.plan.device, self.plan.warmup, self.plan.reps)
            entry[f"{path}_ms"] = ms
            entry[f"{path}_floor_frac"] = floor_ms / ms
        except torch.cuda.OutOfMemoryError as e:
            entry[f"{path}_ms"] = None
            entry[f"{path}_error"] = f"OOM: {str(e).splitlines()[0]}"
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - record and go on
            entry[f"{path}_ms"] = None
            entry[f"{path}_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            if self.plan.smoke:
                raise

    def decode(self) -> list[dict]:
        plan, cfg = self.plan, self.cfg
        bw = self.calib["copy_bandwidth_GBps"] * GB
        configs = [(B, 1, label, ctx, False) for label, ctx in plan.contexts.items() for B in plan.batch_sizes]
        configs += [(plan.verify[0], plan.verify[1], label, ctx, True) for label, ctx in plan.contexts.items()]
        out = self.results.setdefault("decode", [])
        for B, L, label, ctx, verify in configs:
            pb, rows = self.batch(B, L, ctx, verify)
            floor = decode_floor(cfg, self.model, plan, B, L, ctx, bw)
            e = dict(name=f"{'verify' if verify else 'decode'} B={B} L={L} ctx={label}", B=B, L=L,
                     context=ctx, rows=B * L, floor_bytes={k: v for k, v in floor.items() if k != "floor_ms"},
                     floor_ms=floor["floor_ms"])
            out.append(self.time_paths(e, pb, rows, "decode", skip_eager=ctx >= 8192 and self.skip_eager_8k))
        return out

    def time_paths(self, e: dict, pb, rows, section: str, skip_eager: bool = False) -> dict:
        """Time one step through every path next to its floor; save and print the row."""
        for path in self.paths():
            if not (path == "eager" and skip_eager):
                self.run_one(e, path, self.step_fn(path, pb, rows), e["floor_ms"], section)
        if e.get("eager_ms") and e.get("kernels_ms"):
            e["eager_over_kernels"] = e["eager_ms"] / e["kernels_ms"]
        self.save()
        print_row(e)
        return e

    def prefill(self) -> list[dict]:
        plan, cfg = self.plan, self.cfg
        rate = self.calib["matmul_TFLOPs"] * 1e12
        out = self.results.setdefault("prefill", [])
        for T in plan.prefill_lens:
            pb, rows = self.batch(1, T, 0, False)
            floor = prefill_floor(cfg, self.model, T, rate)
            e = dict(name=f"prefill T={T}", tokens=T, floor_flops={k: v for k, v in floor.items() if k != "floor_ms"},
                     floor_ms=floor["floor_ms"])
            out.append(self.time_paths(e, pb, rows, "prefill"))
        return out

    def graphs(self) -> list[dict]:
        """Decode steps replayed from CUDA graphs (kernels at every config, eager at short ones)."""
        plan = self.plan
        out = self.results.setdefault("graphs", [])
        for e in self.results.get("decode", []):
            B, L, ctx = e["B"], e["L"], e["context"]
            verify = e["name"].startswith("verify")
            g_e = dict(name=e["name"] + " [graph]", floor_ms=e["floor_ms"])
            for path in ("kernels", "eager"):
                if path == "eager" and ctx >= 8192:
                    continue
                if CLOCK.past("graphs"):
                    g_e.setdefault("skipped", []).append(path)
                    continue
                pb, rows = self.batch(B, L, ctx, verify)
                try:
                    ms = graph_time_ms(self.step_fn(path, pb, rows), plan.warmup, plan.reps * 4)
                    g_e[f"{path}_ms"] = ms
                    g_e[f"{path}_floor_frac"] = e["floor_ms"] / ms
                except Exception as ex:  # noqa: BLE001 - capture failures are reported, not fatal
                    g_e[f"{path}_error"] = f"{type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}"
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            out.append(g_e)
            self.save()
            print_row(g_e)
        return out
