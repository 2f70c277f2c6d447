"""Reproduce rows of the results with one command: run a script over env ids x seeds as parallel processes (at most
one per core), then read their tensorboard events and write the tables and learning curves.

    python benchmarks/reproduce.py --script ppo.py --env-ids CartPole-v1 --seeds 1 2 3
    python benchmarks/reproduce.py --script ppo_continuous.py --env-ids HalfCheetah-v5 Hopper-v5 --seeds 1 2 3
    python benchmarks/reproduce.py --script ppo.py --env-ids CartPole-v1 --seeds 1 2 --total-timesteps 5e4 \\
        -- --num-envs 8            # everything after `--` goes to the script unchanged
    python benchmarks/reproduce.py --script ppo.py --env-ids CartPole-v1 --seeds 1 2 3 --report-only

Writes under --out (default benchmarks/results/<script name>/): runs/ (the scripts' run directories), logs/ (each
process's output), report.md, runs.csv (one row per seed), summary.csv, episodes.csv (one row per finished
episode), curves_steps.png, curves_time.png and meta.json (command, date, hardware, versions). While it runs it
prints which runs are going, their step and an ETA.
Exit code: 0 when every run finished and has data, 1 otherwise (the report names the runs without data), 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import report  # noqa: E402


def parse(argv: list):
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="arguments after `--` are passed to the script unchanged")
    p.add_argument("--script", required=True, help="the RL script, e.g. ppo.py or ppo_continuous.py")
    p.add_argument("--env-ids", nargs="+", required=True, help="environment ids")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds (default: 1 2 3)")
    p.add_argument("--total-timesteps", default=None,
                   help="passed to the script as --total-timesteps (default: the script's own default)")
    p.add_argument("--exp-name", default=None, help="experiment name (default: the script's file name stem)")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at a time (default: one per usable core, at most the number of runs)")
    p.add_argument("--out", default=None, help="output directory (default: benchmarks/results/<script stem>)")
    p.add_argument("--title", default=None, help="title of the markdown report")
    p.add_argument("--every", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the report from the latest runs already under <out>/runs")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    # errors from argparse exit with 2 and one usage line + message, which is our convention
    args = p.parse_args(argv)
    args.extra = extra
    if args.total_timesteps is not None:
        try:
            args.total_timesteps = common.parse_count(args.total_timesteps)
        except ValueError as e:
            common.die(f"--total-timesteps: {e}")
    if args.jobs is not None and args.jobs < 1:
        common.die(f"--jobs must be positive, got {args.jobs}")
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.env_ids)) != len(args.env_ids):
        common.die("--seeds and --env-ids must not repeat")
    for flag in ("--env-id", "--seed", "--exp-name", "--runs-dir"):
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            common.die(f"{flag} is set by reproduce.py; do not pass it after `--`")
    return args


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    script = common.find_script(args.script)
    stem = os.path.splitext(os.path.basename(script))[0]
    exp_name = args.exp_name or stem
    out = os.path.abspath(args.out or os.path.join(common.RESULTS, stem))
    runs_dir, logs_dir = os.path.join(out, "runs"), os.path.join(out, "logs")
    command = "python benchmarks/reproduce.py " + shlex.join(argv)
    expected = [(env_id, exp_name, seed) for env_id in args.env_ids for seed in args.seeds]

    jobs = []
    for env_id, _, seed in expected:
        cmd = [sys.executable, script, "--env-id", env_id, "--seed", str(seed), "--exp-name", exp_name,
               "--runs-dir", runs_dir]
        if args.total_timesteps is not None:
            cmd += ["--total-timesteps", str(args.total_timesteps)]
        cmd += args.extra
        safe_env = env_id.replace("/", "_")
        jobs.append(common.Job(f"{env_id} seed {seed}", cmd, os.path.join(logs_dir, f"{safe_env}__{seed}.log")))
    if args.dry_run:
        for job in jobs:
            print(shlex.join(job.cmd))
        return 0

    failed = {}
    started_at = {}
    if not args.report_only:
        parallel = args.jobs or min(len(jobs), common.usable_cores())
        print(f"{len(jobs)} runs of {os.path.basename(script)} ({len(args.env_ids)} env(s) x {len(args.seeds)} "
              f"seed(s)), {parallel} at a time; output in {os.path.relpath(out)}", flush=True)
        t0 = time.time()
        common.run_jobs(jobs, parallel, every=args.every)
        print(f"all runs ended after {common.fmt_duration(time.time() - t0)}", flush=True)
        for (env_id, _, seed), job in zip(expected, jobs):
            started_at[(env_id, seed)] = int(job.start) - 1
            if job.rc != 0:
                failed[(env_id, seed)] = job
                print(f"run {job.name} failed with exit code {job.rc}; last lines of {job.log_path}:\n"
                      f"{common.log_tail(job.log_path)}", file=sys.stderr)

    # The runs of this invocation: the newest directory of each (env, seed) started after its process did
    # (with --report-only: the newest there is). Older directories in runs/ are left alone and not read.
    runs = []
    for env_id, _, seed in expected:
        candidates = []
        if os.path.isdir(runs_dir):
            for name in os.listdir(runs_dir):
                parsed = report.parse_run_name(name)
                if parsed and parsed[:3] == (env_id, exp_name, seed) and parsed[3] >= started_at.get((env_id, seed), 0):
                    candidates.append((parsed[3], name))
        if not candidates:
            job = failed.get((env_id, seed))
            why = f"process exited with code {job.rc}, log: {os.path.relpath(job.log_path)}" if job else \
                "no run directory under " + os.path.relpath(runs_dir)
            runs.append(report.Run(env_id, exp_name, seed, problem=why))
            continue
        run = report.load_run(os.path.join(runs_dir, max(candidates)[1]))
        job = failed.get((env_id, seed))
        if job is not None:  # partial data is shown, but the run is flagged
            run.problem = (f"process exited with code {job.rc} at step {run.last_step:,} "
                           f"(log: {os.path.relpath(job.log_path)})" + (f"; {run.problem}" if run.problem else ""))
        runs.append(run)

    info = common.machine_info()
    meta = {"command": command, "script": os.path.basename(script), "env_ids": args.env_ids, "seeds": args.seeds,
            "total_timesteps": args.total_timesteps, "extra_args": args.extra, "machine": info,
            "runs": [{"env_id": r.env_id, "seed": r.seed, "run_dir": r.run_dir, "problem": r.problem} for r in runs]}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    title = args.title or f"{os.path.basename(script)}: {', '.join(args.env_ids)}"
    md, ok = report.build_report([], out, expected=expected, header=common.machine_markdown(info, command),
                                 title=title, runs=runs)
    print()
    print(md)
    print(f"written to {os.path.relpath(out)}/: report.md, runs.csv, summary.csv, episodes.csv, curves_steps.png, "
          f"curves_time.png, meta.json, logs/")
    if not ok:
        print("error: some runs failed or have no data (listed above)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
