"""Speed of each RL script in each execution path, beside the raw speed of its environment, in one run.

    python benchmarks/speed.py                                    # every RL script found, every path, CPU (+ CUDA)
    python benchmarks/speed.py --scripts ppo.py --paths eager compile --total-timesteps ppo.py=5e4
    python benchmarks/speed.py --devices cuda --scripts ppo_atari_envpool.py -- --num-envs 16

For each script: the raw random-action steps per second of the same vector environment with the same number of
envs (gymnasium SyncVectorEnv in SAME_STEP autoreset for ppo.py / ppo_continuous.py, envpool for
ppo_atari_envpool.py), then the training SPS of the script run as a subprocess for a short number of steps, for each
path (eager, --compile, --cudagraphs, --compile --cudagraphs; both flags and the device's always given, so a script's
defaults choose nothing) on each device (CPU; CUDA where present; CUDA graphs only on CUDA). Training SPS excludes
warm-up (start-up, compilation, graph capture): it is computed from the wall times of the tensorboard events of
iterations --warmup-iters+1 .. last, i.e. (step_last - step_w) / (t_last - t_w).
Runs go one at a time so they do not disturb each other. Writes JSON and markdown (default
benchmarks/results/speed.json and speed.md) and prints the table with the ratios.
Exit code 0 when every measurement that was not skipped succeeded, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from typing import Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import report  # noqa: E402

RL_SCRIPTS = ["ppo.py", "ppo_continuous.py", "ppo_atari_envpool.py"]
# Each path by both flags, and the device by its flag (the Atari script's defaults on a GPU: CUDA, compiled, captured)
PATHS = {"eager": ["--no-compile", "--no-cudagraphs"], "compile": ["--compile", "--no-cudagraphs"],
         "cudagraphs": ["--no-compile", "--cudagraphs"], "compile+cudagraphs": ["--compile", "--cudagraphs"]}
# Short runs that still leave several iterations after warm-up at the scripts' default batch sizes
DEFAULT_STEPS = {"ppo.py": 30 * 512, "ppo_continuous.py": 8 * 2048, "ppo_atari_envpool.py": 10 * 1024}
DEFAULT_ENV = {"ppo.py": "CartPole-v1", "ppo_continuous.py": "HalfCheetah-v5", "ppo_atari_envpool.py": "Breakout-v5"}
DEFAULT_NUM_ENVS = {"ppo.py": 4, "ppo_continuous.py": 1, "ppo_atari_envpool.py": 8}


def per_script(values: list, name: str, convert=str) -> dict:
    """`script=value` pairs, or one bare value for every script -> {script or '*': value}."""
    out = {}
    for v in values or []:
        key, _, val = v.rpartition("=")
        try:
            out[key or "*"] = convert(val)
        except ValueError as e:
            common.die(f"{name}: {e}")
    return out


def parse(argv: list):
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="arguments after `--` are passed to every script unchanged")
    p.add_argument("--scripts", nargs="+", default=None,
                   help=f"scripts to time (default: those of {' '.join(RL_SCRIPTS)} that exist)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS), help="execution paths")
    p.add_argument("--devices", nargs="+", default=None, choices=["cpu", "cuda"],
                   help="devices (default: cpu, and cuda when torch sees one)")
    p.add_argument("--total-timesteps", nargs="+", default=None, metavar="[SCRIPT=]N",
                   help="steps of each timed run, e.g. ppo.py=5e4 ppo_atari_envpool.py=20480, or one N for all "
                        f"(default: {', '.join(f'{k}={v}' for k, v in DEFAULT_STEPS.items())})")
    p.add_argument("--env-ids", nargs="+", default=None, metavar="[SCRIPT=]ENV_ID",
                   help="env id per script (default: the script's default env)")
    p.add_argument("--warmup-iters", type=int, default=3,
                   help="iterations excluded from the training SPS (start-up, compilation, graph capture)")
    p.add_argument("--raw-seconds", type=float, default=5.0, help="seconds of random-action stepping per env")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a timed run is stopped")
    p.add_argument("--out", default=os.path.join(common.RESULTS, "speed"),
                   help="output path without extension (.json and .md are written)")
    p.add_argument("--every", type=float, default=5.0, help="seconds between progress lines")
    args = p.parse_args(argv)
    args.extra = extra
    args.steps = per_script(args.total_timesteps, "--total-timesteps", common.parse_count)
    args.envs = per_script(args.env_ids, "--env-ids")
    if args.warmup_iters < 0 or args.raw_seconds <= 0:
        common.die("--warmup-iters must be >= 0 and --raw-seconds positive")
    for flag in ("--env-id", "--total-timesteps", "--runs-dir", "--exp-name", *{f for fs in PATHS.values() for f in fs},
                 "--cuda", "--no-cuda"):
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            common.die(f"{flag} is set by speed.py; do not pass it after `--`")
    return args


def script_defaults(path: str) -> dict:
    """The script's Args defaults (the scripts import without side effects); {} if it cannot be imported."""
    saved_env = dict(os.environ)  # (a script that set variables at import would set them for the others too)
    try:
        spec = importlib.util.spec_from_file_location(f"_speed_{os.path.basename(path)[:-3]}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        import dataclasses

        return {f.name: getattr(mod.Args(), f.name) for f in dataclasses.fields(mod.Args)}
    except (Exception, SystemExit):
        return {}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def flag_value(extra: list, flag: str) -> Optional[str]:
    for i, a in enumerate(extra):
        if a == flag and i + 1 < len(extra):
            return extra[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


# ---------------------------------------------------------------------------------------------------------
# Raw environment speed
# ---------------------------------------------------------------------------------------------------------
def raw_gymnasium_sps(env_id: str, num_envs: int, seconds: float, warmup_steps: int = 100) -> float:
    """Random actions through gymnasium's SyncVectorEnv (SAME_STEP autoreset, as the scripts use it)."""
    import gymnasium as gym

    envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    envs.reset(seed=0)
    envs.action_space.seed(0)
    for _ in range(warmup_steps):
        envs.step(envs.action_space.sample())
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            envs.step(envs.action_space.sample())
        n += 50
    sps = n * num_envs / (time.perf_counter() - t0)
    envs.close()
    return sps


def raw_envpool_sps(env_id: str, num_envs: int, seconds: float, warmup_steps: int = 100) -> float:
    """Random actions through envpool with the Atari settings of ppo_atari_envpool.py."""
    import envpool

    envs = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, episodic_life=True, reward_clip=True,
                        seed=0)
    n_actions = envs.action_space.n
    rng = np.random.default_rng(0)
    envs.reset()
    for _ in range(warmup_steps):
        envs.step(rng.integers(0, n_actions, size=num_envs))
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            envs.step(rng.integers(0, n_actions, size=num_envs))
        n += 20
    sps = n * num_envs / (time.perf_counter() - t0)
    envs.close()
    return sps


# ---------------------------------------------------------------------------------------------------------
# Training speed from the events of a short run
# ---------------------------------------------------------------------------------------------------------
def sps_after_warmup(steps: list, walls: list, warmup_iters: int) -> float:
    """(step_last - step_w) / (t_last - t_w) with w = the end of iteration `warmup_iters` (one event per
    iteration; warmup_iters = 0 measures from the first logged iteration, so its own time is left out too)."""
    w = max(warmup_iters - 1, 0)
    if len(steps) < w + 2:
        raise ValueError(f"only {len(steps)} iterations logged; need at least {w + 2} "
                         f"(raise --total-timesteps or lower --warmup-iters)")
    dt = walls[-1] - walls[w]
    if dt <= 0:
        raise ValueError("no time passed between the first timed iteration and the last")
    return (steps[-1] - steps[w]) / dt


def run_events(run_dir: str) -> tuple:
    """(steps, walls, first event time) of charts/SPS, the one tag logged once per iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    ea.Reload()
    if report.SPS_TAG not in ea.Tags()["scalars"]:
        raise ValueError(f"no {report.SPS_TAG} events in {run_dir}")
    ev = ea.Scalars(report.SPS_TAG)
    return [e.step for e in ev], [e.wall_time for e in ev], ea.FirstEventTimestamp()


def time_script(job: common.Job, runs_dir: str, warmup_iters: int) -> dict:
    """Read the finished job's run: SPS after warm-up, and SPS over the whole logged run for comparison."""
    if job.rc != 0:
        tail = common.log_tail(job.log_path, 6)
        last = tail.strip().splitlines()[-1].strip() if tail.strip() else "no output"
        return {"error": f"exit code {job.rc}: {last}\n{tail}"}
    dirs = [d for d in os.listdir(runs_dir) if os.path.isdir(os.path.join(runs_dir, d))] if os.path.isdir(
        runs_dir) else []
    if not dirs:
        return {"error": f"no run directory under {runs_dir}"}
    try:
        steps, walls, first = run_events(os.path.join(runs_dir, sorted(dirs)[-1]))
        sps = sps_after_warmup(steps, walls, warmup_iters)
    except ValueError as e:
        return {"error": str(e)}
    return {"sps": sps, "sps_whole_run": steps[-1] / (walls[-1] - first) if walls[-1] > first else None,
            "iterations": len(steps), "steps": steps[-1], "process_seconds": job.end - job.start}


# ---------------------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------------------
def markdown(results: list, raw: dict, header: str) -> str:
    lines = [header.rstrip("\n"), "",
             "| script | env | num_envs | device | path | training SPS (warm-up excluded) | × eager, same device | "
             "× eager CPU | % of raw env SPS |",
             "|---|---|---|---|---|---|---|---|---|"]
    for script, r in raw.items():
        val = f"{r['sps']:,.0f}" if "sps" in r else f"error: {r.get('error', '?')}"
        lines.append(f"| {script} | {r['env_id']} | {r['num_envs']} | - | raw env, random actions ({r['kind']}) | "
                     f"{val} | | | 100% |")
    for res in results:
        base_dev = next((x for x in results if x["script"] == res["script"] and x["device"] == res["device"]
                         and x["path"] == "eager" and "sps" in x), None)
        base_cpu = next((x for x in results if x["script"] == res["script"] and x["device"] == "cpu"
                         and x["path"] == "eager" and "sps" in x), None)
        rw = raw.get(res["script"], {})
        if "sps" in res:
            val = f"{res['sps']:,.0f}"
            r_dev = f"{res['sps'] / base_dev['sps']:.2f}×" if base_dev else "-"
            r_cpu = f"{res['sps'] / base_cpu['sps']:.2f}×" if base_cpu else "-"
            r_raw = f"{100 * res['sps'] / rw['sps']:.1f}%" if "sps" in rw else "-"
        else:
            val = ("skipped: " + res["skipped"]) if "skipped" in res else ("**failed**: " + res["error"].splitlines()[0])
            r_dev = r_cpu = r_raw = ""
        lines.append(f"| {res['script']} | {res['env_id']} | {res['num_envs']} | {res['device']} | {res['path']} | "
                     f"{val} | {r_dev} | {r_cpu} | {r_raw} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    names = args.scripts or [s for s in RL_SCRIPTS if os.path.isfile(os.path.join(common.REPO, s))]
    if not names:
        common.die("no RL script found")
    scripts = {os.path.basename(s): common.find_script(s) for s in names}
    cuda = common.torch_sees_cuda() if args.devices is None or "cuda" in args.devices else False
    devices = args.devices or (["cpu", "cuda"] if cuda else ["cpu"])
    notes = []
    if args.devices is None and not cuda:
        notes.append("no CUDA device here: CUDA paths (and every CUDA graphs path) skipped")

    # Raw env speed, and the plan of timed runs
    raw, plan = {}, []
    for name, path in scripts.items():
        defaults = script_defaults(path)
        env_id = args.envs.get(name, args.envs.get("*", defaults.get("env_id", DEFAULT_ENV.get(name))))
        num_envs = int(flag_value(args.extra, "--num-envs") or defaults.get("num_envs") or
                       DEFAULT_NUM_ENVS.get(name, 1))
        if env_id is None:
            common.die(f"--env-ids: no env id known for {name}")
        kind = "envpool" if "envpool" in name else "gymnasium SyncVectorEnv"
        print(f"raw env speed: {env_id} x {num_envs} ({kind}), {args.raw_seconds:g} s ...", flush=True)
        try:
            fn = raw_envpool_sps if kind == "envpool" else raw_gymnasium_sps
            raw[name] = {"env_id": env_id, "num_envs": num_envs, "kind": kind,
                         "sps": fn(env_id, num_envs, args.raw_seconds)}
            print(f"  {raw[name]['sps']:,.0f} SPS", flush=True)
        except Exception as e:
            raw[name] = {"env_id": env_id, "num_envs": num_envs, "kind": kind, "error": f"{type(e).__name__}: {e}"}
            print(f"  failed: {raw[name]['error']}", flush=True)
        batch = num_envs * int(flag_value(args.extra, "--num-steps") or defaults.get("num_steps") or 128)
        fallback = max(DEFAULT_STEPS.get(name, 0), batch * (args.warmup_iters + 5))  # (a larger batch after `--`)
        steps = args.steps.get(name, args.steps.get("*", fallback))
        known = flag_value(args.extra, "--num-steps") or defaults.get("num_steps")
        if known and steps // batch < args.warmup_iters + 2:  # fail now, not after the runs
            common.die(f"{name}: --total-timesteps {steps} is {steps // batch} iterations of {batch} steps; the SPS "
                       f"needs at least --warmup-iters + 2 = {args.warmup_iters + 2}")
        for device in devices:
            for p in args.paths:
                plan.append(dict(script=name, path=p, device=device, env_id=env_id, num_envs=num_envs,
                                 total_timesteps=steps))

    tmp = tempfile.mkdtemp(prefix="speed_runs_")
    logs = os.path.join(os.path.dirname(os.path.abspath(args.out)), "speed_logs")
    results, jobs = [], []
    for item in plan:
        if item["device"] == "cuda" and not cuda:
            item["skipped"] = "no CUDA device"
        elif "cudagraphs" in item["path"] and item["device"] != "cuda":
            item["skipped"] = "CUDA graphs need CUDA"
        results.append(item)
        if "skipped" in item:
            continue
        tag = f"{item['script'][:-3]}_{item['device']}_{item['path'].replace('+', '_')}"
        cmd = [sys.executable, scripts[item["script"]], "--env-id", item["env_id"], "--total-timesteps",
               str(item["total_timesteps"]), "--exp-name", tag, "--runs-dir", os.path.join(tmp, tag)]
        cmd += PATHS[item["path"]] + (["--cuda"] if item["device"] == "cuda" else ["--no-cuda"]) + args.extra
        item["command"] = shlex.join(["python", os.path.relpath(cmd[1], common.REPO)] + cmd[2:]).replace(tmp, "<tmp>")
        jobs.append((item, common.Job(f"{item['script']} {item['device']} {item['path']}", cmd,
                                      os.path.join(logs, tag + ".log"))))
    print(f"{len(jobs)} timed runs, one at a time ({len(results) - len(jobs)} skipped)", flush=True)
    t_start = time.time()
    try:
        for i, (item, job) in enumerate(jobs):
            if i:
                avg = (time.time() - t_start) / i
                print(f"{i}/{len(jobs)} timed runs done in {common.fmt_duration(time.time() - t_start)}, "
                      f"ETA {common.fmt_duration(avg * (len(jobs) - i))}", flush=True)
            job.name = f"[{i + 1}/{len(jobs)}] {job.name}"
            common.run_jobs([job], 1, every=args.every, timeout=args.timeout)
            item.update(time_script(job, job.cmd[job.cmd.index("--runs-dir") + 1], args.warmup_iters))
            if "sps" in item:
                print(f"  {item['sps']:,.0f} SPS after warm-up ({item['iterations']} iterations logged, "
                      f"{item['process_seconds']:.0f} s in all)", flush=True)
            else:
                print(f"  failed: {item['error']}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    info = common.machine_info()
    command = "python benchmarks/speed.py " + shlex.join(argv)
    header = common.machine_markdown(info, command) + "".join(f"- note: {n}\n" for n in notes) + (
        f"- training SPS: environment steps per second of the whole training loop, from the tensorboard event wall "
        f"times after the first {args.warmup_iters} iterations (warm-up excluded)\n")
    md = "## Speed\n\n" + markdown(results, raw, header)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"command": command, "machine": info, "notes": notes, "warmup_iters": args.warmup_iters,
                   "raw_env": raw, "runs": results}, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    print()
    print(md)
    print(f"written to {os.path.relpath(args.out)}.json and .md (logs in {os.path.relpath(logs)}/)")
    failed = [r for r in results if "error" in r] + [r for r in raw.values() if "error" in r]
    if failed:
        print(f"error: {len(failed)} measurement(s) failed (listed above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
