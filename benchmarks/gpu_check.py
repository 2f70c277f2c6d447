"""Everything this project wants to know from a GPU machine, in one command under a time limit.

    python benchmarks/gpu_check.py --out $OUT/gpu_check --minutes 8       # on the GPU machine
    python benchmarks/gpu_check.py --dry-run --minutes 2 --out /tmp/gc    # tiny sizes on the CPU: a check of the tool
    python benchmarks/gpu_check.py --stages 2 5 --out $OUT/gpu_check      # a subset, e.g. a rerun of failed stages

Stages, in this order, each under its own share of --minutes (the last stage run takes what is left):
  1 versions     python, torch, CUDA, GPU, transformers, gymnasium, envpool, mujoco, tensordict; then
                 `pytest -m gpu -q tests/test_gpu.py`
  2 atari_speed  Breakout-v5 with 8 envs, SPS warm-up excluded: envpool alone (random actions), CleanRL --cuda, the
                 compiled commands side by side for 2 iterations (this fills torch.compile's cache on disk, so the
                 timed runs compile in seconds), LeanRL --compile --cudagraphs, ours as typed (no flags: on CUDA
                 compiled and captured; its 10M steps stopped at the time limit), ours --compile --cudagraphs (also
                 with --overlap-envs) / eager / --compile / --no-torch-deterministic, LeanRL --compile / eager; each
                 as SPS and as ratios to envpool alone, to CleanRL and to LeanRL's best; last, ours --compile
                 --cudagraphs under cProfile (its top functions, in its log)
  3 ppo_llm      ppo_llm.py's default task for 20 iterations on CUDA (the held-out accuracy must rise from the first
                 evaluation to the last); the rollout's decoding side by side with Hugging Face `generate` at 0.5B,
                 128 prompts x 256 new tokens, bf16 (llm_decode), and where its step's time goes (kernels and GPU
                 time: benchmarks/llm_decode_profile.py); benchmarks/llm_throughput.py at 0.5B for gae and
                 grpo, eager; one iteration at ROLL's lengths, 2,048-token prompts and 4,096-token responses
                 (benchmarks/llm_roll_lengths.py); then llm_throughput --compile and the decoding with its step
                 compiled
  4 cuda_vs_cpu  ppo.py (CartPole-v1) and ppo_continuous.py (HalfCheetah-v5; Pendulum-v1 without MuJoCo), CUDA vs CPU
  5 breakout     ppo_atari_envpool.py learning Breakout-v5 with its defaults (on CUDA compiled and captured) for the
                 time left, then its return curve beside the CPU one (CSV and PNG)

Every command runs as a subprocess in a process group of its own; at its time limit the group gets SIGTERM (the
project's scripts then finish the iteration and write a checkpoint), and SIGKILL a few seconds later. A stage goes on
after a command fails. Writes gpu_check.md (a table per stage: command, device, torch, date, figure), gpu_check.json
(per stage: name, status ok / failed / skipped with the reason, seconds, figures) and logs/<stage>/<item>.log under
--out, after every command (an outer `timeout` leaves what was done). With an earlier gpu_check.json in --out, the
stages not run this time are kept from it. Exit code 0 when no stage failed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

REPO = common.REPO
PY = sys.executable

STAGES = {1: "versions", 2: "atari_speed", 3: "ppo_llm", 4: "cuda_vs_cpu", 5: "breakout"}
# Shares of --minutes; a stage gets its share of the time left among the stages still to run, so the time a stage
# does not use goes to the later ones, and the last stage run (5 when all run) takes what is left.
SHARES = {1: 0.30, 2: 0.40, 3: 0.20, 4: 0.05, 5: 0.05}
GRACE_S = 10.0  # between SIGTERM and SIGKILL
STOP_GRACE_S = 30.0  # stage 5: the run finishes its iteration and writes its checkpoint
MIN_ITEM_S = 5.0  # a command with less time than this left is skipped
DRY_RUN_FLOOR_S = 60.0  # a dry run gives each command at least this, past --minutes if need be: tiny runs on a
#                        loaded CPU spend their time importing torch, and a dry run checks the tool, not the budget
PROGRESS_EVERY_S = 10.0

# Known figures, one H100 (../shared/anchors.md), printed beside ours
KNOWN_H100 = {"envpool_alone": "3,635", "cleanrl": "1,006–1,136", "leanrl_eager": "≈1,760",
              "leanrl_compile": "≈2,230–2,600", "leanrl_compile_cudagraphs": "≈3,700"}
# Each path of ours by both flags (with neither, the Atari script's default on CUDA is compiled and captured)
OUR_PATHS = {"eager": ["--no-compile", "--no-cudagraphs"], "compile": ["--compile", "--no-cudagraphs"],
             "compile_cudagraphs": ["--compile", "--cudagraphs"]}
CPU_BREAKOUT = os.path.join(REPO, "benchmarks", "results", "ppo_atari_envpool_breakout_cpu_curve")  # stage 5
PYTEST_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+,? ?)+ in [\d.]+s(?: \([^)]*\))?)\s*=*$")
LLM_EVAL = re.compile(r"eval iter (\d+): accuracy greedy ([\d.]+)\s+sampled ([\d.]+)")
LEANRL_SPS = re.compile(r"(?:^|\r|\])SPS: ([\d.]+) iteration (\d+)", re.M)  # (tqdm's bar may lead the line)
CLEANRL_SPS = re.compile(r"^SPS: (\d+)\s*$")


# ---------------------------------------------------------------------------------------------------------
# Pure helpers (tested in tests/test_gpu_check.py)
# ---------------------------------------------------------------------------------------------------------
def share_of(left_s: float, weights: list) -> float:
    """The first entry's share of `left_s` seconds by weight among the entries still to run (the last one gets all
    that is left). Time an entry leaves unused thus goes to the ones after it."""
    if not weights:
        return 0.0
    total = float(sum(weights))
    if len(weights) == 1 or total <= 0:
        return max(0.0, left_s)
    return max(0.0, left_s * weights[0] / total)


def plan_stages(total_s: float, stages: list) -> dict:
    """Each selected stage's planned seconds if every stage used all of its share."""
    plan, left = {}, total_s
    for i, s in enumerate(stages):
        plan[s] = share_of(left, [SHARES[x] for x in stages[i:]])
        left -= plan[s]
    return plan


def median_after_warmup(values: list, skip: int) -> float:
    """Median of per-window SPS readings after the first `skip` (compilation, graph capture)."""
    kept = list(values)[skip:]
    if not kept:
        raise ValueError(f"only {len(values)} SPS reading(s); need more than {skip}")
    return float(statistics.median(kept))


def sps_from_cumulative(steps: list, cumulative_sps: list, warmup: int) -> float:
    """Warm-up excluded SPS from readings of a cumulative rate (steps since start / seconds since start), as CleanRL
    and our scripts print: the time of reading i is steps_i / sps_i, so the rate after reading `warmup` is
    (steps_last - steps_w) / (t_last - t_w)."""
    if len(steps) < warmup + 2:
        raise ValueError(f"only {len(steps)} SPS reading(s); need at least {warmup + 2}")
    t = [s / r if r > 0 else math.inf for s, r in zip(steps, cumulative_sps)]
    dt = t[-1] - t[warmup]
    if not (dt > 0 and math.isfinite(dt)):
        raise ValueError("no time passed between the readings")
    return (steps[-1] - steps[warmup]) / dt


def bin_curve(steps: list, returns: list, edges: list) -> list:
    """(mean return, episodes) of the episodes that ended in each bin [edges[i], edges[i+1]) (the last bin includes
    its right edge); mean is None for an empty bin."""
    out = []
    for i in range(len(edges) - 1):
        lo, hi = edges[i], edges[i + 1]
        last = i == len(edges) - 2
        sel = [r for s, r in zip(steps, returns) if lo <= s < hi or (last and s == hi)]
        out.append((sum(sel) / len(sel) if sel else None, len(sel)))
    return out


def curve_edges(max_step: int, bins: int = 20) -> list:
    """`bins` equal bins from 0 to max_step, whole steps."""
    if max_step <= 0:
        return [0, 1]
    return [round(max_step * i / bins) for i in range(bins + 1)]


def pytest_summary(text: str) -> Optional[str]:
    """pytest -q's last line, e.g. '12 passed, 2 skipped in 31.02s'."""
    for line in reversed(text.splitlines()):
        m = PYTEST_SUMMARY.match(line.strip())
        if m:
            return m[1]
    return None


def llm_throughput_rows(data) -> dict:
    """{label: figures} for every entry of llm_throughput.py's JSON that holds its figures (labelled by its
    estimator and path where it names them, else by where it sits in the file)."""
    keys = ("gen_tokens_per_s", "hf_generate_tokens_per_s", "train_tokens_per_s", "peak_gpu_mem_gib")
    rows = {}

    def walk(x, where):
        if isinstance(x, dict):
            if any(k in x for k in keys):
                label = "/".join(str(x[k]) for k in ("estimator", "path") if k in x) or where or "-"
                rows[label] = {k: x[k] for k in keys if x.get(k) is not None}  # (None: not measured)
                return
            for k, v in x.items():
                walk(v, f"{where}/{k}" if where else str(k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{where}[{i}]")

    walk(data, "")
    return rows


def llm_evaluations(text: str) -> list:
    """[(iteration, greedy, sampled)] from ppo_llm.py's `eval iter N: accuracy greedy X  sampled Y` lines."""
    return [(int(m[1]), float(m[2]), float(m[3])) for m in LLM_EVAL.finditer(text)]


def fmt_sps(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:,.0f}"


# ---------------------------------------------------------------------------------------------------------
# Stages as data
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Item:
    """One command of a stage. `timeout` caps its seconds (None: whatever the stage has left) and weighs its share
    of the stage's time; `read(item, log_text)` turns the finished run into figures (raises ValueError if it cannot);
    `skip` is a reason not to run it (the command is still shown)."""
    name: str
    argv: list
    env: dict = field(default_factory=dict)
    timeout: Optional[float] = 60.0
    weight: Optional[float] = None  # its share of the stage's time against the others (default: its timeout)
    cwd: str = REPO
    device: str = "cuda"
    read: Optional[Callable] = None
    skip: Optional[str] = None
    stop_at_limit: bool = False  # runs until its limit on purpose (stage 5): a longer grace after SIGTERM
    # filled in when run
    status: str = "pending"
    reason: Optional[str] = None
    seconds: float = 0.0
    rc: Optional[int] = None
    limited: bool = False
    figures: dict = field(default_factory=dict)
    log: Optional[str] = None
    date: Optional[str] = None

    def command(self, out: str) -> str:
        """The command as run: --out as $OUT, python for this Python, the repository's files relative to its root
        (where the command runs there)."""
        def show(a: str) -> str:
            if a == PY:
                return "python"
            a = a.replace(os.path.abspath(out), "$OUT")
            if self.cwd == REPO and os.path.isabs(a) and a.startswith(REPO + os.sep):
                return os.path.relpath(a, REPO)
            return a

        quote = lambda a: a if re.fullmatch(r"\$OUT[\w/.+-]*", a) else shlex.quote(a)  # noqa: E731
        text = " ".join(quote(show(a)) for a in self.argv)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        text = (env + " " if env else "") + text
        return f"(cd {quote(show(self.cwd))} && {text})" if self.cwd != REPO else text


@dataclass
class Ctx:
    out: str
    dry: bool
    anchors: str
    cuda: bool
    deadline: float
    previous: dict
    results: dict = field(default_factory=dict)  # stage number -> stage dict (this run)

    def stage_dir(self, n: int, *parts) -> str:
        path = os.path.join(self.out, f"stage{n}_{STAGES[n]}", *parts)
        os.makedirs(path, exist_ok=True)
        return path


def has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def dev_flag(ctx: Ctx) -> list:
    """--cuda on the GPU; --no-cuda in a dry run, which runs the CUDA commands on the CPU."""
    return ["--no-cuda"] if ctx.dry else ["--cuda"]


def needs_cuda(ctx: Ctx) -> Optional[str]:
    """A dry run skips what only CUDA can run (its command is still shown)."""
    return "needs CUDA" if ctx.dry else None


# --- readers ----------------------------------------------------------------------------------------------------
def only_run_dir(runs_dir: str) -> str:
    dirs = sorted(d for d in os.listdir(runs_dir) if os.path.isdir(os.path.join(runs_dir, d))) if os.path.isdir(
        runs_dir) else []
    if not dirs:
        raise ValueError(f"no run directory under {runs_dir}")
    return os.path.join(runs_dir, dirs[-1])


def tb_or_stdout_sps(runs_dir: str, warmup: int, batch: int, stdout_kind: str):
    """A reader: SPS after `warmup` iterations from the run's charts/SPS event wall times (speed.py's way), or, when
    the events are missing (a run stopped at its limit before its writer flushed), from the cumulative SPS it
    printed."""
    def read(item: Item, text: str) -> dict:
        import speed

        try:
            steps, walls, _ = speed.run_events(only_run_dir(runs_dir))
            return {"sps": speed.sps_after_warmup(steps, walls, warmup), "iterations": len(steps),
                    "source": f"charts/SPS event times after {warmup} iterations"}
        except (ValueError, OSError, KeyError) as e:
            first_error = str(e)
        skip = warmup
        if stdout_kind == "cleanrl":
            cum = [int(m[1]) for m in (CLEANRL_SPS.match(ln) for ln in text.splitlines()) if m]
            steps = [batch * (i + 1) for i in range(len(cum))]
        else:
            ms = [m for m in (common.PROGRESS_RE.search(ln) for ln in text.splitlines()) if m and m[3] and m[4]]
            steps, cum = [int(m[3]) for m in ms], [int(m[4]) for m in ms]
            skip = 1 if len(steps) > 2 else 0  # ours prints every ~5 s, not every iteration
        try:
            return {"sps": sps_from_cumulative(steps, cum, skip), "iterations": len(steps),
                    "source": f"printed cumulative SPS after reading {skip} ({first_error})"}
        except ValueError as e:
            raise ValueError(f"{first_error}; stdout: {e}") from None
    return read


def read_leanrl(skip: int):
    def read(item: Item, text: str) -> dict:
        values = [float(m[1]) for m in LEANRL_SPS.finditer(text)]
        return {"sps": median_after_warmup(values, skip), "iterations": len(values) * 10,
                "source": f"median of its per-10-iteration SPS prints after the first {skip}"}
    return read


def read_envpool(item: Item, text: str) -> dict:
    m = re.search(r"envpool_sps ([\d.]+)", text)
    if not m:
        raise ValueError("no `envpool_sps` line")
    return {"sps": float(m[1]), "source": "speed.raw_envpool_sps: envpool step (send + recv), random actions, "
                                          "after 100 warm-up steps"}


def read_versions(item: Item, text: str) -> dict:
    m = re.search(r"^versions (\{.*\})$", text, re.M)
    if not m:
        raise ValueError("no `versions {...}` line")
    return json.loads(m[1])


def read_pytest(item: Item, text: str) -> dict:
    s = pytest_summary(text)
    if s is None:
        raise ValueError("no pytest summary line")
    return {"summary": s}


def read_llm_throughput(prefix: str):
    def read(item: Item, text: str) -> dict:
        rows = llm_throughput_rows(read_json(prefix + ".json"))
        if not rows:
            raise ValueError(f"{os.path.basename(prefix)}.json holds no gen_tokens_per_s / train_tokens_per_s")
        return {"rows": rows}
    return read


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {os.path.basename(path)}: {e}") from None


def read_llm_decode(prefix: str):
    """llm_throughput.py --decode-only: the rollout's decoding and Hugging Face generate's, tokens/s and their
    ratio (and the decoding with its step compiled, with --decode-compiled)."""
    def read(item: Item, text: str) -> dict:
        d = read_json(prefix + ".json").get("decode") or {}
        if not d.get("ours") or not d.get("hf"):
            raise ValueError(f"{os.path.basename(prefix)}.json holds no decoding figures")
        fig = {"tokens_per_s": d["ours"], "hf_generate_tokens_per_s": d["hf"], "x_hf_generate": d["ours"] / d["hf"]}
        if d.get("ours_compiled"):
            fig.update(compiled_tokens_per_s=d["ours_compiled"], compiled_x_hf_generate=d["ours_compiled"] / d["hf"])
        return fig
    return read


def read_decode_profile(prefix: str):
    """llm_decode_profile.py: a decoding step's wall time captured and uncaptured, its kernels and their GPU time."""
    def read(item: Item, text: str) -> dict:
        r = read_json(prefix + ".json")
        fig, kernels = dict(r.get("result") or {}), r.get("kernels") or {}
        if fig.get("ms_per_step") is None or not kernels:
            raise ValueError(f"{os.path.basename(prefix)}.json holds no step figures")
        fig["top_kernel"] = max(kernels, key=lambda k: kernels[k]["us_per_step"])[:80]
        return fig
    return read


def read_roll_lengths(prefix: str):
    """llm_roll_lengths.py: the iteration's seconds, its split, the peak GPU memory (GiB)."""
    def read(item: Item, text: str) -> dict:
        r = read_json(prefix + ".json").get("result") or {}
        if r.get("error") or r.get("seconds") is None:
            raise ValueError(f"llm_roll_lengths: {r.get('error') or 'no figures'}")
        return {"seconds": r["seconds"], "peak_gib": r["peak_gib"], "generation_s": r["generation_s"],
                "scoring_s": r["scoring_s"], "update_s": r["update_s"], "response_length_mean":
                r["response_length_mean"], "peak_process_gib": r["peak_rss_gib"]}
    return read


def read_ppo_llm(must_learn: bool):
    def read(item: Item, text: str) -> dict:
        ev = llm_evaluations(text)
        if len(ev) < 2:
            raise ValueError(f"{len(ev)} evaluation line(s); need the first and the last")
        (i0, g0, s0), (i1, g1, s1) = ev[0], ev[-1]
        fig = {"first_eval": {"iteration": i0, "greedy": g0, "sampled": s0},
               "last_eval": {"iteration": i1, "greedy": g1, "sampled": s1}, "learned": s1 > s0}
        if must_learn and not fig["learned"]:
            raise ValueError(f"it must learn: sampled accuracy {s0:.3f} at iteration {i0} -> {s1:.3f} at {i1}")
        return fig
    return read


def read_breakout(ctx: Ctx, runs_dir: str):
    def read(item: Item, text: str) -> dict:
        import report

        run = report.load_run(only_run_dir(runs_dir))
        if run.problem and not (ctx.dry and run.last_step):  # (a dry run's few hundred steps may end no game)
            raise ValueError(run.problem)
        fig = {"steps": int(run.last_step), "episodes": int(len(run.returns)), "sps_last_logged": run.sps,
               "mean_return_last_bin": None}
        fig.update(write_curve(ctx, list(run.steps), list(run.returns), run.last_step))
        return fig
    return read


def cpu_curve() -> tuple:
    """(steps, returns, note) of the committed CPU Breakout curve (its report's episodes.csv)."""
    import report

    path = os.path.join(CPU_BREAKOUT, "episodes.csv")
    if not os.path.exists(path):
        return [], [], f"no CPU curve data: {os.path.relpath(path, REPO)} is missing"
    steps, returns = report.read_episodes_csv(path, "Breakout-v5")
    return steps, returns, f"CPU curve from {os.path.relpath(path, REPO)} (see report.md there)"


def write_curve(ctx: Ctx, steps: list, returns: list, last_step: int) -> dict:
    edges = curve_edges(int(last_step))
    gpu = bin_curve(steps, returns, edges)
    c_steps, c_returns, note = cpu_curve()
    cpu = bin_curve(c_steps, c_returns, edges) if c_steps else [(None, 0)] * (len(edges) - 1)
    d = ctx.stage_dir(5)
    csv_path, png_path = os.path.join(d, "breakout_curve.csv"), os.path.join(d, "breakout_curve.png")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["bin_start", "bin_end", "gpu_mean_return", "gpu_episodes", "cpu_mean_return", "cpu_episodes"])
        for i, ((g, gn), (c, cn)) in enumerate(zip(gpu, cpu)):
            w.writerow([edges[i], edges[i + 1], "" if g is None else f"{g:.3f}", gn, "" if c is None else f"{c:.3f}",
                        cn])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        mids = [(edges[i] + edges[i + 1]) / 2 for i in range(len(edges) - 1)]
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, curve in (("this run", gpu), ("CPU run, same steps", cpu)):
            pts = [(x, y) for x, (y, _) in zip(mids, curve) if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xlabel("global step")
        ax.set_ylabel("episodic return (whole game, binned mean)")
        ax.set_title("Breakout-v5, ppo_atari_envpool.py")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
        plt.close(fig)
        png = os.path.relpath(png_path, ctx.out)
    except Exception as e:  # a figure is a nice-to-have; the CSV holds the numbers
        png = f"not written: {type(e).__name__}: {e}"
    last = next((y for y, _ in reversed(gpu) if y is not None), None)
    return {"mean_return_last_bin": last, "csv": os.path.relpath(csv_path, ctx.out), "png": png, "cpu_curve": note}


# --- the stages ---------------------------------------------------------------------------------------------
def stage1(ctx: Ctx) -> list:
    return [Item("versions", [PY, os.path.abspath(__file__), "--print-versions"], timeout=60, weight=10, device="-",
                 read=read_versions),
            # (-o addopts=: one process, without pytest.ini's pytest-xdist workers, which the GPU machine may lack)
            Item("pytest_gpu", [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                                os.path.join(REPO, "tests", "test_gpu.py")], timeout=None, weight=240, read=read_pytest,
                 device="cuda" if ctx.cuda else "cpu (every test skips without CUDA)")]


def patched_leanrl(path: str, folder: str) -> str:
    """A copy of LeanRL's script whose rollout and GAE run under torch.no_grad(). With tensordict 0.15 its inference
    copy of the agent (`from_module(agent).data` put back with `to_module`) holds parameters that require grad, so
    the rollout's values carried a graph into the update: eager failed at the second minibatch's backward ("backward
    through the graph a second time"), --cudagraphs at GAE's inputs. The rollout was meant to be gradient-free."""
    with open(path) as f:
        text = f.read()
    for name in ("rollout", "gae"):
        if text.count(f"\ndef {name}(") != 1:
            raise ValueError(f"{path}: cannot find `def {name}(` once")
        text = text.replace(f"\ndef {name}(", f"\n@torch.no_grad()\ndef {name}(")
    out = os.path.join(folder, os.path.basename(path))
    with open(out, "w") as f:
        f.write(text)
    return out


def stage2(ctx: Ctx) -> list:
    env_id, envs = "Breakout-v5", 8
    if ctx.dry:
        envs, steps, iters, warm, lean_iters, lean_skip = 2, 16, 2, 0, 20, 0
    else:
        steps, iters, warm, lean_iters, lean_skip = 128, 20, 4, 30, 1
    batch = envs * steps
    small = ["--num-steps", str(steps)] + (["--num-minibatches", "2", "--update-epochs", "1"] if ctx.dry else [])
    common_args = ["--env-id", env_id, "--num-envs", str(envs), "--total-timesteps", str(iters * batch), *small]
    no_envpool = None if has("envpool") else "envpool is not installed"
    cleanrl = os.path.join(ctx.anchors, "cleanrl", "ppo_atari_envpool.py")
    leanrl = os.path.join(ctx.anchors, "leanrl", "ppo_atari_envpool_torchcompile.py")
    items = [Item("envpool_alone", [PY, "-c", 'import sys; sys.path.insert(0, "benchmarks"); import speed; '
                                    f'print("envpool_sps", speed.raw_envpool_sps({json.dumps(env_id)}, {envs}, '
                                    f'{1.0 if ctx.dry else 6.0}))'],
                  timeout=30, device="cpu", read=read_envpool, skip=no_envpool)]
    cwd = ctx.stage_dir(2, "cleanrl")
    items.append(Item("cleanrl", [PY, cleanrl, *dev_flag(ctx), *common_args], timeout=50, cwd=cwd,
                      read=tb_or_stdout_sps(os.path.join(cwd, "runs"), warm, batch, "cleanrl"),
                      skip=no_envpool or (None if os.path.isfile(cleanrl) else f"no {cleanrl}")))
    lean_skip_reason = no_envpool or (None if os.path.isfile(leanrl) else f"no {leanrl}") or (
        None if has("tensordict") else "tensordict is not installed (WITH_ANCHORS=1 bash ../shared/device/pack.sh)")
    if not lean_skip_reason:
        leanrl = patched_leanrl(leanrl, ctx.stage_dir(2, "leanrl_patched"))
    lean_args = ["--env-id", env_id, "--num-envs", str(envs), "--total-timesteps", str(lean_iters * batch), *small]
    ours = os.path.join(REPO, "ppo_atari_envpool.py")
    lean = {name: flags for name, flags in (("leanrl_compile_cudagraphs", ["--compile", "--cudagraphs"]),
                                            ("leanrl_compile", ["--compile"]), ("leanrl_eager", []))}
    variants = {f"ours_{p}": f for p, f in OUR_PATHS.items()}
    variants["ours_no_torch_deterministic"] = [*OUR_PATHS["eager"], "--no-torch-deterministic"]
    # two envpools of 4 envs: one steps while the other's actions are computed (the goal: past LeanRL's best)
    variants["ours_compile_cudagraphs_overlap"] = [*OUR_PATHS["compile_cudagraphs"], "--overlap-envs"]
    variants["ours_default"] = []  # as typed: no flags, the defaults' sizes and 10M steps, stopped at its time limit
    # The compiled commands first run side by side for 2 iterations at the same sizes, which fills torch.compile's
    # cache on disk: the timed runs below then compile from it in seconds (their warm-up iterations are not timed).
    # Each one's output is in warmup/warm<i>.log; the item fails if any of them does
    warm_cmds = [[PY, leanrl, *dev_flag(ctx), *f, *lean_args[:4], "--total-timesteps", str(2 * batch), *small]
                 for n, f in lean.items() if f and not lean_skip_reason] + [
                [PY, ours, *dev_flag(ctx), *f, *common_args[:4], "--total-timesteps", str(2 * batch), *small,
                 "--runs-dir", ctx.stage_dir(2, "warmup_runs")]
                for f in [*OUR_PATHS.values(), variants["ours_compile_cudagraphs_overlap"]] if "--compile" in f]
    script = "".join(f"{shlex.join(c)} > warm{i}.log 2>&1 & p{i}=$!; " for i, c in enumerate(warm_cmds)) + (
        "s=0; for p in " + " ".join(f"$p{i}" for i in range(len(warm_cmds))) + "; do wait $p || s=1; done; exit $s")
    items.append(Item("compile_warmup", ["bash", "-c", script], timeout=150, cwd=ctx.stage_dir(2, "warmup"),
                      skip=no_envpool or needs_cuda(ctx)))
    order = ["leanrl_compile_cudagraphs", "ours_default", "ours_compile_cudagraphs", "ours_compile_cudagraphs_overlap",
             "ours_eager", "ours_compile", "ours_no_torch_deterministic", "leanrl_compile", "leanrl_eager"]
    for name in order:
        if name.startswith("leanrl"):
            flags = lean[name]
            skip = lean_skip_reason or (needs_cuda(ctx) if "--cudagraphs" in flags else None) or (
                "dry run: torch.compile takes minutes on a CPU" if ctx.dry and flags else None)
            items.append(Item(name, [PY, leanrl, *dev_flag(ctx), *flags, *lean_args], timeout=60,
                              cwd=ctx.stage_dir(2, name), read=read_leanrl(lean_skip), skip=skip))
            continue
        flags, runs, typed = variants[name], ctx.stage_dir(2, name, "runs"), name == "ours_default"
        skip = no_envpool or (needs_cuda(ctx) if "--cudagraphs" in flags else None) or (
            "dry run: torch.compile takes minutes on a CPU" if ctx.dry and "--compile" in flags else None) or (
            "dry run: ours_eager with one flag more" if ctx.dry and name == "ours_no_torch_deterministic" else None) or (
            "dry run: the defaults' 10M steps run to the time limit (on the CPU: ours_eager)" if ctx.dry and typed
            else None)
        threads = ["--torch-threads", "1"] if ctx.dry else []
        sizes = [] if typed else [*dev_flag(ctx), *flags, *common_args, *threads]
        items.append(Item(name, [PY, ours, *sizes, "--exp-name", name, "--runs-dir", runs],
                          timeout=60, read=tb_or_stdout_sps(runs, warm, batch, "ours"), skip=skip))
    # Where our fastest path spends its host time (it ran at 0.75x LeanRL's on an H100): Python's profiler over a
    # short run (runpy, so that the script is __main__ for tyro), its top functions by own time in the log
    prof = os.path.join(ctx.stage_dir(2, "profile"), "ours.prof")
    code = ("import cProfile, pstats, runpy, sys\nsys.argv = sys.argv[1:]\np = cProfile.Profile()\np.enable()\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
            f"p.disable()\npstats.Stats(p).sort_stats('tottime').print_stats(30)\np.dump_stats({json.dumps(prof)})")
    items.append(Item("ours_compile_cudagraphs_profile",
                      [PY, "-c", code, ours, *dev_flag(ctx), *OUR_PATHS["compile_cudagraphs"], *common_args,
                       "--exp-name", "profile", "--runs-dir", ctx.stage_dir(2, "profile", "runs")], timeout=60,
                      skip=no_envpool or needs_cuda(ctx)))
    return items


def stage2_figures(items: list) -> dict:
    by = {i.name: i.figures.get("sps") for i in items}
    base, clean, lean = by.get("envpool_alone"), by.get("cleanrl"), by.get("leanrl_compile_cudagraphs")
    for i in items:
        sps = i.figures.get("sps")
        if sps is not None and i.name not in ("envpool_alone", "cleanrl"):
            i.figures["x_envpool_alone"] = round(sps / base, 3) if base else None
            i.figures["x_cleanrl"] = round(sps / clean, 3) if clean else None
            i.figures["x_leanrl_best"] = round(sps / lean, 3) if lean else None  # its --compile --cudagraphs
        if i.name in KNOWN_H100:
            i.figures["known_h100_sps"] = KNOWN_H100[i.name]
    ours = {n[5:]: v for n, v in by.items() if n.startswith("ours_") and v}
    best = max(ours, key=ours.get) if ours else None
    return {"sps": {k: v for k, v in by.items() if v is not None}, "fastest_of_ours": best}


def stage3(ctx: Ctx) -> list:
    def out(name: str) -> str:
        return os.path.join(ctx.out, name)
    bench = os.path.join(REPO, "benchmarks")
    device = "cpu" if ctx.dry else "cuda"
    if ctx.dry:
        tp = ["--preset", "tiny", "--device", "cpu", "--estimators", "gae", "--iterations", "2", "--vocab-size", "99",
              "--rollout-batch-size", "4", "--n", "2", "--response-length", "6", "--micro-batch-size", "4"]
        llm = ["--num-iterations", "2", "--no-cuda", "--sft-steps", "1", "--sft-batch-size", "4", "--eval-prompts", "4",
               "--train-batch-size", "4", "--ppo-mini-batch-size", "2", "--tiny-hidden-size", "32", "--tiny-num-layers",
               "1", "--torch-threads", "1"]
    else:  # (4 iterations: the first holds start-up and compilation, the next three are timed)
        tp = ["--preset", "qwen2.5-0.5b", "--device", "cuda", "--estimators", "gae", "grpo", "--iterations", "4"]
        llm = ["--num-iterations", "20", "--cuda"]
    runs = ctx.stage_dir(3, "runs")
    items = [Item("ppo_llm_20_iterations", [PY, os.path.join(REPO, "ppo_llm.py"), *llm, "--runs-dir", runs],
                  timeout=None, weight=2, read=read_ppo_llm(must_learn=not ctx.dry), device=device),
             Item("llm_decode", [PY, os.path.join(bench, "llm_throughput.py"), *tp, "--decode-only", "--out",
                                 out("llm_decode")], timeout=None, weight=1, read=read_llm_decode(out("llm_decode")),
                  device=device),
             Item("llm_decode_profile", [PY, os.path.join(bench, "llm_decode_profile.py"), "--out",
                                         out("llm_decode_profile")], timeout=None, weight=1,
                  read=read_decode_profile(out("llm_decode_profile")), device=device, skip=needs_cuda(ctx))]
    # (compile last: the first to go when time is short; the side-by-side generation is llm_decode's)
    for path in ("eager",) if ctx.dry else ("eager", "compile"):
        items.append(Item(f"llm_throughput_{path}", [PY, os.path.join(bench, "llm_throughput.py"), *tp, "--paths",
                                                     path, "--no-side-by-side", "--out", out(f"llm_throughput_{path}")],
                          timeout=None, weight=2, read=read_llm_throughput(out(f"llm_throughput_{path}")),
                          device=device))
        if path == "eager":
            items.append(Item("llm_roll_lengths", [PY, os.path.join(bench, "llm_roll_lengths.py"),
                                                   *(["--dry-run"] if ctx.dry else []), "--out",
                                                   out("llm_roll_lengths")], timeout=None, weight=2,
                              read=read_roll_lengths(out("llm_roll_lengths")), device=device))
    if not ctx.dry:
        items.append(Item("llm_decode_compiled", [PY, os.path.join(bench, "llm_throughput.py"), *tp, "--decode-only",
                                                  "--decode-compiled", "--out", out("llm_decode_compiled")],
                          timeout=None, weight=1, read=read_llm_decode(out("llm_decode_compiled")), device=device))
    return items


def stage4(ctx: Ctx) -> list:
    items = []
    mujoco = has("mujoco")
    # (the scripts' default sizes; a few iterations after the warm-up ones; weight = share of the stage's time)
    specs = [("ppo", "ppo.py", "CartPole-v1", ["--num-envs", "4", "--num-steps", "128"], 30 * 512, 3, 60),
             ("ppo_continuous", "ppo_continuous.py", "HalfCheetah-v5" if mujoco else "Pendulum-v1",
              ["--num-envs", "1", "--num-steps", "2048"], 6 * 2048, 2, 150)]
    for stem, script, env_id, sizes, steps, warm, timeout in specs:
        if ctx.dry:
            sizes, steps, warm = ["--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2",
                                  "--update-epochs", "1"], 3 * 64, 1
        for device in ("cpu", "cuda"):
            runs = ctx.stage_dir(4, f"{stem}_{device}", "runs")
            flag = "--cuda" if device == "cuda" else "--no-cuda"
            items.append(Item(f"{stem}_{device}", [PY, os.path.join(REPO, script), flag, "--env-id", env_id, *sizes,
                                                   "--total-timesteps", str(steps), "--exp-name", f"{stem}_{device}",
                                                   "--runs-dir", runs],
                              timeout=timeout, device=device, read=tb_or_stdout_sps(runs, warm, 0, "ours"),
                              skip=needs_cuda(ctx) if device == "cuda" else None))
    return items


def stage4_figures(items: list) -> dict:
    by = {i.name: i.figures.get("sps") for i in items}
    out = {}
    for stem in ("ppo", "ppo_continuous"):
        cpu, gpu = by.get(f"{stem}_cpu"), by.get(f"{stem}_cuda")
        out[stem] = {"cpu_sps": cpu, "cuda_sps": gpu, "cuda_over_cpu": round(gpu / cpu, 3) if cpu and gpu else None}
    return out


def stage5(ctx: Ctx) -> list:
    if ctx.dry:  # (the CPU's default path: eager)
        sizes = ["--no-cuda", "--num-envs", "2", "--num-steps", "64", "--total-timesteps", "512", "--num-minibatches",
                 "2", "--update-epochs", "1", "--torch-threads", "1"]
    else:
        sizes = []  # the defaults: CUDA, compiled and captured, 8 envs x 128 steps, 10M steps; stopped with SIGTERM
    runs = ctx.stage_dir(5, "runs")
    item = Item("breakout_learning", [PY, os.path.join(REPO, "ppo_atari_envpool.py"), *sizes,
                                      "--checkpoint-every", "100", "--exp-name", "gpu_check_breakout",
                                      "--runs-dir", runs],
                timeout=None, read=read_breakout(ctx, runs), stop_at_limit=True,
                skip=None if has("envpool") else "envpool is not installed", device="cpu" if ctx.dry else "cuda")
    item.figures["path"] = "the script's default path"
    return [item]


BUILDERS = {1: stage1, 2: stage2, 3: stage3, 4: stage4, 5: stage5}
SUMMARIES = {2: stage2_figures, 4: stage4_figures}


# ---------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------
class Stopped(Exception):
    """gpu_check itself got SIGTERM / SIGINT (an outer `timeout`)."""


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_item(item: Item, limit: float, log_path: str, t0: float, label: str) -> str:
    """Runs the command in its own process group under `limit` seconds (SIGTERM, then SIGKILL after a grace);
    returns its merged output."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **item.env)
    job = common.Job(label, item.argv, log_path)  # (for its progress-line parsing and status text)
    chunks = []
    start = time.time()
    with open(log_path, "w", buffering=1) as log:
        log.write(f"$ {shlex.join(item.argv)}\n")
        proc = subprocess.Popen(item.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=item.cwd, start_new_session=True, bufsize=1)

        def pump():
            for line in proc.stdout:
                log.write(line)
                chunks.append(line)
                job.feed(line)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        grace = STOP_GRACE_S if item.stop_at_limit else GRACE_S
        term_at, kill_at, last = start + limit, None, start
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                now = time.time()
                if kill_at is None and now >= term_at:
                    item.limited = True
                    print(f"[{common.fmt_duration(now - t0)}]   {label}: time limit {limit:.0f} s reached, SIGTERM",
                          flush=True)
                    kill_group(proc, signal.SIGTERM)
                    kill_at = now + grace
                elif kill_at is not None and now >= kill_at:
                    kill_group(proc, signal.SIGKILL)
                    kill_at = math.inf
                if now - last >= PROGRESS_EVERY_S:
                    last = now
                    print(f"[{common.fmt_duration(now - t0)}]   {job.status()} ({now - start:.0f} s)", flush=True)
        except BaseException:
            kill_group(proc, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            kill_group(proc, signal.SIGKILL)  # whatever the command left behind in its group
        th.join(timeout=5)
    item.rc, item.seconds = proc.returncode, time.time() - start
    return "".join(chunks)


def run_stage(ctx: Ctx, n: int, items: list, budget: float, t0: float, save: Callable) -> dict:
    """Runs the stage's items in order; after each, `save(partial stage)` writes the reports so far."""
    start = time.time()
    stage_end = min(start + budget, ctx.deadline)
    print(f"[{common.fmt_duration(start - t0)}] stage {n} {STAGES[n]}: {budget:.0f} s", flush=True)
    for k, item in enumerate(items):
        item.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        print(f"[{common.fmt_duration(time.time() - t0)}]   {item.name}: $ {item.command(ctx.out)}", flush=True)
        if item.skip:
            item.status, item.reason = "skipped", item.skip
            print(f"[{common.fmt_duration(time.time() - t0)}]   {item.name}: skipped: {item.skip}", flush=True)
            continue
        todo = [i for i in items[k:] if not i.skip]
        left = stage_end - time.time()
        weights = [i.weight or i.timeout or 60.0 for i in todo]
        limit = share_of(left, weights)
        if item.timeout is not None:
            limit = min(limit, item.timeout)
        limit = min(limit, ctx.deadline - time.time())
        if ctx.dry:  # (past --minutes if need be: a dry run checks the tool, not the budget)
            limit = max(limit, DRY_RUN_FLOOR_S)
        limit -= STOP_GRACE_S if item.stop_at_limit and not ctx.dry else 0
        if limit < MIN_ITEM_S:
            item.status, item.reason = "skipped", f"no time left ({max(limit, 0):.0f} s)"
            print(f"[{common.fmt_duration(time.time() - t0)}]   {item.name}: skipped: {item.reason}", flush=True)
            continue
        log = os.path.join(ctx.out, "logs", f"stage{n}_{STAGES[n]}", item.name + ".log")
        item.log = os.path.relpath(log, ctx.out)
        text = run_item(item, limit, log, t0, f"{item.name} (limit {limit:.0f} s)")
        try:
            if item.rc != 0 and not item.limited:
                raise ValueError(f"exit code {item.rc}")
            if item.read is not None:  # (a run stopped at its limit counts when its figures are there)
                item.figures.update(item.read(item, text))
            item.status = "ok"
            if item.limited:
                item.figures["stopped_at_time_limit_s"] = round(limit)
        except Exception as e:
            tail = [ln for ln in text.strip().splitlines() if ln.strip()]
            item.status = "failed"
            item.reason = (str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}") + (
                f"; stopped at the time limit of {limit:.0f} s" if item.limited else "") + (
                f"; last line: {tail[-1].strip()[:300]}" if tail and item.rc else "")
        print(f"[{common.fmt_duration(time.time() - t0)}]   {item.name}: {item.status} in {item.seconds:.1f} s"
              + (f": {item.reason}" if item.reason else "") + (f"  {short(item.figures)}" if item.figures else ""),
              flush=True)
        save({"number": n, "name": STAGES[n], "status": "running", "seconds": round(time.time() - start, 1),
              "budget_s": round(budget), "figures": {}, "items": [item_dict(i, ctx.out) for i in items[:k + 1]]})
    figures = SUMMARIES[n](items) if n in SUMMARIES else {}
    statuses = [i.status for i in items]
    if "failed" in statuses:
        status, reason = "failed", "; ".join(f"{i.name}: {i.reason}" for i in items if i.status == "failed")
    elif all(s == "skipped" for s in statuses):
        status, reason = "skipped", "; ".join(sorted({i.reason for i in items}))
    else:
        status, reason = "ok", None
    st = {"number": n, "name": STAGES[n], "status": status, "seconds": round(time.time() - start, 1),
          "budget_s": round(budget), "figures": figures, "items": [item_dict(i, ctx.out) for i in items]}
    if reason:
        st["reason"] = reason
    print(f"[{common.fmt_duration(time.time() - t0)}] stage {n} {STAGES[n]}: {status} in {st['seconds']:.0f} s",
          flush=True)
    return st


def short(fig: dict) -> str:
    parts = []
    for k, v in fig.items():
        if isinstance(v, float):
            v = f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        elif isinstance(v, dict):
            v = "{…}"
        parts.append(f"{k}={v}")
    return " ".join(parts)[:300]


def item_dict(i: Item, out: str) -> dict:
    d = {"name": i.name, "status": i.status, "command": i.command(out), "device": i.device, "date": i.date,
         "seconds": round(i.seconds, 1), "exit_code": i.rc, "figures": i.figures, "log": i.log}
    if i.reason:
        d["reason"] = i.reason
    return d


# ---------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------
def figure_text(name: str, fig: dict) -> str:
    if "sps" in fig:
        t = f"{fig['sps']:,.0f} SPS"
        ratios = [f"{fig[k]:.2f}× {of}" for k, of in (("x_envpool_alone", "envpool alone"), ("x_cleanrl", "CleanRL"),
                                                      ("x_leanrl_best", "LeanRL's best")) if fig.get(k) is not None]
        t += f" ({', '.join(ratios)})" if ratios else ""
        if "known_h100_sps" in fig:
            t += f"; known H100: {fig['known_h100_sps']}"
        return t
    if "summary" in fig:
        return fig["summary"]
    if "rows" in fig:
        return "; ".join(f"{k}: " + ", ".join(f"{a} {b:,.4g}" if isinstance(b, (int, float)) else f"{a} {b}"
                                              for a, b in v.items()) for k, v in fig["rows"].items())
    if "first_eval" in fig:
        a, b = fig["first_eval"], fig["last_eval"]
        return (f"sampled accuracy {a['sampled']:.3f} (iteration {a['iteration']}) → {b['sampled']:.3f} "
                f"(iteration {b['iteration']}), greedy {a['greedy']:.3f} → {b['greedy']:.3f}: "
                + ("learned" if fig["learned"] else "did not learn"))
    if "torch" in fig and "python" in fig:
        return ", ".join(f"{k} {v}" for k, v in fig.items() if v is not None)
    if "steps" in fig:
        r = fig.get("mean_return_last_bin")
        return (f"{fig['steps']:,} steps, {fig['episodes']} games, last bin's mean return "
                f"{'-' if r is None else f'{r:.1f}'}; {fig.get('path', '')}; curve: {fig.get('csv')}, "
                f"{fig.get('png')}; {fig.get('cpu_curve', '')}")
    return short(fig) if fig else ""


def markdown(data: dict) -> str:
    m = data["machine"]
    lines = ["# GPU check", "",
             f"- command: `{data['command']}`",
             f"- date: {data['date']}" + (" (dry run: tiny sizes on the CPU; the figures mean nothing)"
                                          if data["dry_run"] else ""),
             f"- device: {m['device']}; torch {m['torch']} (CUDA {m['cuda']}); python {m['python']}",
             f"- commit: {m['commit']}",
             f"- time: {data['minutes']} minutes planned, {data['seconds']:.0f} s used", ""]
    for st in data["stages"]:
        lines += [f"## Stage {st['number']}: {st['name']} — {st['status']}"
                  + (f" ({st['reason']})" if st.get("reason") and st["status"] == "skipped" else ""), "",
                  f"{st['seconds']:.0f} s of a planned {st.get('budget_s', '?')} s" +
                  (f"; from an earlier run ({st['kept_from']})" if st.get("kept_from") else ""), "",
                  "| item | status | command | device | torch | date | figure |", "|---|---|---|---|---|---|---|"]
        for it in st["items"]:
            fig = figure_text(it["name"], it["figures"])
            if it["status"] != "ok":
                fig = (f"**{it['status']}**: {it.get('reason', '')}" + (f"; {fig}" if fig else "")).strip()
            cell = fig.replace("|", "\\|").replace("\n", " ")
            cmd = it["command"].replace("|", "\\|")
            lines.append(f"| {it['name']} | {it['status']} | `{cmd}` | {it['device']} | {st.get('torch', m['torch'])} "
                         f"| {it.get('date') or '-'} | {cell} |")
        f = st.get("figures") or {}
        if st["number"] == 4 and f:
            lines += ["", "| script | CPU SPS | CUDA SPS | CUDA / CPU |", "|---|---|---|---|"]
            for k, v in f.items():
                ratio = "-" if v["cuda_over_cpu"] is None else f"{v['cuda_over_cpu']:.2f}×"
                lines.append(f"| {k}.py | {fmt_sps(v['cpu_sps'])} | {fmt_sps(v['cuda_sps'])} | {ratio} |")
        if st["number"] == 2 and f:
            lines += ["", f"Fastest of ours: {f.get('fastest_of_ours') or '-'}. Known H100 figures "
                          "(../shared/anchors.md): " + ", ".join(f"{k} {v}" for k, v in KNOWN_H100.items()) + "."]
        lines.append("")
    return "\n".join(lines)


def machine(dry: bool) -> dict:
    info = {"python": platform.python_version(), "torch": None, "cuda": None, "device": "cpu",
            "commit": common.git_commit()}
    try:
        import torch

        info["torch"], info["cuda"] = torch.__version__, torch.version.cuda
        if torch.cuda.is_available() and not dry:
            info["device"] = torch.cuda.get_device_name(0)
        elif torch.cuda.is_available():
            info["device"] = f"cpu (dry run; GPU {torch.cuda.get_device_name(0)} there)"
    except Exception:
        pass
    return info


def print_versions() -> int:
    """`--print-versions`: stage 1's first item, one `versions {json}` line."""
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "gymnasium", "envpool", "mujoco", "tensordict", "peft", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    import torch

    out["cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    out["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    print("versions " + json.dumps(out), flush=True)
    return 0


def write_reports(ctx: Ctx, data: dict) -> None:
    kept = [s for s in ctx.previous.get("stages", []) if s.get("number") not in ctx.results]
    for s in kept:
        s.setdefault("kept_from", ctx.previous.get("date", "an earlier run"))
    data["stages"] = sorted(list(ctx.results.values()) + kept, key=lambda s: s["number"])
    tmp = os.path.join(ctx.out, "gpu_check.json.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, os.path.join(ctx.out, "gpu_check.json"))
    with open(os.path.join(ctx.out, "gpu_check.md"), "w") as f:
        f.write(markdown(data))


def default_anchors() -> str:
    here = os.path.join(REPO, ".devsite", "anchors")
    return here if os.path.isdir(here) else os.path.normpath(os.path.join(REPO, "..", "shared", "anchors"))


def parse(argv: list):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[6:13]))
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "gpu_check"),
                   help="directory of gpu_check.md, gpu_check.json, logs/ and the stages' files")
    p.add_argument("--minutes", type=float, default=8.0, help="time for all the selected stages (default 8)")
    p.add_argument("--stages", type=int, nargs="+", choices=sorted(STAGES), default=sorted(STAGES),
                   help="which stages to run (in their order), e.g. --stages 1 3")
    p.add_argument("--only", nargs="+", metavar="ITEM", default=None,
                   help="run only these commands of the selected stages (e.g. a rerun of the ones that failed)")
    p.add_argument("--dry-run", action="store_true",
                   help="every stage at tiny sizes on the CPU (CUDA-only commands skipped, still shown)")
    p.add_argument("--anchors", default=None, help="CleanRL / LeanRL scripts (default: .devsite/anchors if it "
                                                   "exists, else ../shared/anchors)")
    p.add_argument("--print-versions", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.minutes <= 0:
        common.die("--minutes must be positive")
    a.stages = sorted(set(a.stages))
    a.anchors = os.path.abspath(a.anchors or default_anchors())
    return a


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.print_versions:
        return print_versions()
    t0 = time.time()
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    previous = {}
    try:
        with open(os.path.join(out, "gpu_check.json")) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        pass
    if previous.get("dry_run") != a.dry_run:
        previous = {}  # never mix a dry run's stages with a real one's
    info = machine(a.dry_run)
    cuda = not a.dry_run
    if not a.dry_run and not common.torch_sees_cuda():
        common.die("torch finds no CUDA device here; --dry-run runs the check at tiny sizes on the CPU")
    ctx = Ctx(out=out, dry=a.dry_run, anchors=a.anchors, cuda=cuda, deadline=t0 + 60 * a.minutes, previous=previous)
    data = {"command": "python benchmarks/gpu_check.py " + shlex.join(argv).replace(out, "$OUT").replace(a.out, "$OUT"),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "dry_run": a.dry_run, "minutes": a.minutes, "machine": info, "anchors": a.anchors, "seconds": 0.0}
    plan = plan_stages(60 * a.minutes, a.stages)
    print(f"gpu_check: {info['device']}, torch {info['torch']}, {a.minutes:g} min; plan: "
          + ", ".join(f"{s} {STAGES[s]} {plan[s]:.0f} s" for s in a.stages) + f"; out {out}", flush=True)

    def on_signal(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    def save(stage: dict) -> None:
        ctx.results[stage["number"]] = stage
        data["seconds"] = time.time() - t0
        write_reports(ctx, data)

    try:
        for k, n in enumerate(a.stages):
            budget = share_of(ctx.deadline - time.time(), [SHARES[s] for s in a.stages[k:]])
            items = [i for i in BUILDERS[n](ctx) if a.only is None or i.name in a.only]
            for it in items:
                if ctx.dry and it.device == "cuda":
                    it.device = "cpu (dry run)"
                if ctx.dry:  # tiny runs on a few loaded cores: one thread each
                    it.env.setdefault("OMP_NUM_THREADS", "1")
            save({"number": n, "name": STAGES[n], "status": "running", "seconds": 0.0, "budget_s": round(budget),
                  "figures": {}, "items": []})
            save(run_stage(ctx, n, items, budget, t0, save))
    except Stopped as e:
        print(f"gpu_check stopped by {e}; writing what was done", flush=True)
        for st in ctx.results.values():
            if st["status"] == "running":
                st.update(status="failed", reason=f"gpu_check stopped by {e} during this stage")
    data["seconds"] = time.time() - t0
    write_reports(ctx, data)
    print("\nsummary (the tables with the commands: gpu_check.md)", flush=True)
    for st in data["stages"]:
        print(f"stage {st['number']} {st['name']}: {st['status']}"
              + (f" (kept from {st['kept_from']})" if st.get("kept_from") else ""), flush=True)
        for it in st["items"]:
            fig = figure_text(it["name"], it["figures"])
            print(f"  {it['name']}: {it['status']}" + (f": {it['reason']}" if it.get("reason") else "")
                  + (f" | {fig}" if fig else ""), flush=True)
    failed = [s["name"] for s in data["stages"] if s["status"] == "failed"]
    print(f"written: {out}/gpu_check.md, gpu_check.json, logs/" + (f"; failed: {', '.join(failed)}" if failed else ""),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
