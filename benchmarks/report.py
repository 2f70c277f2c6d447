"""Read the tensorboard event files of PPO runs and write the results: a CSV per seed, a CSV and a markdown table
per (experiment, env) with the final return (mean ± std over seeds) beside the published reference figure, a CSV
of every finished episode (the curves as numbers), and learning-curve PNGs (mean with a ±std band over seeds) against
global step and against wall time.

    python benchmarks/report.py benchmarks/results/ppo/runs --out benchmarks/results/ppo

Run directories are named `<env_id>__<exp_name>__<seed>__<unix time>` (as the scripts write them). A run with no
episodic returns, an unreadable directory or an expected seed with no directory is reported by name, never skipped;
the command exits with code 1 when there is any such problem.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE_FILE = os.path.join(HERE, "reference.json")
RETURN_TAG = "charts/episodic_return"
SPS_TAG = "charts/SPS"
FINAL_FRACTION = 0.1  # "final return" = mean episodic return over the last 10% of the run's steps
FINAL_HEADER = "final return (mean ± std over seeds; per seed: mean episodic return in the last 10% of steps)"


@dataclass
class Run:
    env_id: str
    exp_name: str
    seed: int
    run_dir: Optional[str] = None
    started: int = 0  # the unix time in the directory name
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0))  # global step of each finished episode
    walls: np.ndarray = field(default_factory=lambda: np.zeros(0))  # seconds since the run started
    returns: np.ndarray = field(default_factory=lambda: np.zeros(0))
    last_step: int = 0  # the last global step logged under any tag
    wall_seconds: float = float("nan")  # first event to last event
    sps: float = float("nan")  # the last charts/SPS value the script logged
    problem: Optional[str] = None  # why this run has no usable data (None: it has)

    @property
    def key(self):
        return (self.exp_name, self.env_id)

    @property
    def final_return(self) -> float:
        return final_return(self.steps, self.returns, self.last_step)


def parse_run_name(name: str):
    """`<env_id>__<exp_name>__<seed>__<unix time>` -> (env_id, exp_name, seed, time), or None."""
    parts = name.split("__")
    if len(parts) < 4:
        return None
    try:
        seed, started = int(parts[-2]), int(parts[-1])
    except ValueError:
        return None
    return parts[0], "__".join(parts[1:-2]), seed, started


def final_return(steps: np.ndarray, returns: np.ndarray, last_step: int, fraction: float = FINAL_FRACTION) -> float:
    """Mean of the episodic returns logged in the last `fraction` of the run's steps: (1-fraction)*last < step."""
    steps, returns = np.asarray(steps, dtype=float), np.asarray(returns, dtype=float)
    if len(returns) == 0:
        return float("nan")
    window = steps >= (1.0 - fraction) * last_step
    if not window.any():  # no episode ended in the window (very long episodes): take the last one logged
        return float(returns[np.argmax(steps)])
    return float(returns[window].mean())


def load_run(run_dir: str, tag: str = RETURN_TAG) -> Run:
    """Read one run directory (all its event files, resumed runs included)."""
    name = os.path.basename(os.path.normpath(run_dir))
    parsed = parse_run_name(name)
    if parsed is None:
        return Run("?", "?", -1, run_dir, problem=f"{name}: not a run directory name (<env>__<exp>__<seed>__<time>)")
    run = Run(*parsed[:3], run_dir=run_dir, started=parsed[3])
    if not glob.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        run.problem = "no tensorboard event file in the run directory"
        return run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    try:
        ea = EventAccumulator(run_dir, size_guidance={"scalars": 0})
        ea.Reload()
        tags = ea.Tags()["scalars"]
        start = ea.FirstEventTimestamp()
    except Exception as e:  # a truncated or foreign file
        run.problem = f"event files unreadable: {type(e).__name__}: {e}"
        return run
    last_wall, last_step = start, 0
    for other in tags:
        ev = ea.Scalars(other)
        if ev:
            last_step = max(last_step, max(e.step for e in ev))
            last_wall = max(last_wall, max(e.wall_time for e in ev))
    run.last_step, run.wall_seconds = int(last_step), float(last_wall - start)
    if SPS_TAG in tags and ea.Scalars(SPS_TAG):
        run.sps = float(ea.Scalars(SPS_TAG)[-1].value)
    ev = ea.Scalars(tag) if tag in tags else []
    if not ev:
        run.problem = (f"no {tag} events (logged up to step {last_step:,}; "
                       f"{'no scalars at all' if not tags else 'no episode finished'})")
        return run
    run.steps = np.array([e.step for e in ev], dtype=np.int64)
    run.walls = np.array([e.wall_time - start for e in ev], dtype=float)
    run.returns = np.array([e.value for e in ev], dtype=float)
    return run


def find_runs(runs_dirs: Iterable[str], tag: str = RETURN_TAG) -> list:
    """Every run directory directly under the given directories (or given directly)."""
    runs = []
    for d in runs_dirs:
        if parse_run_name(os.path.basename(os.path.normpath(d))) is not None and os.path.isdir(d):
            runs.append(load_run(d, tag))
            continue
        if not os.path.isdir(d):
            runs.append(Run("?", "?", -1, d, problem=f"{d}: no such directory"))
            continue
        for name in sorted(os.listdir(d)):
            if os.path.isdir(os.path.join(d, name)):
                runs.append(load_run(os.path.join(d, name), tag))
    return runs


def select_runs(runs: list, expected: Optional[list] = None) -> tuple:
    """Keep the latest run of each (env, exp, seed); add a placeholder with a problem for each expected
    (env_id, exp_name, seed) that has no run. Returns (runs, notes)."""
    latest, notes = {}, []
    for r in runs:
        k = (r.env_id, r.exp_name, r.seed, r.run_dir if r.seed < 0 else None)
        if k in latest:
            older, newer = sorted([latest[k], r], key=lambda x: x.started)
            notes.append(f"{r.env_id} {r.exp_name} seed {r.seed}: several runs, using {os.path.basename(newer.run_dir)}"
                         f" and ignoring {os.path.basename(older.run_dir)}")
            latest[k] = newer
        else:
            latest[k] = r
    out = list(latest.values())
    for env_id, exp_name, seed in expected or []:
        if not any(r.env_id == env_id and r.exp_name == exp_name and r.seed == seed for r in out):
            out.append(Run(env_id, exp_name, seed, problem="no run directory (the run did not start or wrote "
                                                            "nowhere)"))
    return out, notes


# ---------------------------------------------------------------------------------------------------------
# Reference figures
# ---------------------------------------------------------------------------------------------------------
def load_reference(path: str = REFERENCE_FILE) -> dict:
    with open(path) as f:
        return json.load(f)


def reference_for(env_id: str, reference: dict) -> list:
    """Reference entries for an env id (primary first); a v5 MuJoCo id maps to CleanRL's v4 figures."""
    target = reference.get("aliases", {}).get(env_id, env_id)
    hits = [dict(e, alias=(target != env_id)) for e in reference["entries"] if e["env_id"] == target]
    return sorted(hits, key=lambda e: not e.get("primary", False))


def format_reference(e: dict) -> str:
    std = f" ± {e['std']:,.2f}" if e.get("std") is not None else ""
    env = f" on {e['env_id']}" if e.get("alias") else ""
    return f"{e['mean']:,.2f}{std} at {human_steps(e['steps'])} ({e['label']}{env})"


def human_seconds(s: float) -> str:
    if s != s:
        return "-"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def human_steps(n: float) -> str:
    if n >= 1e6 and n % 1e5 == 0:
        return f"{n / 1e6:g}M"
    if n >= 1e3 and n % 100 == 0:
        return f"{n / 1e3:g}k"
    return f"{int(n):,}"


# ---------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------
def summarise(runs: list, reference: Optional[dict] = None) -> list:
    """One row per (exp_name, env_id): the seeds with data, final return mean ± std (population std over seeds),
    the step count reached, mean wall time and SPS, the seeds without data, and the reference figure."""
    reference = reference if reference is not None else load_reference()
    groups: dict = {}
    for r in runs:
        if r.seed >= 0:
            groups.setdefault(r.key, []).append(r)
    rows = []
    for (exp_name, env_id), rs in sorted(groups.items()):
        ok = sorted((r for r in rs if r.problem is None), key=lambda r: r.seed)
        finals = np.array([r.final_return for r in ok])
        refs = reference_for(env_id, reference)
        rows.append({
            "exp_name": exp_name,
            "env_id": env_id,
            "seeds": [r.seed for r in ok],
            "missing_seeds": sorted(r.seed for r in rs if r.problem is not None),
            "final_per_seed": [float(x) for x in finals],
            "final_mean": float(finals.mean()) if len(ok) else float("nan"),
            "final_std": float(finals.std()) if len(ok) else float("nan"),
            "steps_min": int(min(r.last_step for r in ok)) if ok else 0,
            "steps_max": int(max(r.last_step for r in ok)) if ok else 0,
            "wall_seconds": float(np.mean([r.wall_seconds for r in ok])) if ok else float("nan"),
            "sps": float(np.nanmean([r.sps for r in ok])) if ok and not all(np.isnan(r.sps) for r in ok) else
            float("nan"),
            "reference": refs[0] if refs else None,
            "other_references": refs[1:],
        })
    return rows


def write_runs_csv(path: str, runs: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["env_id", "exp_name", "seed", "final_return", "episodes", "last_step", "wall_seconds", "sps",
                    "run_dir", "problem"])
        for r in sorted(runs, key=lambda r: (r.exp_name, r.env_id, r.seed)):
            w.writerow([r.env_id, r.exp_name, r.seed, f"{r.final_return:.4f}" if r.problem is None else "",
                        len(r.returns), r.last_step, f"{r.wall_seconds:.1f}", f"{r.sps:.0f}",
                        r.run_dir or "", r.problem or ""])


def write_episodes_csv(path: str, runs: list) -> None:  # the curves as numbers: a row per finished episode
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["env_id", "exp_name", "seed", "global_step", "wall_seconds", "episodic_return"])
        for r in sorted(runs, key=lambda r: (r.exp_name, r.env_id, r.seed)):
            w.writerows([r.env_id, r.exp_name, r.seed, int(s), f"{t:.1f}", f"{v:.6g}"]
                        for s, t, v in zip(r.steps, r.walls, r.returns))


def read_episodes_csv(path: str, env_id: str) -> tuple:
    """(global steps, returns) of env_id's episodes in an episodes.csv, every seed's, in step order."""
    with open(path, newline="") as f:
        rows = sorted((int(r["global_step"]), float(r["episodic_return"])) for r in csv.DictReader(f)
                      if r["env_id"] == env_id)
    return [s for s, _ in rows], [v for _, v in rows]


def write_summary_csv(path: str, rows: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["exp_name", "env_id", "seeds", "final_return_mean", "final_return_std", "steps", "wall_seconds",
                    "sps", "missing_seeds", "reference_mean", "reference_std", "reference_steps", "reference_env_id",
                    "reference_source"])
        for row in rows:
            ref = row["reference"] or {}
            w.writerow([row["exp_name"], row["env_id"], " ".join(map(str, row["seeds"])),
                        f"{row['final_mean']:.4f}", f"{row['final_std']:.4f}", row["steps_min"],
                        f"{row['wall_seconds']:.1f}", f"{row['sps']:.0f}", " ".join(map(str, row["missing_seeds"])),
                        ref.get("mean", ""), ref.get("std", ""), ref.get("steps", ""), ref.get("env_id", ""),
                        f"{ref['source']} <{ref['url']}>" if ref else ""])


def markdown_table(rows: list) -> str:
    lines = [f"| experiment | env | seeds | steps | {FINAL_HEADER} | published reference | SPS | wall time |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["seeds"]:
            final = f"{row['final_mean']:,.2f} ± {row['final_std']:,.2f}"
            steps = human_steps(row["steps_min"]) + ("" if row["steps_min"] == row["steps_max"] else
                                                     f"–{human_steps(row['steps_max'])}")
        else:
            final, steps = "**no data**", "-"
        seeds = ", ".join(map(str, row["seeds"])) or "none"
        if row["missing_seeds"]:
            seeds += f" (**no data: seed {', '.join(map(str, row['missing_seeds']))}**)"
        refs = [row["reference"]] + row["other_references"] if row["reference"] else []
        ref = "; ".join(format_reference(e) for e in refs) or "-"
        sps = f"{row['sps']:,.0f}" if row["sps"] == row["sps"] else "-"
        wall = human_seconds(row["wall_seconds"])
        lines.append(f"| {row['exp_name']} | {row['env_id']} | {seeds} | {steps} | {final} | {ref} | {sps} | {wall} |")
    return "\n".join(lines) + "\n"


def problems_markdown(runs: list, notes: list) -> str:
    bad = [r for r in runs if r.problem is not None]
    out = ""
    if bad:
        out += "\n**Runs without data (not included in the means):**\n\n"
        for r in sorted(bad, key=lambda r: (r.exp_name, r.env_id, r.seed)):
            where = f" ({r.run_dir})" if r.run_dir else ""
            who = f"{r.env_id} {r.exp_name} seed {r.seed}" if r.seed >= 0 else "?"
            out += f"- {who}{where}: {r.problem}\n"
    if notes:
        out += "\n" + "".join(f"- note: {n}\n" for n in notes)
    return out


def sources_markdown(rows: list) -> str:
    by_source: dict = {}
    for row in rows:
        for e in ([row["reference"]] if row["reference"] else []) + row["other_references"]:
            envs = by_source.setdefault((e["label"], e["source"], e["url"]), [])
            if e["env_id"] not in envs:
                envs.append(e["env_id"])
    lines = [f"- {label} ({', '.join(envs)}): {source}, <{url}>" for (label, source, url), envs in by_source.items()]
    return ("\nReference sources:\n\n" + "\n".join(lines) + "\n") if lines else ""


# ---------------------------------------------------------------------------------------------------------
# Learning curves
# ---------------------------------------------------------------------------------------------------------
def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far)."""
    c = np.cumsum(np.insert(np.asarray(y, dtype=float), 0, 0.0))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def mean_band(xs: list, ys: list, points: int = 200):
    """Resample each seed's smoothed curve on a common grid up to the shortest seed; mean and std over seeds."""
    end = min(float(x[-1]) for x in xs)
    start = max(float(x[0]) for x in xs)
    grid = np.linspace(start, end, points) if end > start else np.array([end])
    curves = []
    for x, y in zip(xs, ys):
        order = np.argsort(x, kind="stable")
        x, y = np.asarray(x)[order], np.asarray(y)[order]
        curves.append(np.interp(grid, x, smooth(y, max(1, len(y) // 20))))
    curves = np.array(curves)
    return grid, curves.mean(0), curves.std(0)


def plot_curves(runs: list, path_steps: str, path_time: str, reference: Optional[dict] = None) -> list:
    """One subplot per env, one line per experiment (mean over seeds, ±std band): x = global step in one figure,
    x = wall time in the other. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = reference if reference is not None else load_reference()
    ok = [r for r in runs if r.problem is None and len(r.returns)]
    envs = sorted({r.env_id for r in ok})
    exps = sorted({r.exp_name for r in ok})
    if not envs:
        return []
    colors = {e: f"C{i % 10}" for i, e in enumerate(exps)}
    longest = max(float(r.walls.max()) for r in ok)
    unit, scale = ("seconds", 1.0) if longest < 180 else ("minutes", 60.0) if longest < 3 * 3600 else ("hours", 3600.0)
    written = []
    for path, xkey, xlabel in ((path_steps, "steps", "global step"), (path_time, "walls", f"wall time ({unit})")):
        ncols = min(3, len(envs))
        nrows = (len(envs) + ncols - 1) // ncols
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
        for ax, env in zip(axes.flat, envs):
            for exp in exps:
                rs = [r for r in ok if r.env_id == env and r.exp_name == exp]
                if not rs:
                    continue
                xs = [getattr(r, xkey) / (scale if xkey == "walls" else 1.0) for r in rs]
                grid, mean, std = mean_band(xs, [r.returns for r in rs])
                ax.plot(grid, mean, color=colors[exp], label=f"{exp} ({len(rs)} seed{'s' * (len(rs) > 1)})")
                if len(rs) > 1:
                    ax.fill_between(grid, mean - std, mean + std, color=colors[exp], alpha=0.2, linewidth=0)
            refs = reference_for(env, reference)
            if refs and xkey == "steps":
                e = refs[0]
                ax.axhline(e["mean"], color="0.4", linestyle="--", linewidth=1,
                           label=f"{e['label']}{' (' + e['env_id'] + ')' if e['alias'] else ''} at "
                                 f"{human_steps(e['steps'])}")
            ax.set_title(env)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("episodic return")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        for ax in list(axes.flat)[len(envs):]:
            ax.set_visible(False)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------------------
# The whole report
# ---------------------------------------------------------------------------------------------------------
def build_report(runs_dirs: list, out_dir: str, expected: Optional[list] = None, header: str = "",
                 title: str = "Results", runs: Optional[list] = None, tag: str = RETURN_TAG) -> tuple:
    """Read the runs, write runs.csv, summary.csv, episodes.csv, report.md and the curves' PNGs in out_dir.
    Returns (markdown text, ok) where ok is False when any run (found or expected) has no data."""
    reference = load_reference()
    runs = runs if runs is not None else find_runs(runs_dirs, tag)
    runs, notes = select_runs(runs, expected)
    os.makedirs(out_dir, exist_ok=True)
    rows = summarise(runs, reference)
    write_runs_csv(os.path.join(out_dir, "runs.csv"), runs)
    write_summary_csv(os.path.join(out_dir, "summary.csv"), rows)
    write_episodes_csv(os.path.join(out_dir, "episodes.csv"), runs)
    pngs = plot_curves(runs, os.path.join(out_dir, "curves_steps.png"), os.path.join(out_dir, "curves_time.png"),
                       reference)
    md = f"## {title}\n\n{header}\n" if header else f"## {title}\n\n"
    md += markdown_table(rows) if rows else "**No runs found.**\n"
    md += problems_markdown(runs, notes)
    md += sources_markdown(rows)
    md += "".join(f"\n![{os.path.basename(p)}]({os.path.basename(p)})\n" for p in pngs)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(md)
    ok = bool(rows) and all(r.problem is None for r in runs)
    return md, ok


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs_dirs", nargs="+", help="directories holding run directories (or run directories)")
    p.add_argument("--out", required=True, help="where to write report.md, the CSVs and the PNGs")
    p.add_argument("--title", default="Results")
    p.add_argument("--tag", default=RETURN_TAG,
                   help=f"scalar tag of the return (default {RETURN_TAG}; e.g. rollout/reward_mean for ppo_llm.py)")
    args = p.parse_args(argv)
    md, ok = build_report(args.runs_dirs, args.out, title=args.title, tag=args.tag)
    print(md)
    print(f"written to {args.out}/ (report.md, runs.csv, summary.csv, episodes.csv, curves_steps.png, "
          "curves_time.png)")
    if not ok:
        print("error: some runs have no data (listed above)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
