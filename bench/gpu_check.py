"""The NCCL check on a machine with one GPU, in one bounded run: ``bench/gpu_check.sh OUTDIR`` calls this.

Parts, in order; each has its own time limit, and one that fails or cannot run says why in the
summary while the check goes on to the next:

0. a GPU at all: ``nvidia-smi`` first (instant), then ``torch.cuda.is_available()``; without
   either it says so in one line, writes the summary and exits 0;
1. versions: torch, CUDA, the NCCL torch loads, the GPU and its memory, the NCCL wheels installed;
2. can 2, then 4, NCCL ranks share the one GPU (``bench/nccl_probe.py``, no DeadPool, with
   ``NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_NVLS_ENABLE=0 NCCL_MAX_CTAS=2``)?  NCCL before 2.30
   refuses it, so where torch's is older this first looks for a newer ``libnccl.so.2`` (an
   installed ``nvidia-nccl-cu13``/``-cu12`` wheel, a wheel file given with ``--nccl-wheel``,
   else ``pip install`` where an index is reachable) and preloads it (``LD_PRELOAD``) here
   and in every later part;
3. DeadPool on NCCL, end to end: each command failure-free, then with a chaos spec, the final
   state digests compared (bit-identical required; deterministic kernels);
4. overhead on NCCL: plain DDP against DeadPool, plain FSDP2 against DeadPool FSDP2, where
   ``bench/overhead.py`` can run them on NCCL;
5. recovery on NCCL, from part 3's events files: recovery, group abort and group rebuild times.

Outputs: ``OUTDIR/gpu_check.log`` (what ran, how it ended, the tail of what failed),
``OUTDIR/gpu_check.json`` (one entry per part: ``status`` ok / failed / skipped, ``reason``,
its figures; the versions and the machine), rewritten after every part, and ``OUTDIR/runs/``
(each subprocess's output, each DeadPool run's events).  Every subprocess runs in its own
session with a timeout; afterwards its process group, and any process still carrying the run's
marker in its environment, is killed.  A newer NCCL fetched by pip goes to a temporary
directory, never into OUTDIR.

    python bench/gpu_check.py OUTDIR [--budget 515] [--nproc 2] [--nccl-wheel FILE.whl]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "bench" / "nccl_probe.py"
OVERHEAD = ROOT / "bench" / "overhead.py"
LAUNCH = (sys.executable, "-m", "deadpool", "launch")
MIN_NCCL = (2, 30)  # the first NCCL that lets two ranks share a GPU (NCCL_MULTI_RANK_GPU_ENABLE, experimental)
SHARE_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_MAX_CTAS": "2"}
NCCL_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
NCCL_DIR = Path(tempfile.gettempdir()) / "deadpool-gpu-check-nccl"  # a fetched NCCL: reused by a second run
MARKER = "DEADPOOL_GPU_CHECK_RUN"  # in every child's environment: what to reap after it
DIGEST = re.compile(r"^final state digest: ([0-9a-f]+)\s*$", re.MULTILINE)  # the launcher's line, not a rank's

# Time limits (seconds).  The whole check stays under --budget (the .sh bounds it again from outside).
SMI_S = 8.0
INFO_S = 60.0  # import torch, make a CUDA context
LIB_VERSION_S = 20.0
PIP_S = 60.0  # one try, for the wheel of torch's CUDA (a machine without an index fails at once or at this)
PROBE_S = 75.0  # the probe's collectives time out after 60 s
HELP_S = 30.0
GPT_RUN_S = 90.0  # about 20-30 s expected: 3 processes start, import torch, make CUDA contexts; 20 short steps
LLAMA_RUN_S = 100.0
MIN_RUN_S = 45.0  # a DeadPool run given less than this is skipped, not started
OVERHEAD_S = 150.0
RESERVE_S = 10.0  # for part 5 and the last write

GPT = ("demos/train_gpt.py", "--device", "cuda", "--steps", "20")
LLAMA = ("demos/train_llama.py", "--fsdp", "--device", "cuda", "--size", "tiny", "--steps", "12")
E2E = (  # (name, script and its arguments, chaos spec or None, time limit), the failure-free run first
    ("gpt", GPT, None, GPT_RUN_S),
    ("gpt-kill-boundary", GPT, "kill:rank=1:step=8", GPT_RUN_S),
    ("gpt-kill-allreduce", GPT, "kill:rank=1:step=8:at=allreduce", GPT_RUN_S),
    ("gpt-stop", GPT, "stop:rank=1:step=8", GPT_RUN_S),
    ("llama-fsdp", LLAMA, None, LLAMA_RUN_S),
    ("llama-fsdp-kill-reducescatter", LLAMA, "kill:rank=1:step=6:at=reducescatter", LLAMA_RUN_S),
)


class Terminated(Exception):
    """SIGTERM or SIGINT (the .sh's outer time limit, or a person): stop, clean up, write what is known."""


class Report:
    """The log and the JSON summary, both written as the check goes, so a kill leaves them readable."""

    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir
        self.runs = outdir / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.log_path = outdir / "gpu_check.log"
        self.json_path = outdir / "gpu_check.json"
        self.log_path.write_text("")
        self.began = time.monotonic()
        self.data: dict[str, Any] = {
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "outcome": "running", "elapsed_s": 0.0, "machine": machine(), "versions": {}, "parts": [],
        }

    def say(self, line: str) -> None:
        print(line, flush=True)
        with self.log_path.open("a") as log:
            log.write(line + "\n")

    def attach(self, title: str, text: str, lines: int = 40) -> None:
        """The tail of a subprocess's output, into the log only."""
        tail = text.rstrip().splitlines()[-lines:]
        with self.log_path.open("a") as log:
            log.write(f"  ---- {title}: last {len(tail)} lines ----\n")
            log.writelines(f"  | {line}\n" for line in tail)

    def part(self, number: int, name: str, echo: bool = True) -> dict[str, Any]:
        entry: dict[str, Any] = {"part": number, "name": name, "status": "running", "reason": ""}
        self.data["parts"].append(entry)
        if echo:
            self.say(f"== part {number}: {name}")
        else:
            with self.log_path.open("a") as log:
                log.write(f"== part {number}: {name}\n")
        return entry

    def close(self, entry: dict[str, Any]) -> None:
        """A part's verdict, into the log, and the summary rewritten."""
        self.say(f"-- part {entry['part']}: {entry['status']}" + (f": {entry['reason']}" if entry["reason"] else ""))
        self.write()

    def write(self, outcome: str | None = None) -> None:
        if outcome is not None:
            self.data["outcome"] = outcome
        self.data["elapsed_s"] = round(time.monotonic() - self.began, 1)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.json_path)


class Clock:
    """The check's deadline: each subprocess gets its own limit, cut to what is left."""

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def bound(self, want_s: float, reserve_s: float = RESERVE_S) -> float:
        return max(0.0, min(want_s, self.left() - reserve_s))


@dataclass
class Ran:
    """How one subprocess ended."""

    rc: int | None  # None: it was killed at its time limit
    output: str
    wall_s: float
    log: Path

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def how(self) -> str:
        return f"timed out after {self.wall_s:.0f}s" if self.rc is None else f"exit status {self.rc}"


def machine() -> dict[str, Any]:
    memory_gib = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "memory_gib": memory_gib,
            "platform": platform.platform(), "python": platform.python_version(), "gpus": []}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def _reap(marker: str) -> None:
    """SIGKILL every process still carrying `marker` in its environment (a worker that left its group)."""
    needle = f"{MARKER}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def _stop(procs: list[subprocess.Popen[bytes]], marker: str) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except OSError:
                pass
    grace = time.monotonic() + 5.0
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, grace - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group's other members too, if any are left
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    _reap(marker)


def run_all(commands: list[tuple[list[str], dict[str, str], Path]], timeout_s: float) -> list[Ran]:
    """Start every command at once (each in its own session, output to its log), wait up to `timeout_s` for all."""
    marker = uuid.uuid4().hex
    procs: list[subprocess.Popen[bytes]] = []
    began = time.monotonic()
    try:
        for argv, env, log in commands:
            with log.open("wb") as out:
                procs.append(subprocess.Popen(argv, cwd=ROOT, env={**env, MARKER: marker}, stdout=out,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        ended: dict[int, float] = {}
        while len(ended) < len(procs) and time.monotonic() - began < timeout_s:
            for i, proc in enumerate(procs):
                if i not in ended and proc.poll() is not None:
                    ended[i] = time.monotonic() - began
            time.sleep(0.1)
    finally:
        _stop(procs, marker)
    wall = time.monotonic() - began
    results = []
    for i, (proc, (_, _, log)) in enumerate(zip(procs, commands, strict=False)):
        rc = proc.returncode if i in ended else None
        output = log.read_text(errors="replace") if log.exists() else ""
        results.append(Ran(rc, output, round(ended.get(i, wall), 2), log))
    return results


def run(argv: list[str], env: dict[str, str], log: Path, timeout_s: float) -> Ran:
    return run_all([(argv, env, log)], timeout_s)[0]


def why(output: str) -> str:
    """The line of a failed run's output most likely to say why: an NCCL warning or the exception, else the last."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for pattern in (r"NCCL WARN", r"(Error|Exception|error:)", r"(?i)fail"):
        found = [line for line in lines if re.search(pattern, line)]
        if found:
            return found[-1][:400]
    return lines[-1][:400] if lines else "no output"


def shown(argv: list[str], env: dict[str, str] | None = None) -> str:
    """The command as a person would type it, with the environment it was given beyond ours."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())]
    args = ["python" if a == sys.executable else os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a
            for a in argv]
    return " ".join([*prefix, shlex.join(args)])


def parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


# Part 0 and 1 --------------------------------------------------------------------------------------------------


def find_gpu(report: Report, clock: Clock) -> tuple[str, dict[str, Any]]:
    """("", torch's view) where a GPU is usable, else (why not, what is known)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no nvidia-smi on PATH", {}
    query = [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    ran = run(query, child_env(), report.runs / "p0-nvidia-smi.log", clock.bound(SMI_S, 0))
    rows = [line.split(", ") for line in ran.output.strip().splitlines() if line.count(", ") >= 2]
    if not ran.ok or not rows:
        return f"nvidia-smi found no GPU ({ran.how()}: {why(ran.output)})", {}
    report.data["machine"]["gpus"] = [{"name": r[0], "memory": r[1], "driver": r[2]} for r in rows]
    report.data["versions"]["driver"] = rows[0][2]
    ran = run([sys.executable, str(PROBE), "--info"], child_env(), report.runs / "p0-torch-info.log",
              clock.bound(INFO_S, 0))
    info = _info_line(ran.output)
    if info is None:
        report.attach("torch info", ran.output)
        return f"torch could not be asked about CUDA ({ran.how()}: {why(ran.output)})", {}
    if not info["cuda_available"]:
        built = f"torch {info['torch']}" + (f", CUDA {info['cuda']}" if info["cuda"] else ", built without CUDA")
        return f"torch.cuda.is_available() is false ({built})", info
    return "", info


def _info_line(output: str) -> dict[str, Any] | None:
    for line in output.splitlines():
        if line.startswith("INFO "):
            return dict(json.loads(line[5:]))
    return None


def nccl_wheels() -> dict[str, dict[str, str]]:
    """The nvidia-nccl-cu13 / -cu12 distributions installed here: version and where their libnccl.so.2 is."""
    found = {}
    for name in NCCL_WHEELS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        lib = next((str(dist.locate_file(f)) for f in dist.files or [] if f.name == "libnccl.so.2"), "")
        found[name] = {"version": dist.version, "lib": lib}
    return found


def part_versions(report: Report, info: dict[str, Any]) -> dict[str, Any]:
    entry = report.part(1, "versions")
    wheels = nccl_wheels()
    versions = report.data["versions"]
    versions.update({"torch": info["torch"], "cuda": info["cuda"], "nccl_torch": info["nccl"],
                     "nccl_wheels": {k: v["version"] for k, v in wheels.items()}})
    entry.update(status="ok", gpu=info.get("gpu", ""), gpu_memory_gib=info.get("gpu_memory_gib"),
                 device_count=info.get("device_count"), capability=info.get("capability"),
                 nccl_available=info.get("nccl_available"), nccl_wheels=wheels)
    report.say(f"torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl'] or '?'} (the one torch loads); "
               f"{info.get('device_count')} GPU(s): {info.get('gpu')}, {info.get('gpu_memory_gib')} GiB; "
               f"driver {versions.get('driver', '?')}; NCCL wheels installed: "
               + (", ".join(f"{k} {v['version']}" for k, v in wheels.items()) or "none"))
    return entry


# Part 2 --------------------------------------------------------------------------------------------------------


def lib_version(report: Report, clock: Clock, lib: str) -> tuple[int, ...]:
    """The version a libnccl.so.2 says it is (ncclGetVersion), () when it cannot be loaded."""
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); v = ctypes.c_int(); "
            "lib.ncclGetVersion(ctypes.byref(v)); print('NCCLCODE', v.value)")
    log = report.runs / f"p2-lib-version-{abs(hash(lib)) % 10**6}.log"
    ran = run([sys.executable, "-c", code, lib], child_env(), log, clock.bound(LIB_VERSION_S))
    found = re.search(r"NCCLCODE (\d+)", ran.output)
    if not found:
        return ()
    value = int(found.group(1))  # 2.30.4 is 23004 (NCCL >= 2.9: major*10000 + minor*100 + patch)
    return (value // 10000, value % 10000 // 100, value % 100) if value >= 10000 else \
        (value // 1000, value % 1000 // 100, value % 100)


def choose_nccl(report: Report, clock: Clock, info: dict[str, Any], wheel: str) -> dict[str, Any]:
    """Which libnccl.so.2 the probe and the later parts use: torch's own where it is new enough, else a newer
    one from a wheel (installed, given, or fetched with pip), preloaded.  Says what it tried."""
    torch_version = parse_version(info["nccl"])
    chosen: dict[str, Any] = {"version": info["nccl"], "source": "torch's own", "preload": "", "tried": []}
    if torch_version >= MIN_NCCL:
        return chosen
    tried: list[str] = chosen["tried"]
    tried.append(f"torch loads NCCL {info['nccl'] or '?'} (< {dotted(MIN_NCCL)})")
    major = info["cuda"].split(".")[0]
    pip_name = next((n for n in NCCL_WHEELS if n.endswith(f"-cu{major}")), NCCL_WHEELS[-1])  # for torch's CUDA

    def take(lib: str, source: str) -> bool:
        version = lib_version(report, clock, lib)
        tried.append(f"{source}: {lib} is NCCL {dotted(version) if version else '? (would not load)'}")
        if version >= MIN_NCCL:
            chosen.update(version=dotted(version), source=source, preload=lib)
            return True
        return False

    for name, found in nccl_wheels().items():
        if found["lib"] and take(found["lib"], f"installed wheel {name} {found['version']}"):
            return chosen
    fetched = NCCL_DIR / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    if fetched.exists() and take(str(fetched), f"fetched earlier into {NCCL_DIR}"):
        return chosen
    wheels = [Path(wheel)] if wheel else sorted((ROOT / "shared").glob("**/nvidia_nccl_cu1[23]-*.whl"))
    for path in wheels:
        try:
            with zipfile.ZipFile(path) as archive:
                member = next(m for m in archive.namelist() if m.endswith("nvidia/nccl/lib/libnccl.so.2"))
                archive.extract(member, NCCL_DIR / path.stem)
            if take(str(NCCL_DIR / path.stem / member), f"wheel file {path.name}"):
                return chosen
        except (OSError, StopIteration, zipfile.BadZipFile) as err:
            tried.append(f"wheel file {path}: {type(err).__name__} {err}")
    limit = clock.bound(PIP_S)
    if limit < 15:
        tried.append(f"pip install {pip_name}: no time left")
    else:
        shutil.rmtree(NCCL_DIR / "nvidia", ignore_errors=True)
        argv = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--no-input",
                "--timeout", "10", "--retries", "0", "--upgrade", "--target", str(NCCL_DIR),
                f"{pip_name}>={dotted(MIN_NCCL)}"]
        ran = run(argv, child_env(), report.runs / f"p2-pip-{pip_name}.log", limit)
        report.say(f"  {shown(argv)}: {ran.how()}")
        if not ran.ok:
            tried.append(f"pip install {pip_name}: {ran.how()}: {why(ran.output)}")
        elif fetched.exists() and take(str(fetched), f"pip install {pip_name}"):
            return chosen
    chosen["reason"] = f"no NCCL >= {dotted(MIN_NCCL)} found; the probe runs on torch's own {info['nccl']}"
    return chosen


def probe(report: Report, clock: Clock, n: int, env: dict[str, str]) -> dict[str, Any]:
    """N processes of nccl_probe.py on GPU 0: ok, the ranks' figures, or why not."""
    limit = clock.bound(PROBE_S)
    if limit < 20:
        return {"ok": False, "reason": f"skipped: {clock.left():.0f}s left"}
    port = _free_port()
    commands = []
    for rank in range(n):
        extra = {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}
        commands.append(([sys.executable, str(PROBE), "--timeout", "60"], {**env, **extra},
                         report.runs / f"p2-probe{n}-rank{rank}.log"))
    report.say(f"  {n} ranks, each: {shown(commands[0][0], _shown_env(env))} (RANK, WORLD_SIZE={n}, MASTER_* set)")
    results = run_all(commands, limit)
    ranks = []
    for ran in results:
        line = next((x for x in ran.output.splitlines() if x.startswith("PROBE ")), "")
        if line:
            ranks.append(json.loads(line[6:]))
    record: dict[str, Any] = {"ok": len(ranks) == n and all(r.ok for r in results), "ranks": ranks,
                              "wall_s": max(r.wall_s for r in results)}
    if record["ok"]:
        record["init_s_max"] = max(r["init_s"] for r in ranks)
        record["allreduce_s_max"] = max(r["allreduce_s"] for r in ranks)
        record["nccl"] = ranks[0]["nccl"]
        report.say(f"  {n} ranks share the GPU: NCCL {record['nccl']}, init {record['init_s_max']:.2f}s, "
                   f"all_reduce (4 MiB) {record['allreduce_s_max'] * 1e3:.1f} ms")
    else:
        failed = next(r for r in results if not r.ok) if not all(r.ok for r in results) else results[0]
        record["reason"] = f"rank {results.index(failed)}: {failed.how()}: {why(failed.output)}"
        report.say(f"  {n} ranks cannot share the GPU: {record['reason']}")
        for rank, ran in enumerate(results):
            report.attach(f"probe {n} rank {rank} ({ran.how()})", ran.output, lines=15)
    return record


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _shown_env(env: dict[str, str]) -> dict[str, str]:
    keys = (*SHARE_ENV, "LD_PRELOAD", "CUBLAS_WORKSPACE_CONFIG", "NCCL_DEBUG")
    return {k: env[k] for k in keys if k in env}


def part_share(report: Report, clock: Clock, info: dict[str, Any],
               wheel: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Part 2; returns its entry and the environment every later part runs under."""
    entry = report.part(2, "NCCL ranks sharing one GPU")
    nccl = choose_nccl(report, clock, info, wheel)
    env = child_env({**SHARE_ENV, "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")})
    if nccl["preload"]:
        env["LD_PRELOAD"] = " ".join(p for p in (nccl["preload"], os.environ.get("LD_PRELOAD", "")) if p)
        ran = run([sys.executable, str(PROBE), "--info"], env, report.runs / "p2-torch-info-preloaded.log",
                  clock.bound(INFO_S))
        seen = _info_line(ran.output)
        nccl["torch_sees"] = seen["nccl"] if seen else f"? ({ran.how()}: {why(ran.output)})"
    for line in nccl["tried"]:
        report.say(f"  {line}")
    preloaded = f", LD_PRELOAD={nccl['preload']}, torch then reports {nccl.get('torch_sees')}" \
        if nccl["preload"] else ""
    report.say(f"  NCCL used: {nccl['version']} ({nccl['source']}){preloaded}")
    report.data["versions"].update(nccl_used=nccl.get("torch_sees", nccl["version"]), nccl_source=nccl["source"],
                                   nccl_preload=nccl["preload"])
    probes: dict[str, Any] = {}
    probes["2"] = probe(report, clock, 2, env)
    probes["4"] = probe(report, clock, 4, env) if probes["2"]["ok"] else \
        {"ok": False, "reason": "skipped: 2 ranks could not share the GPU"}
    shared = [n for n in (2, 4) if probes[str(n)]["ok"]]
    entry.update(nccl=nccl, probes=probes, max_ranks=max(shared, default=1))
    if shared:
        entry.update(status="ok", reason=f"{max(shared)} NCCL ranks can share the GPU")
    else:
        entry.update(status="failed", reason=f"2 ranks cannot share the GPU: {probes['2'].get('reason', '')}"
                     + (f"; {nccl['reason']}" if nccl.get("reason") else ""))
    return entry, env


# Part 3 --------------------------------------------------------------------------------------------------------


def _accepts(argv: list[str], option: str, report: Report, clock: Clock, name: str) -> tuple[bool, str]:
    """Whether a command's --help lists `option` (and, when it cannot tell, why)."""
    ran = run([*argv, "--help"], child_env(), report.runs / f"{name}-help.log", clock.bound(HELP_S))
    if not ran.ok:
        return False, f"`{shown(argv)} --help` failed ({ran.how()}: {why(ran.output)})"
    return re.search(rf"(^|\s){re.escape(option)}\b", ran.output) is not None, ""


def _read_events(path: Path) -> list[dict[str, Any]]:
    records = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line
            if isinstance(record, dict):
                records.append(record)
    return records


def part_e2e(report: Report, clock: Clock, share: dict[str, Any], env: dict[str, str], nproc: int) -> dict[str, Any]:
    entry = report.part(3, "DeadPool on NCCL, end to end (digests)")
    if share["status"] != "ok":
        entry.update(status="skipped", reason="no two NCCL ranks can share this GPU (part 2)")
        return entry
    launch = list(LAUNCH)
    accepts, unknown = _accepts(launch, "--backend", report, clock, "p3-launch")
    if not accepts:
        entry.update(status="skipped", reason=unknown or "`deadpool launch` has no --backend option yet")
        return entry
    if share["probes"].get(str(nproc), {}).get("ok") is not True:
        report.say(f"  --nproc {nproc} ranks did not pass the probe; using 2")
        nproc = 2
    env = {**env, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    entry["nproc"] = nproc
    entry["spares"] = 1
    runs: list[dict[str, Any]] = []
    baselines: dict[tuple[str, ...], dict[str, Any]] = {}
    for name, script, spec, want_s in E2E:
        events = report.runs / f"p3-{name}.events.jsonl"
        argv = [*launch, "--backend", "nccl", "--nproc", str(nproc), "--spares", "1", "--no-progress",
                "--events", str(events)]
        argv += ["--chaos", spec] if spec else []
        argv += list(script)
        record: dict[str, Any] = {"name": name, "spec": spec or "", "command": shown(argv, _shown_env(env))}
        runs.append(record)
        baseline = baselines.get(script)
        limit = clock.bound(want_s)
        if spec and (baseline is None or not baseline.get("digest")):
            record.update(status="skipped", reason="its failure-free run gave no digest")
        elif limit < MIN_RUN_S:
            record.update(status="skipped", reason=f"time: {clock.left():.0f}s left of the check's budget")
        else:
            ran = run(argv, env, report.runs / f"p3-{name}.log", limit)
            _judge(record, ran, events, baseline, report)
        if not spec:
            baselines[script] = record
        report.say(f"  {name}: {record['status']}" + (f" ({record['reason']})" if record.get("reason") else "")
                   + f"  [{record['command']}]")
        report.write()
    entry["runs"] = runs
    failed = [r["name"] for r in runs if r["status"] == "failed"]
    skipped = [r["name"] for r in runs if r["status"] == "skipped"]
    if not failed and not skipped:
        entry.update(status="ok", reason=f"{sum(1 for r in runs if r['spec'])} chaos runs bit-identical to their "
                                         "failure-free runs")
    else:  # a run not made is no pass either
        entry.update(status="failed", reason="; ".join(f"{what}: {', '.join(names)}" for what, names
                                                       in (("failed", failed), ("not run", skipped)) if names))
    return entry


def _judge(record: dict[str, Any], ran: Ran, events_path: Path, baseline: dict[str, Any] | None,
           report: Report) -> None:
    """A run's verdict: it exited 0 and printed a digest; a chaos run's digest is its failure-free run's."""
    digests = DIGEST.findall(ran.output)
    events = _read_events(events_path)
    record.update(rc=ran.rc, wall_s=ran.wall_s, digest=digests[-1] if digests else "",
                  log=os.path.relpath(ran.log, report.outdir), events=os.path.relpath(events_path, report.outdir),
                  chaos_fired=sum(1 for r in events if r.get("event") == "chaos_injected"),
                  swaps=sum(1 for r in events if r.get("event") == "swap_completed"))
    if baseline is not None:
        record["baseline_digest"] = baseline.get("digest", "")
        record["identical"] = bool(record["digest"]) and record["digest"] == record["baseline_digest"]
    if not ran.ok or not record["digest"]:
        record.update(status="failed", reason=f"{ran.how()}: {why(ran.output)}" if not ran.ok else "no digest printed")
        report.attach(f"{record['name']} ({ran.how()})", ran.output)
    elif baseline is not None and not record["identical"]:
        record.update(status="failed", reason=f"digest {record['digest'][:16]}... differs from the failure-free "
                                              f"{record['baseline_digest'][:16]}...")
    elif baseline is not None and not record["swaps"]:
        record.update(status="failed", reason="same digest but no swap_completed event: did the spare take over?")
    else:
        record.update(status="ok", reason=f"{ran.wall_s:.0f}s, digest {record['digest'][:16]}..."
                                          + (", identical" if baseline is not None else ""))


# Part 4 --------------------------------------------------------------------------------------------------------


def part_overhead(report: Report, clock: Clock, share: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    entry = report.part(4, "overhead on NCCL")
    if share["status"] != "ok":
        entry.update(status="skipped", reason="no two NCCL ranks can share this GPU (part 2)")
        return entry
    accepts, unknown = _accepts([sys.executable, str(OVERHEAD)], "--backend", report, clock, "p4-overhead")
    if not accepts:
        entry.update(
            status="skipped",
            reason=unknown or "not yet: bench/overhead.py takes no --backend; its --device cuda rows all-reduce "
                              "over gloo (plain DDP and DeadPool alike), so they would not measure NCCL",
            fsdp={"status": "skipped", "reason": "not yet: bench/overhead.py's FSDP2 rows (--sizes llama, systems "
                  "fsdp and deadpool_fsdp) exist but build their mesh on cpu over gloo and take no backend"})
        return entry
    if share["probes"]["4"].get("ok") is not True:
        entry.update(status="skipped", reason="bench/overhead.py runs 4 ranks; 4 NCCL ranks could not share the GPU")
        return entry
    env = {**env, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    common = [sys.executable, str(OVERHEAD), "--device", "cuda", "--backend", "nccl", "--quiet-wait", "0", "--json"]
    tables = {"ddp": [*common, "--sizes", "small", "--steps", "40", "--warmup", "5", "--systems", "ddp,deadpool"],
              "fsdp": [*common, "--sizes", "llama", "--steps", "12", "--warmup", "3", "--systems",
                       "fsdp,deadpool_fsdp"]}
    for key, argv in tables.items():
        limit = clock.bound(OVERHEAD_S)
        if limit < 60:
            entry[key] = {"status": "skipped", "reason": f"time: {clock.left():.0f}s left", "command": shown(argv)}
            continue
        ran = run(argv, env, report.runs / f"p4-overhead-{key}.log", limit)
        entry[key] = {"command": shown(argv, _shown_env(env)), "wall_s": ran.wall_s} | _overhead_rows(ran, report)
        report.say(f"  {key}: {entry[key]['status']} {entry[key].get('reason', '')}  [{entry[key]['command']}]")
        for row in entry[key].get("rows", []):
            report.say(f"    {row['system']:40s} {row['size']:6s} step {row['step_s_median'] * 1e3:8.1f} ms  "
                       f"ratio {row['ratio']:.3f}  stall p99 {row['stall_p99_s']:.4f}s")
        report.write()
    statuses = {entry[k]["status"] for k in tables}
    entry["status"] = "ok" if statuses == {"ok"} else "failed" if "failed" in statuses else "skipped"
    entry["reason"] = "; ".join(f"{k}: {entry[k]['status']}" for k in tables)
    return entry


def _overhead_rows(ran: Ran, report: Report) -> dict[str, Any]:
    text = ran.output
    start = text.find("[\n")
    try:
        rows = json.loads(text[start:text.rindex("]") + 1]) if ran.ok and start >= 0 else None
    except (ValueError, json.JSONDecodeError):
        rows = None
    if not rows:
        report.attach(f"overhead ({ran.how()})", text)
        return {"status": "failed", "reason": f"{ran.how()}: {why(text)}" if not ran.ok else "no JSON rows"}
    keep = ("system", "size", "step_s_median", "ratio", "stall_p99_s", "device", "gpu", "baseline")
    return {"status": "ok", "rows": [{k: row.get(k) for k in keep} for row in rows]}


# Part 5 --------------------------------------------------------------------------------------------------------


def part_recovery(report: Report, e2e: dict[str, Any]) -> dict[str, Any]:
    """Recovery, abort and rebuild times of part 3's chaos runs, from their events files."""
    entry = report.part(5, "recovery on NCCL (events)")
    chaos = [r for r in e2e.get("runs", []) if r["spec"] and r.get("events")]
    if not chaos:
        entry.update(status="skipped", reason=f"no chaos run to read (part 3: {e2e['status']})")
        return entry
    runs = {r["name"]: _recovery(_read_events(report.outdir / r["events"])) for r in chaos}
    entry["runs"] = runs
    for name, figures in runs.items():
        report.say(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in figures.items() if not isinstance(v, list | dict)))
    unswapped = [name for name, f in runs.items() if f["recovery_s"] is None]
    notes = [f"{len(runs) - len(unswapped)} of {len(runs)} chaos runs have a swap_completed event"
             + (f" (not: {', '.join(unswapped)})" if unswapped else "")]
    if not any(f["abort_s"] is not None for f in runs.values()):
        notes.append("no groups_aborted event in any of them: this DeadPool did not write it, so the abort time "
                     "is not separated from the rebuild")
    entry.update(status="ok" if len(unswapped) < len(runs) else "failed", reason="; ".join(notes))
    return entry


def _recovery(events: list[dict[str, Any]]) -> dict[str, Any]:
    injected = [float(r["ts"]) for r in events if r.get("event") == "chaos_injected" and "ts" in r]
    since = min(injected, default=0.0)
    after = [r for r in events if float(r.get("ts", 0.0)) >= since]

    def values(event: str, field: str) -> list[float]:
        return [float(r[field]) for r in after if r.get("event") == event and isinstance(r.get(field), int | float)]

    def most(numbers: list[float]) -> float | None:
        return round(max(numbers), 4) if numbers else None

    aborted = [r for r in after if r.get("event") == "groups_aborted"]
    groups = sorted({str(g) for r in aborted for g in r.get("groups", [])})
    return {
        "recovery_s": most(values("swap_completed", "recovery_s")),  # the kill to the replacement's first step
        "detection_s": most(values("member_failed", "detection_s")),
        "abort_s": most(values("groups_aborted", "s")),  # the slowest seat's abort of its groups
        "abort_events": len(aborted),
        "aborted_groups": groups,
        "abort_late": sorted({str(g) for r in aborted for g in r.get("late") or []}),  # past the abort's bound
        "abort_failed": sorted({str(g) for r in aborted for g in r.get("failed") or []}),  # the abort raised
        "rebuild_s": most(values("restored", "group_s")),  # the slowest seat's group rebuild in its restore
        "mesh_rebuild_s": most(values("restored", "mesh_group_s")),
        "adopt_group_s": most(values("swap_completed", "group_s")),  # the replacement's groups, as it reported
        "restore_s": most(values("restored", "s")),
        "fetch_s": most(values("restored", "fetch_s")),
        "swaps": sum(1 for r in after if r.get("event") == "swap_completed"),
    }


# The check ----------------------------------------------------------------------------------------------------


def skip_rest(report: Report, first: int, reason: str, last: int = 5) -> None:
    names = {1: "versions", 2: "NCCL ranks sharing one GPU", 3: "DeadPool on NCCL, end to end (digests)",
             4: "overhead on NCCL", 5: "recovery on NCCL (events)"}
    done = {p["part"] for p in report.data["parts"]}
    for number in range(first, last + 1):
        if number not in done:
            report.data["parts"].append({"part": number, "name": names[number], "status": "skipped",
                                         "reason": reason})


def check(report: Report, clock: Clock, args: argparse.Namespace) -> str:
    """Parts 0-5 in order; returns the outcome."""
    entry = report.part(0, "a GPU with CUDA", echo=False)
    missing, info = find_gpu(report, clock)
    if missing:
        entry.update(status="skipped", reason=f"no GPU: {missing}")
        if info:
            report.data["versions"].update(torch=info.get("torch", ""), cuda=info.get("cuda", ""))
        skip_rest(report, 1, "no GPU")
        return "no_gpu"
    entry.update(status="ok", reason=f"{info.get('device_count')} GPU(s) visible to torch")
    report.close(part_versions(report, info))
    share, env = part_share(report, clock, info, args.nccl_wheel)
    report.close(share)
    spent = f"time: the check's budget ({args.budget:.0f}s) is spent"
    if clock.left() < RESERVE_S:
        skip_rest(report, 3, spent)
        return "done"
    e2e = part_e2e(report, clock, share, env, args.nproc)
    report.close(e2e)
    if clock.left() < RESERVE_S:
        skip_rest(report, 4, spent, last=4)
    else:
        report.close(part_overhead(report, clock, share, env))
    report.close(part_recovery(report, e2e))  # reads files: no time to speak of
    return "done"


def _raise_on_signal(signum: int, _frame: Any) -> None:
    raise Terminated(f"signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=Path, help="where gpu_check.log, gpu_check.json and runs/ go")
    parser.add_argument("--budget", type=float, default=515.0, help="seconds for the whole check")
    parser.add_argument("--nproc", type=int, choices=(2, 4), default=2,
                        help="ranks of part 3's DeadPool runs (plus one spare), if the probe passed for them")
    parser.add_argument("--nccl-wheel", default=os.environ.get("GPU_CHECK_NCCL_WHEEL", ""),
                        help="an nvidia-nccl-cu13/-cu12 wheel file whose libnccl.so.2 to preload, if torch's is "
                             f"older than {dotted(MIN_NCCL)} (default: $GPU_CHECK_NCCL_WHEEL, else shared/**/*.whl)")
    args = parser.parse_args()
    report = Report(args.outdir)
    clock = Clock(args.budget)
    signal.signal(signal.SIGTERM, _raise_on_signal)
    signal.signal(signal.SIGINT, _raise_on_signal)
    outcome, cut = "failed", ""
    try:
        outcome = check(report, clock, args)
    except Terminated as stop:
        outcome, cut = "interrupted", f"interrupted by {stop}"
        report.say(f"stopped by {stop}; the parts not reached are not in the summary")
    except Exception as err:  # a bug here: the summary still says how far it got
        cut = f"the check itself failed: {type(err).__name__}: {err}"
        report.say(cut)
        import traceback

        report.attach("traceback", traceback.format_exc())
    finally:
        for entry in report.data["parts"]:
            if entry["status"] == "running":
                entry.update(status="failed", reason=cut)
        report.write(outcome)
    parts = report.data["parts"]
    if outcome == "no_gpu":
        report.say(f"gpu_check: {parts[0]['reason']}; nothing to check (exit 0; summary {report.json_path})")
    else:
        report.say("gpu_check: " + "; ".join(f"{p['part']} {p['status']}" for p in parts)
                   + f" ({report.data['elapsed_s']:.0f}s). Summary: {report.json_path}")
    return {"interrupted": 143, "failed": 1}.get(outcome, 0)


if __name__ == "__main__":
    sys.exit(main())
