"""Throughput of an RL script with 1, 2, 4 ... processes under torchrun, and the scaling efficiency, in one run.

    python benchmarks/scaling.py                                   # ppo_atari_envpool.py, 1 2 4 processes, CPU
    python benchmarks/scaling.py --script ppo.py --nprocs 1 2
    python benchmarks/scaling.py --nprocs 1 2 4 8 -- --cuda          # one GPU per process (needs as many GPUs)

Weak scaling, as the scripts define it: --num-envs is per process, so N processes step N times the envs and train
on an N times larger global batch. One process runs as `python SCRIPT` (no process group, exactly as without
torchrun); N > 1 as `torchrun --standalone --nproc-per-node N SCRIPT`. Each run does --iterations iterations; SPS
(environment steps of all processes per second) is timed from rank 0's tensorboard events after --warmup-iters
iterations, so start-up and the first iterations are left out. Efficiency = SPS(N) / (N * SPS(1)). Runs go one at a
time. Writes JSON and markdown (default benchmarks/results/scaling.*) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import speed  # noqa: E402


def parse(argv: list):
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", default="ppo_atari_envpool.py", help="RL script to run")
    p.add_argument("--nprocs", nargs="+", type=int, default=[1, 2, 4], help="process counts to time")
    p.add_argument("--iterations", type=int, default=10, help="PPO iterations per run")
    p.add_argument("--warmup-iters", type=int, default=3, help="iterations left out of the timing")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a run is stopped")
    p.add_argument("--out", default=os.path.join(common.RESULTS, "scaling"), help="output path prefix")
    a = p.parse_args(argv)
    a.extra = extra
    if any(n < 1 for n in a.nprocs) or 1 not in a.nprocs:
        common.die("--nprocs: positive counts, including 1 (the baseline of the efficiency)")
    if a.iterations < a.warmup_iters + 2:
        common.die(f"--iterations must be at least --warmup-iters + 2 = {a.warmup_iters + 2}")
    return a


def command(script_path: str, nproc: int, total: int, runs_dir: str, extra: list) -> list:
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)])
    return [*launcher, script_path, "--total-timesteps", str(total), "--runs-dir", runs_dir, *extra]


def efficiency_rows(rows: list) -> list:
    """Adds speedup = SPS(N) / SPS(1) and efficiency = speedup / N to each row that has an SPS."""
    base = next((r["sps"] for r in rows if r["nproc"] == 1 and "sps" in r), None)
    for r in rows:
        if "sps" in r and base:
            r["speedup"] = r["sps"] / base
            r["efficiency"] = r["speedup"] / r["nproc"]
    return rows


def markdown(rows: list, header: str, per_rank_envs: int) -> str:
    lines = [header.rstrip("\n"), "",
             f"| processes | envs in all ({per_rank_envs} per process) | SPS (warm-up excluded) | speed-up | "
             "efficiency |", "|---|---|---|---|---|"]
    for r in rows:
        if "sps" in r:
            lines.append(f"| {r['nproc']} | {r['nproc'] * per_rank_envs} | {r['sps']:,.0f} | "
                         f"{r.get('speedup', float('nan')):.2f}× | {100 * r.get('efficiency', float('nan')):.0f}% |")
        else:
            lines.append(f"| {r['nproc']} | {r['nproc'] * per_rank_envs} | **failed**: {r['error']} | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    path = common.find_script(a.script)
    defaults = speed.script_defaults(path)
    num_envs = int(speed.flag_value(a.extra, "--num-envs") or defaults.get("num_envs") or 1)
    num_steps = int(speed.flag_value(a.extra, "--num-steps") or defaults.get("num_steps") or 128)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in a.nprocs:
            runs = os.path.join(tmp, f"runs_{nproc}")
            total = a.iterations * nproc * num_envs * num_steps
            cmd = command(path, nproc, total, runs, a.extra)
            print("$ " + " ".join(cmd), flush=True)
            t0 = time.time()
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                                     env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
                rc, tail = res.returncode, (res.stderr or res.stdout).strip().splitlines()[-1:] or ["?"]
            except subprocess.TimeoutExpired:
                rc, tail = -1, [f"timed out after {a.timeout:g} s"]
            row = {"nproc": nproc, "wall_s": round(time.time() - t0, 1)}
            try:
                if rc != 0:
                    raise ValueError(f"exit code {rc}: {tail[0]}")
                (run_dir,) = [os.path.join(runs, d) for d in os.listdir(runs)]
                steps, walls, _ = speed.run_events(run_dir)
                row["sps"] = speed.sps_after_warmup(steps, walls, a.warmup_iters)
            except ValueError as e:
                row["error"] = str(e)
            rows.append(row)
            print(json.dumps(row), flush=True)
    efficiency_rows(rows)
    info = common.machine_info()
    cmd_line = "python benchmarks/scaling.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = markdown(rows, common.machine_markdown(info, cmd_line) + f"\n{a.script}, {num_envs} envs x {num_steps} "
                  f"steps per process, {a.iterations} iterations, timed after {a.warmup_iters}.", num_envs)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".md", "w") as f:
        f.write(md)
    with open(a.out + ".json", "w") as f:
        json.dump({"machine": info, "command": cmd_line, "script": a.script, "num_envs_per_process": num_envs,
                   "rows": rows}, f, indent=1)
    print(md)
    return 0 if all("sps" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
