"""Starts N real JAX processes on this machine and waits for them, bounded in time.

Each process runs ``mp_worker.py``: ``jax.distributed.initialize`` with a local
coordinator on 127.0.0.1, ``K`` simulated CPU devices (``XLA_FLAGS``, set before
JAX starts), CPU cross-process collectives (gloo), then the named scenarios in
order. The harness

- puts every process in its own session (process group) and kills the groups
  when it returns or raises, so nothing outlives a test;
- fails as soon as one process exits with an error (the others, blocked in a
  collective with the dead one, would otherwise wait for JAX's heartbeat
  timeout), naming it and showing the end of its output;
- fails when the whole launch exceeds its time limit, naming who was still running.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "mp_worker.py"
TAIL = 3000  # characters of each process's output shown in a failure


class LaunchError(AssertionError):
    """A launch failed: a process died, or the launch ran out of time."""


def cpu_collectives_missing() -> str | None:
    """Why this jaxlib cannot run CPU collectives across processes, or None if it can."""
    import jax

    if "jax_cpu_collectives_implementation" not in jax.config.values:
        return f"jax {jax.__version__} has no jax_cpu_collectives_implementation option"
    try:
        from jax._src.lib import _jax as lib
    except ImportError:  # older jaxlib layouts
        from jax._src.lib import xla_extension as lib
    if not hasattr(lib, "make_gloo_tcp_collectives"):
        return f"jaxlib {jax.__version__} was built without gloo CPU collectives"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launch:
    out: Path  # the scenarios' output directory
    logs: list[Path]  # each process's stdout + stderr
    wall_s: float

    def log(self, process: int) -> str:
        return self.logs[process].read_text(errors="replace")


def worker_env(devices_per_process: int, cache: Path | None) -> dict[str, str]:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        # Before JAX starts; the tiny programs compile faster at LLVM's lowest level.
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process} "
        "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
        "PYTHONUNBUFFERED": "1",
    }
    if cache is not None:
        env.update(
            JAX_COMPILATION_CACHE_DIR=str(cache),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    return env


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the worker and its children
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _tails(logs: list[Path], which: list[int]) -> str:
    parts = []
    for i in which:
        text = logs[i].read_text(errors="replace") if logs[i].exists() else ""
        parts.append(f"--- process {i} output (last {TAIL} chars) ---\n{text[-TAIL:]}")
    return "\n".join(parts)


def launch(
    command: list[str],
    num_processes: int,
    devices_per_process: int,
    out: Path,
    *,
    timeout: float,
    cache: Path | None = None,
) -> Launch:
    """Runs ``python COMMAND --coordinator ... --num-processes N --process-id i`` N times.

    ``command`` is the script and its own arguments. Returns when all processes
    exited 0; raises :class:`LaunchError` (and kills every process) otherwise.
    """
    out.mkdir(parents=True, exist_ok=True)
    env = worker_env(devices_per_process, cache)
    coordinator = f"127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen] = []
    logs = [out / f"process{i}.log" for i in range(num_processes)]
    start = time.monotonic()
    try:
        for i in range(num_processes):
            args = [sys.executable, *command, "--coordinator", coordinator]
            args += ["--num-processes", str(num_processes), "--process-id", str(i)]
            with logs[i].open("w") as log:
                procs.append(
                    subprocess.Popen(
                        args,
                        cwd=ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                _kill(procs)
                first = failed[0]
                what = ", ".join(f"process {i} exited with code {codes[i]}" for i in failed)
                raise LaunchError(
                    f"{num_processes}-process launch of {Path(command[0]).name} failed: {what}; "
                    f"killed the others after {time.monotonic() - start:.1f}s.\n"
                    + _tails(logs, [first] + [i for i in range(num_processes) if i != first])
                )
            if all(c == 0 for c in codes):
                return Launch(out, logs, time.monotonic() - start)
            if time.monotonic() - start > timeout:
                running = [i for i, c in enumerate(codes) if c is None]
                _kill(procs)
                raise LaunchError(
                    f"{num_processes}-process launch of {Path(command[0]).name} timed out after "
                    f"{timeout:.0f}s; processes {running} were still running (killed).\n"
                    + _tails(logs, list(range(num_processes)))
                )
            time.sleep(0.05)
    finally:
        _kill(procs)


def run_scenarios(
    scenarios: list[str],
    num_processes: int,
    devices_per_process: int,
    out: Path,
    *,
    timeout: float = 240,
    cache: Path | None = None,
    extra: list[str] = (),
) -> Launch:
    """Runs the worker's ``scenarios`` (in order, in one launch) in N processes."""
    command = [str(WORKER), "--out", str(out), *extra, *scenarios]
    return launch(command, num_processes, devices_per_process, out, timeout=timeout, cache=cache)
