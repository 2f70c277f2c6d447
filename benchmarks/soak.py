"""Soak test of stop and resume: a ppo.py run killed with SIGTERM several times and resumed each time must end where
an uninterrupted run with the same seed ends (same parameters, same final return).

    python benchmarks/soak.py                       # CartPole-v1, 500k steps, 4 kills at random moments
    python benchmarks/soak.py --total-timesteps 1e5 --kills 6

Writes benchmarks/results/soak/soak.md and soak.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from common import machine_info  # noqa: E402


def final_return(run_dir: str, fraction: float = 0.1) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = []
    for f in glob.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        acc = EventAccumulator(f, size_guidance={"scalars": 0})
        acc.Reload()
        points += [(e.step, e.value) for e in acc.Scalars("charts/episodic_return")]
    last = max(s for s, _ in points)
    return float(np.mean([v for s, v in points if s >= (1 - fraction) * last]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total-timesteps", default="5e5")
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "soak"))
    a = p.parse_args()
    runs = os.path.join(a.out, "runs", time.strftime("%Y%m%d-%H%M%S"))  # a fresh directory for each soak
    os.makedirs(runs)
    common = [sys.executable, os.path.join(ROOT, "ppo.py"), "--total-timesteps", a.total_timesteps, "--seed",
              str(a.seed), "--runs-dir", runs, "--save-model"]

    print("uninterrupted run ...", flush=True)
    t0 = time.time()
    subprocess.run(common + ["--exp-name", "uninterrupted"], check=True, stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    (ref_dir,) = glob.glob(os.path.join(runs, f"*__uninterrupted__{a.seed}__*"))

    rng = random.Random(a.seed)
    cmd, kills, pieces = common + ["--exp-name", "killed"], 0, 0
    while True:
        pieces += 1
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        first = ""
        while True:  # training is under way (signal handlers installed) once a progress line is printed
            line = proc.stdout.readline()
            first += line
            if not line or line.startswith("iter "):
                break
        if kills < a.kills and line.startswith("iter "):
            time.sleep(rng.uniform(0.1, 0.9) * wall / (a.kills + 1))
            proc.send_signal(signal.SIGTERM)
            kills += 1
        out, _ = proc.communicate()
        out = first + out
        if proc.returncode != 0:
            print(out)
            return 1
        if "continue with:" not in out:
            break  # the run reached its end
        ckpt = out.split("--resume ")[-1].split()[0]
        print(f"killed #{kills} at global step {torch.load(ckpt, weights_only=True)['global_step']}, resuming",
              flush=True)
        cmd = [sys.executable, os.path.join(ROOT, "ppo.py"), "--resume", ckpt]
    (killed_dir,) = glob.glob(os.path.join(runs, f"*__killed__{a.seed}__*"))

    ref = torch.load(os.path.join(ref_dir, "checkpoint.pt"), weights_only=True)
    got = torch.load(os.path.join(killed_dir, "checkpoint.pt"), weights_only=True)
    same_params = all(torch.equal(ref["model"][k], got["model"][k]) for k in ref["model"])
    result = dict(total_timesteps=a.total_timesteps, seed=a.seed, kills=kills, pieces=pieces,
                  global_step=[ref["global_step"], got["global_step"]],
                  final_return=[final_return(ref_dir), final_return(killed_dir)], identical_parameters=same_params,
                  machine=machine_info())
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(a.out, "soak.md"), "w") as f:
        f.write(f"- command: `python benchmarks/soak.py --total-timesteps {a.total_timesteps} --kills {a.kills}`\n"
                f"- {kills} SIGTERMs at random moments, {pieces} processes in all\n\n"
                "| run | global step | final return (last 10% of steps) |\n|---|---|---|\n"
                f"| uninterrupted | {ref['global_step']:,} | {result['final_return'][0]:.2f} |\n"
                f"| killed and resumed | {got['global_step']:,} | {result['final_return'][1]:.2f} |\n\n"
                f"Parameters identical: {same_params}\n")
    print(open(os.path.join(a.out, "soak.md")).read())
    return 0 if same_params and result["final_return"][0] == result["final_return"][1] else 1


if __name__ == "__main__":
    sys.exit(main())
