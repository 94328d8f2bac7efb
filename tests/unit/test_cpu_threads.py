"""--cpu-threads: a field of EngineArgs (so both commands take it and a bad value stops start-up);
the engine computes on every core it may run on unless told otherwise; the front end keeps one
torch thread."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from backboard.cli import build_parser
from backboard.config import ConfigError, EngineConfig
from backboard.engine import cpu_threads
from backboard.engine.cli import engine_kwargs


@pytest.mark.parametrize("argv", [["serve", "m"], ["generate", "m", "--prompt", "x"]])
def test_both_commands_take_cpu_threads(argv):
    assert engine_kwargs(build_parser().parse_args(argv + ["--cpu-threads", "3"]))["cpu_threads"] == 3
    assert engine_kwargs(build_parser().parse_args(argv))["cpu_threads"] is None


def test_a_bad_thread_count_stops_start_up(hybrid_model):
    with pytest.raises(ConfigError, match="cpu-threads"):
        EngineConfig.create(hybrid_model, cpu_threads=0)
    assert EngineConfig.create(hybrid_model, cpu_threads=2).cpu_threads == 2


def test_the_engine_uses_every_core_it_may_run_on(hybrid_model, monkeypatch):
    cfg = EngineConfig.create(hybrid_model, device="cpu")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 5})
    assert cpu_threads.engine_threads(cfg) == 4                 # all of them: none left idle
    assert cpu_threads.engine_threads(replace(cfg, cpu_threads=1)) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.engine_threads(cfg) is None              # the user's choice stands
    assert cpu_threads.engine_threads(replace(cfg, cpu_threads=2)) == 2
    assert cpu_threads.engine_threads(replace(cfg, device="cuda")) is None


def test_the_front_end_keeps_one_torch_thread():
    code = ("import torch; torch.set_num_threads(2);"
            "from backboard.engine.cpu_threads import set_frontend_threads; set_frontend_threads();"
            "print(torch.get_num_threads())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
