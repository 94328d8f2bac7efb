"""Printing gpu_check's rows and checks."""

from __future__ import annotations

import platform

import torch

from benchmarks.gpucheck.plan import Plan


# ==== reporting =================================================================================
def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def print_row(e: dict) -> None:
    parts = [f"{e['name']:<34}", f"floor {fmt(e.get('floor_ms'), '8.3f')} ms"]
    for path in ("eager", "kernels", "wired"):
        if f"{path}_ms" in e or f"{path}_error" in e:
            ms = e.get(f"{path}_ms")
            frac = e.get(f"{path}_floor_frac")
            err = e.get(f"{path}_error")
            parts.append(f"{path} {fmt(ms, '9.3f')} ms ({fmt(frac and 100 * frac, '5.1f')}% of floor)"
                         + (f" [{err[:40]}]" if err else ""))
    if e.get("eager_over_kernels"):
        parts.append(f"eager/kernels {e['eager_over_kernels']:.2f}x")
    print("  ".join(parts), flush=True)


def print_check(ck: dict) -> None:
    if ck.get("skipped"):
        print(f"  [---] {ck['name']:<44} skipped ({ck['skipped']})", flush=True)
        return
    head = f"  [{'ok ' if ck['ok'] else 'BAD'}] {ck['name']:<44} {ck.get('what', ''):<10}"
    if ck["name"].startswith("engine") and "tok_per_s" in ck:
        print(f"{head} {'identical' if ck['ok'] else 'DIFFERENT'} tokens, {ck['tok_per_s']:.1f} tok/s, "
              f"graphs={ck['graphs']}" + (f" ERROR {ck['error']}" if ck.get("error") else ""), flush=True)
        return
    if "error" in ck:
        print(f"{head} ERROR {ck['error'][:200]}", flush=True)
        return
    line = f"{head} rel {ck['rel_l2']:.1e} (tol {ck['tol']:.0e}) max_abs {ck['max_abs']:.1e}"
    if "kernel_ms" in ck:
        line += (f"  kernel {ck['kernel_ms'] * 1e3:8.1f} us ({ck['kernel_GBps']:6.0f} GB/s, "
                 f"{100 * ck['bw_frac']:4.1f}% of copy bw)  torch/kernel {ck['torch_over_kernel']:.1f}x")
    print(line, flush=True)


def gpu_name(plan: Plan) -> str:
    if plan.device.type == "cuda":
        return torch.cuda.get_device_name(plan.device)
    return f"cpu-{platform.machine()}"
