"""Helpers shared by the benchmark tools: child processes run in parallel with a combined progress line,
and a description of the machine and package versions for the reports."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, TextIO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")

# ppo.py and its siblings print `iter 12/97  global_step=6144  SPS=2301  ...` every ~5 s
PROGRESS_RE = re.compile(r"iter\s+(\d+)\s*/\s*(\d+)(?:\s+global_step=(\d+))?(?:\s+SPS=(\d+))?")


def die(msg: str) -> None:
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def find_script(script: str) -> str:
    """A script given as a path (relative to the working directory) or as a name in the repository root."""
    for path in (script, os.path.join(REPO, script)):
        if os.path.isfile(path):
            return os.path.abspath(path)
    where = sorted({os.getcwd(), REPO})
    die(f"no such script {script!r} (looked in {' and '.join(where)})")


def parse_count(text: str) -> int:
    """500000, 5e5 or 1_000_000 -> int; anything not a whole number is an error."""
    try:
        value = float(str(text).replace("_", ""))
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not value.is_integer() or value < 0:
        raise ValueError(f"{text!r} is not a whole non-negative number")
    return int(value)


def fmt_duration(seconds: Optional[float]) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# ---------------------------------------------------------------------------------------------------------
# Child processes with progress
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Job:
    name: str
    cmd: list
    log_path: str
    env: Optional[dict] = None
    # filled in while it runs
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)
    start: Optional[float] = None
    end: Optional[float] = None
    rc: Optional[int] = None
    iteration: int = 0
    num_iterations: int = 0
    global_step: int = 0
    sps: Optional[int] = None
    progress_at: Optional[float] = None
    first_progress: Optional[tuple] = None  # (time, iteration) of the first progress line: start-up excluded

    @property
    def total_steps(self) -> Optional[int]:
        if self.iteration and self.num_iterations and self.global_step:
            return self.global_step * self.num_iterations // self.iteration
        return None

    def expected_duration(self) -> Optional[float]:
        """Seconds the whole job will take, extrapolated from the fraction of iterations done."""
        if self.end is not None:
            return self.end - self.start
        if not (self.iteration and self.num_iterations and self.progress_at):
            return None
        t1, i1 = self.first_progress
        if self.iteration > i1:  # the rate since the first progress line: start-up and compilation excluded
            rate = (self.progress_at - t1) / (self.iteration - i1)
            return self.progress_at - self.start + (self.num_iterations - self.iteration) * rate
        return (self.progress_at - self.start) * self.num_iterations / self.iteration

    def feed(self, line: str) -> None:
        m = PROGRESS_RE.search(line)
        if m:
            self.iteration, self.num_iterations, self.global_step = int(m[1]), int(m[2]), int(m[3] or 0)
            self.sps = int(m[4]) if m[4] else None
            self.progress_at = time.time()
            if self.first_progress is None:
                self.first_progress = (self.progress_at, self.iteration)

    def status(self) -> str:
        if not self.iteration:
            return f"{self.name}: starting"
        pct = 100.0 * self.iteration / self.num_iterations
        sps = f" {self.sps} SPS" if self.sps is not None else ""
        if not self.global_step:  # a script that logs iterations only (ppo_llm.py)
            return f"{self.name}: iter {self.iteration}/{self.num_iterations} ({pct:.0f}%){sps}"
        return f"{self.name}: step {self.global_step:,}/{self.total_steps:,} ({pct:.0f}%){sps}"


def _pump(job: Job) -> None:
    """Copy the child's merged stdout/stderr into its log file and parse the progress lines."""
    with open(job.log_path, "a", buffering=1) as log:
        for line in job.proc.stdout:
            log.write(line)
            job.feed(line)


def eta(jobs: list, queued: int, parallel: int, now: float) -> Optional[float]:
    """Seconds until all jobs are done: what the running ones have left, plus the queued ones at the average
    duration of the others, spread over the parallel slots."""
    durations = [d for d in (j.expected_duration() for j in jobs if j.start is not None) if d is not None]
    running = [j for j in jobs if j.start is not None and j.end is None]
    left = []
    for j in running:
        d = j.expected_duration()
        if d is None:
            if not durations:
                return None
            d = sum(durations) / len(durations)
        left.append(max(0.0, j.start + d - now))
    if queued:
        if not durations:
            return None
        avg = sum(durations) / len(durations)
        return (sum(left) + queued * avg) / max(1, parallel)
    return max(left, default=0.0)


def run_jobs(jobs: list, parallel: int, every: float = 5.0, out: TextIO = sys.stdout,
             timeout: Optional[float] = None) -> None:
    """Run the jobs, at most `parallel` at a time, printing one combined progress line every `every` seconds
    (which runs, their step, an ETA). Each job's output goes to its log file; rc/start/end are set on the jobs.
    A job running longer than `timeout` seconds is killed (its rc is then negative)."""
    queue = list(jobs)
    running: list = []
    threads = []
    t0, last_print = time.time(), time.time()
    try:
        while queue or running:
            while queue and len(running) < parallel:
                job = queue.pop(0)
                os.makedirs(os.path.dirname(os.path.abspath(job.log_path)), exist_ok=True)
                with open(job.log_path, "w") as log:
                    log.write("$ " + " ".join(job.cmd) + "\n")
                env = dict(os.environ, PYTHONUNBUFFERED="1", **(job.env or {}))
                job.start = time.time()
                job.proc = subprocess.Popen(job.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                            env=env, cwd=REPO, bufsize=1)
                th = threading.Thread(target=_pump, args=(job,), daemon=True)
                th.start()
                threads.append(th)
                running.append(job)
                print(f"[{fmt_duration(job.start - t0)}] start {job.name} (log: {os.path.relpath(job.log_path)})",
                      file=out, flush=True)
            time.sleep(0.1)
            for job in list(running):
                rc = job.proc.poll()
                if rc is None and timeout is not None and time.time() - job.start > timeout:
                    print(f"[{fmt_duration(time.time() - t0)}] timed out after {timeout:g} s: {job.name}", file=out,
                          flush=True)
                    job.proc.kill()
                    rc = job.proc.wait()
                if rc is None:
                    continue
                job.end, job.rc = time.time(), rc
                running.remove(job)
                what = "done" if rc == 0 else f"FAILED (exit code {rc})"
                print(f"[{fmt_duration(job.end - t0)}] {what}: {job.name} in {job.end - job.start:.1f} s",
                      file=out, flush=True)
            now = time.time()
            if running and now - last_print >= every:
                last_print = now
                done = sum(1 for j in jobs if j.end is not None)
                parts = " | ".join(j.status() for j in running)
                print(f"[{fmt_duration(now - t0)}] {len(running)} running, {done} done, {len(queue)} queued | "
                      f"{parts} | ETA {fmt_duration(eta(jobs, len(queue), parallel, now))}", file=out, flush=True)
    except KeyboardInterrupt:
        for job in running:
            job.proc.terminate()
        raise
    for th in threads:
        th.join(timeout=5)


def log_tail(path: str, n: int = 8) -> str:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + ln for ln in lines[-n:])


# ---------------------------------------------------------------------------------------------------------
# Machine and versions
# ---------------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> Optional[str]:
    """The first GPU's name from nvidia-smi (cheap: no torch import), or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


def torch_sees_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "gymnasium", "envpool", "numpy", "tensorboard", "mujoco", "transformers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha or "no commit") + (" (with uncommitted changes)" if dirty or not sha else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "gpu": gpu_name(),
        "os": platform.platform(),
        "versions": versions(),
        "commit": git_commit(),
    }


def cell(x, fmt: str = ",.0f") -> str:  # a figure in a report's table; blank where there is none
    return "" if x is None else format(x, fmt)


def write_report(out: str, lines: list, data: dict, cuda: bool) -> None:
    """OUT.md (the markdown lines) and OUT.json (the device, torch's version and the date, then data)."""
    import torch

    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(out + ".json", "w") as f:
        json.dump({"device": gpu_name() if cuda else cpu_model(), "torch": torch.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **data}, f,
                  indent=1)


def machine_markdown(info: dict, command: str) -> str:
    v = ", ".join(f"{k} {val}" for k, val in info["versions"].items())
    return (f"- command: `{command}`\n- date: {info['date']}\n"
            f"- hardware: {info['cpu']}, {info['cores']} cores" + (f", GPU {info['gpu']}" if info.get("gpu") else
                                                                     ", no GPU") +
            f"\n- versions: {v}\n- commit: {info['commit']}\n")
