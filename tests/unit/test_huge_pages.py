"""Large CPU tensors sit on transparent huge pages once backboard is imported (backboard/__init__.py
sets THP_MEM_ALLOC_ENABLE before torch's first allocation): a decode step streams every weight,
and on 4 KiB pages each 4 KiB costs a TLB miss."""

import os
import subprocess
import sys

import pytest

PROBE = """
import backboard, torch
t = torch.empty(64 << 20, dtype=torch.uint8)
t.fill_(1)                                   # touch every page
start = t.data_ptr()
with open("/proc/self/smaps") as f:
    lines = f.read().splitlines()
for i, ln in enumerate(lines):
    lo, hi = (int(a, 16) for a in ln.split()[0].split("-")) if "-" in ln.split()[0] else (0, 0)
    if lo <= start < hi:
        kb = next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("AnonHugePages:"))
        print(kb)
        break
"""


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def probe(env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return int(out[-1])


def test_importing_backboard_asks_for_huge_pages():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", "import os, backboard; print(os.environ['THP_MEM_ALLOC_ENABLE'])"],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "1"


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps (not Linux)")
def test_a_large_tensor_lies_on_huge_pages_unless_turned_off():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    huge = probe(env)
    if thp_mode() in ("always", "madvise"):
        assert huge >= 32 << 10, f"a touched 64 MiB tensor has only {huge} kB on huge pages"
    off = probe(dict(env, THP_MEM_ALLOC_ENABLE="0"))
    if thp_mode() == "madvise":          # "always" gives huge pages to everyone
        assert off == 0
