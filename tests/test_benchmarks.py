"""Tests of the benchmark tools on small synthetic tensorboard event files written here (no RL training)."""

import csv
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import report  # noqa: E402
import speed  # noqa: E402
import common  # noqa: E402

# Writes event files with tensorboard's own writer (no torch import: fast in the fake scripts too)
WRITER = textwrap.dedent("""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    def write_events(run_dir, scalars):
        '''scalars: (tag, step, value, wall_time) tuples.'''
        w = EventFileWriter(run_dir)
        for tag, step, value, wall in scalars:
            w.add_event(Event(wall_time=wall, step=step,
                              summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])))
        w.close()
""")
exec(WRITER)


def make_run(runs_dir, env_id, exp, seed, episodes, total_steps, t0=None, sps_every=100):
    """A run directory with episodic returns [(step, value)], one SPS event every sps_every steps (1 s apart per
    100 steps), named as the scripts name them."""
    t0 = time.time() if t0 is None else t0
    run_dir = os.path.join(runs_dir, f"{env_id}__{exp}__{seed}__{int(t0)}")
    scalars = [("charts/episodic_return", s, v, t0 + s / 100) for s, v in episodes]
    scalars += [("charts/SPS", s, 100.0, t0 + s / 100) for s in range(sps_every, total_steps + 1, sps_every)]
    write_events(run_dir, sorted(scalars, key=lambda x: x[1]))  # noqa: F821 (defined by exec above)
    return run_dir


def expected_final(episodes, last_step):
    """The definition, written plainly: mean return of the episodes that end in the last 10% of the steps."""
    vals = [v for s, v in episodes if s >= 0.9 * last_step]
    return sum(vals) / len(vals)


def seed_episodes(seed, total=1000):
    rng = np.random.default_rng(seed)
    return [(s, float(s / 10 + seed * 7 + rng.integers(0, 5))) for s in range(20, total + 1, 20)]


def test_parse_run_name():
    assert report.parse_run_name("HalfCheetah-v5__ppo_continuous__3__1700000000") == (
        "HalfCheetah-v5", "ppo_continuous", 3, 1700000000)
    assert report.parse_run_name("Breakout-v5__my__exp__12__5") == ("Breakout-v5", "my__exp", 12, 5)
    assert report.parse_run_name("videos") is None
    assert report.parse_run_name("a__b__c__d") is None


def test_final_return_window():
    steps = np.array([100, 850, 900, 950, 1000])
    rets = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert report.final_return(steps, rets, 1000) == pytest.approx(4.0)  # steps 900, 950, 1000
    assert report.final_return(steps[:2], rets[:2], 1000) == 2.0  # nothing in the window: the last episode
    assert np.isnan(report.final_return([], [], 1000))


def test_report_tables_csv_and_png(tmp_path):
    runs_dir = tmp_path / "runs"
    truth = {}
    for env_id, scale in (("CartPole-v1", 1.0), ("HalfCheetah-v5", 3.0)):
        for seed in (1, 2, 3):
            eps = [(s, v * scale) for s, v in seed_episodes(seed)]
            make_run(str(runs_dir), env_id, "ppo", seed, eps, total_steps=1000)
            truth.setdefault(env_id, []).append(expected_final(eps, 1000))
    out = tmp_path / "out"
    md, ok = report.build_report([str(runs_dir)], str(out), title="synthetic")
    assert ok
    for env_id, finals in truth.items():
        mean, std = np.mean(finals), np.std(finals)
        assert f"| ppo | {env_id} | 1, 2, 3 | 1k | {mean:,.2f} ± {std:,.2f} |" in md
    assert "last 10% of steps" in md
    assert "490.04 ± 6.12 at 500k (CleanRL ppo.py)" in md
    assert "1,442.64 ± 46.03 at 1M (CleanRL ppo_continuous_action.py on HalfCheetah-v4)" in md
    assert "docs.cleanrl.dev" in md
    with open(out / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and all(r["problem"] == "" for r in rows)
    cp = [r for r in rows if r["env_id"] == "CartPole-v1" and r["seed"] == "2"][0]
    assert float(cp["final_return"]) == pytest.approx(truth["CartPole-v1"][1], abs=1e-3)
    assert cp["last_step"] == "1000" and cp["episodes"] == "50"
    with open(out / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert [s["env_id"] for s in summary] == ["CartPole-v1", "HalfCheetah-v5"]
    assert summary[1]["reference_mean"] == "1442.64" and summary[1]["reference_env_id"] == "HalfCheetah-v4"
    # episodes.csv: every finished episode, each seed's (the curves as numbers); read back per env in step order
    steps, returns = report.read_episodes_csv(str(out / "episodes.csv"), "HalfCheetah-v5")
    assert list(zip(steps, returns)) == sorted((s, v * 3.0) for seed in (1, 2, 3) for s, v in seed_episodes(seed))
    for name in ("curves_steps.png", "curves_time.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert (out / "report.md").read_text() == md


def test_other_return_tag(tmp_path):
    run_dir = make_run(str(tmp_path), "addition", "ppo_llm", 1, [(100, 1.0)], total_steps=500)
    run = report.load_run(run_dir, tag="charts/SPS")  # e.g. rollout/reward_mean for ppo_llm.py
    assert run.problem is None and run.final_return == 100.0 and len(run.returns) == 5
    assert report.load_run(run_dir).final_return == 1.0


def test_mean_band_resamples_seeds():
    x1, y1 = np.array([0, 10, 20]), np.array([0.0, 10.0, 20.0])
    x2, y2 = np.array([0, 20, 30]), np.array([2.0, 22.0, 99.0])  # other x: interpolated onto the grid
    grid, mean, std = report.mean_band([x1, x2], [y1, y2], points=5)
    assert list(grid) == [0, 5, 10, 15, 20]  # up to the shortest seed
    assert list(mean) == pytest.approx([1.0, 6.0, 11.0, 16.0, 21.0]) and list(std) == pytest.approx([1.0] * 5)


def test_missing_and_empty_runs_are_reported(tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    make_run(str(runs_dir), "CartPole-v1", "ppo", 1, seed_episodes(1), 1000)
    make_run(str(runs_dir), "CartPole-v1", "ppo", 2, [], 1000)  # SPS only: no episode finished
    os.makedirs(runs_dir / "CartPole-v1__ppo__4__1700000000")  # a directory with no event file
    expected = [("CartPole-v1", "ppo", s) for s in (1, 2, 3, 4)]
    md, ok = report.build_report([str(runs_dir)], str(tmp_path / "out"), expected=expected)
    assert not ok
    assert "no data: seed 2, 3, 4" in md
    assert "CartPole-v1 ppo seed 2" in md and "no charts/episodic_return events" in md
    assert "CartPole-v1 ppo seed 3: no run directory" in md
    assert "CartPole-v1 ppo seed 4" in md and "no tensorboard event file" in md
    # the mean covers seed 1 only, and says so
    assert f"| ppo | CartPole-v1 | 1 (**no data" in md
    with open(tmp_path / "out" / "runs.csv") as f:
        rows = {r["seed"]: r for r in csv.DictReader(f)}
    assert rows["1"]["problem"] == "" and rows["3"]["problem"].startswith("no run directory")
    # the command line says it too, with exit code 1
    assert report.main([str(runs_dir), "--out", str(tmp_path / "out2")]) == 1
    assert "some runs have no data" in capsys.readouterr().err
    # and an empty runs directory is not a success
    os.makedirs(tmp_path / "empty")
    md, ok = report.build_report([str(tmp_path / "empty")], str(tmp_path / "out3"))
    assert not ok and "No runs found" in md


FAKE_SCRIPT = WRITER + textwrap.dedent("""
    import argparse, dataclasses, os, sys, time

    @dataclasses.dataclass
    class Args:  # read by speed.py for the default env and batch (1 env x 100 steps per iteration, as below)
        env_id: str = "CartPole-v1"
        num_envs: int = 1
        num_steps: int = 100

    def main():
      p = argparse.ArgumentParser()
      p.add_argument("--env-id"); p.add_argument("--seed", type=int, default=1); p.add_argument("--exp-name")
      p.add_argument("--runs-dir"); p.add_argument("--total-timesteps", type=int, default=800)
      p.add_argument("--fail", action="store_true")
      for f in ("--compile", "--cudagraphs", "--cuda"):
          p.add_argument(f, action=argparse.BooleanOptionalAction)
      a = p.parse_args()
      if a.env_id == "Broken-v0":
          print("error: cannot make 'Broken-v0'", file=sys.stderr); sys.exit(2)
      run_dir = os.path.join(a.runs_dir, f"{a.env_id}__{a.exp_name}__{a.seed}__{int(time.time())}")
      t0 = time.time()
      n_iter = a.total_timesteps // 100
      scalars = []
      for i in range(1, n_iter + 1):
          step = i * 100
          # iteration 1 "compiles" for 5 s, then 100 steps per 0.1 s: 1000 SPS after warm-up
          wall = t0 + 5.0 + (i - 1) * 0.1
          scalars.append(("charts/SPS", step, 1.0, wall))
          scalars.append(("charts/episodic_return", step, float(a.seed * 10 + i), wall))
          print(f"iter {i}/{n_iter}  global_step={step}  SPS=1000  return(last 20)=1.0", flush=True)
          time.sleep(0.05)
          if a.fail and i == 3:
              write_events(run_dir, scalars)
              print("error: non-finite loss", file=sys.stderr); sys.exit(1)
      write_events(run_dir, scalars)

    if __name__ == '__main__':
        main()
""")


@pytest.fixture
def fake_script(tmp_path):
    path = tmp_path / "fake_ppo.py"
    path.write_text(FAKE_SCRIPT)
    return str(path)


def test_reproduce_runs_seeds_in_parallel_and_reports(tmp_path, fake_script):
    out = tmp_path / "res"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "reproduce.py"), "--script", fake_script,
           "--env-ids", "CartPole-v1", "Broken-v0", "--seeds", "1", "2", "--out", str(out), "--every", "0.1",
           "--jobs", "2", "--", "--total-timesteps", "800"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr  # Broken-v0 failed
    assert "run Broken-v0 seed 1 failed with exit code 2" in p.stderr
    assert "error: cannot make 'Broken-v0'" in p.stderr  # the log tail
    # progress: which run, its step, an ETA
    assert any("CartPole-v1 seed" in ln and "step " in ln and "/800" in ln and "ETA" in ln
               for ln in p.stdout.splitlines()), p.stdout
    md = (out / "report.md").read_text()
    expected = np.mean([expected_final([(i * 100, s * 10 + i) for i in range(1, 9)], 800) for s in (1, 2)])
    assert f"| fake_ppo | CartPole-v1 | 1, 2 | 800 | {expected:,.2f} ± 5.00 |" in md
    assert "Broken-v0 fake_ppo seed 1: process exited with code 2" in md
    assert "- command: `python benchmarks/reproduce.py --script" in md and "- versions: python" in md
    meta = json.loads((out / "meta.json").read_text())
    assert meta["seeds"] == [1, 2] and meta["machine"]["cores"] >= 1
    assert (out / "curves_steps.png").exists() and (out / "logs" / "Broken-v0__2.log").exists()


def test_reproduce_flags_partial_run_and_bad_args(tmp_path, fake_script):
    out = tmp_path / "res"
    base = [sys.executable, os.path.join(ROOT, "benchmarks", "reproduce.py"), "--script", fake_script,
            "--env-ids", "CartPole-v1", "--seeds", "1", "--out", str(out)]
    p = subprocess.run(base + ["--", "--fail"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "process exited with code 1 at step 300" in (out / "report.md").read_text()
    p = subprocess.run(base + ["--total-timesteps", "1.5"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: --total-timesteps")
    p = subprocess.run(base + ["--", "--seed", "3"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--seed is set by reproduce.py" in p.stderr


def test_sps_after_warmup():
    steps = [100, 200, 300, 400, 500]
    walls = [10.0, 11.0, 11.5, 12.0, 12.5]  # iteration 1 is slow (compilation)
    assert speed.sps_after_warmup(steps, walls, 1) == pytest.approx(400 / 2.5)  # from the end of iteration 1
    assert speed.sps_after_warmup(steps, walls, 3) == pytest.approx(200 / 1.0)
    with pytest.raises(ValueError, match="only 5 iterations"):
        speed.sps_after_warmup(steps, walls, 5)


def test_speed_tool_end_to_end(tmp_path, fake_script):
    out = tmp_path / "speed"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "speed.py"), "--scripts", fake_script,
           "--env-ids", "CartPole-v1", "--devices", "cpu", "--paths", "eager", "compile", "cudagraphs",
           "--total-timesteps", "600", "--raw-seconds", "0.2", "--warmup-iters", "2", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "speed.json").read_text())
    assert data["raw_env"]["fake_ppo.py"]["sps"] > 1000
    by_path = {r["path"]: r for r in data["runs"]}
    assert by_path["eager"]["sps"] == pytest.approx(1000, rel=1e-6)  # the 5 s of "compilation" excluded
    assert by_path["cudagraphs"]["skipped"] == "CUDA graphs need CUDA"
    md = (tmp_path / "speed.md").read_text()
    assert "| fake_ppo.py | CartPole-v1 | 1 | cpu | compile | 1,000 | 1.00× | 1.00× |" in md
    assert "raw env, random actions (gymnasium SyncVectorEnv)" in md
    assert "skipped: CUDA graphs need CUDA" in md


def test_speed_refuses_runs_too_short_for_the_warm_up_before_running(tmp_path, fake_script):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "speed.py"), "--scripts", fake_script, "--devices", "cpu",
           "--paths", "eager", "--total-timesteps", "300", "--raw-seconds", "0.2", "--warmup-iters", "2", "--out",
           str(tmp_path / "speed")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "at least --warmup-iters + 2 = 4" in p.stderr, p.stderr
    assert not (tmp_path / "speed.json").exists()


def test_script_defaults_leave_the_environment_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEED_TEST_VAR", raising=False)
    path = tmp_path / "sets_env.py"
    path.write_text("import dataclasses, os\nos.environ['SPEED_TEST_VAR'] = '1'\n\n@dataclasses.dataclass\n"
                    "class Args:\n    num_envs: int = 3\n")
    assert speed.script_defaults(str(path)) == {"num_envs": 3}
    assert "SPEED_TEST_VAR" not in os.environ  # (it would reach every timed run of the other scripts)


def test_run_jobs_kills_a_job_past_its_timeout(tmp_path):
    job = common.Job("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "log"))
    t0 = time.time()
    common.run_jobs([job], 1, every=100, timeout=1.0, out=open(os.devnull, "w"))
    assert job.rc is not None and job.rc < 0 and time.time() - t0 < 30


def test_progress_line_parsing():
    job = common.Job("x", [], "/dev/null")
    job.start = time.time() - 10
    job.feed("iter 5/20  global_step=2560  SPS=1200  return(last 20)=30.1  approx_kl=0.0100\n")
    assert (job.iteration, job.num_iterations, job.global_step, job.sps) == (5, 20, 2560, 1200)
    assert job.total_steps == 10240
    assert "2,560/10,240 (25%)" in job.status()
    assert common.eta([job], 0, 1, time.time()) == pytest.approx(30, abs=1)  # a quarter in 10 s: 30 s to go
    assert common.eta([job], 2, 1, time.time()) == pytest.approx(110, abs=1)  # + two queued of 40 s, one slot
    job.feed("iter 3/10  reward=0.5\n")  # ppo_llm.py style: iterations only
    assert job.global_step == 0 and "iter 3/10" in job.status()


def test_llm_throughput_names_the_precision_of_its_runs():
    import llm_throughput  # (benchmarks/ is on the path)

    label = llm_throughput.precision_label
    assert label(True, []) == "CUDA bf16 autocast" and label(False, []) == "CPU fp32"
    assert label(True, ["--precision", "fp32"]) == "CUDA fp32"
    assert label(False, ["--precision=bf16"]) == "CPU bf16 autocast"


def test_llm_decode_profile_on_the_cpu_and_gpu_checks_reader(tmp_path):
    """benchmarks/llm_decode_profile.py at tiny sizes on the CPU (ops for kernels, no graph; a check of the tool): its
    JSON holds the uncaptured step's time and ops per step, more of them with deterministic algorithms on (their fills
    of fresh memory); gpu_check's reader wants the captured step's time, which only CUDA gives."""
    import gpu_check

    prefix = str(tmp_path / "prof")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "llm_decode_profile.py"), "--preset", "tiny",
                        "--device", "cpu", "--batch", "2", "--vocab-size", "512", "--out", prefix],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    data = json.load(open(prefix + ".json"))
    r = data["result"]
    assert r["ms_per_step"] is None and r["ms_per_step_uncaptured"] > 0 and r["gpu_ms_per_step"] > 0
    assert 0 < r["kernels_per_step"] < r["kernels_per_step_deterministic"], r
    assert "aten::mm" in data["kernels"] and "| op | per step |" in open(prefix + ".md").read()
    with pytest.raises(ValueError, match="no step figures"):
        gpu_check.read_decode_profile(prefix)(None, "")
    data["result"]["ms_per_step"] = 1.5
    json.dump(data, open(prefix + ".json", "w"))
    fig = gpu_check.read_decode_profile(prefix)(None, "")
    assert fig["ms_per_step"] == 1.5 and fig["top_kernel"] in data["kernels"]


def test_llm_throughput_tool_says_bad_sizes_in_one_line():
    """Bad sizes are one line, exit 2, before a model is built (its run on a tiny model: test_ppo_llm.py's
    test_the_throughput_benchmark_writes_its_contract)."""
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "llm_throughput.py"), "--hidden", "100"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "multiple of 64" in bad.stderr
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "llm_throughput.py"), "--rollout-batch-size",
                          "8", "--n", "2", "--micro-batch-size", "16"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must divide a minibatch's 8 responses" in bad.stderr  # before building a model
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "llm_throughput.py"), "--micro-batch-size",
                          "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--micro-batch-size must be positive" in bad.stderr


def test_llm_throughput_keeps_each_run_as_it_comes(tmp_path, monkeypatch):
    """PREFIX.json and .md are written after every ppo_llm run: a benchmark stopped at a time limit (here: at its
    second run) keeps the rows it measured, and one stopped before its first row leaves no earlier run's report.
    Figures: medians over the iterations after the first; with --no-side-by-side, no Hugging Face generation (its
    columns empty)."""
    import llm_throughput

    side = []
    monkeypatch.setattr(llm_throughput, "build_model_dir", lambda path, *a: 1_000_000)
    monkeypatch.setattr(llm_throughput, "side_by_side", lambda *a, **k: side.append(a) or {"ours": 9.0, "hf": 8.0})
    monkeypatch.setattr(llm_throughput, "read_scalars", lambda run_dir, tags: {
        "perf/gen_tokens_per_s": [1.0, 10.0, 14.0, 11.0], "perf/train_tokens_per_s": [1.0, 5.0, 7.0, 6.0],
        "response/length_mean": [2.0, 4.0, 4.0, 6.0]})
    calls = []

    def fake_run(cmd):
        calls.append(cmd)
        if len(calls) == 2:
            raise KeyboardInterrupt  # (the limit's signal, during the second run)
        os.makedirs(os.path.join(cmd[cmd.index("--runs-dir") + 1], "run"))
        return 0, "", "", 3 * 2**29

    monkeypatch.setattr(llm_throughput, "run_child", fake_run)
    prefix = str(tmp_path / "llm")
    argv = ["--estimators", "gae", "grpo", "--paths", "compile", "--out", prefix]
    (tmp_path / "llm.json").write_text('{"rows": [{"estimator": "old"}]}')  # an earlier run's: removed at the start
    calls.append("(the first run is stopped)")
    with pytest.raises(KeyboardInterrupt):
        llm_throughput.main(argv + ["--no-side-by-side"])
    assert not (tmp_path / "llm.json").exists() and not (tmp_path / "llm.md").exists()
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        llm_throughput.main(argv + ["--no-side-by-side"])
    data = json.loads((tmp_path / "llm.json").read_text())
    assert [(r["estimator"], r["path"]) for r in data["rows"]] == [("gae", "compile")] and not side
    row = data["results"]["gae"]["compile"]
    assert (row["gen_tokens_per_s"], row["train_tokens_per_s"], row["response_length_mean"]) == (11.0, 6.0, 4.0)
    assert row["hf_generate_tokens_per_s"] is None and "--compile" in calls[0]
    assert "| gae | compile | 11 | 6 |  | 1.50 |" in (tmp_path / "llm.md").read_text() and row["peak_rss_gib"] == 1.5
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        llm_throughput.main(argv)
    assert len(side) == 1 and json.loads((tmp_path / "llm.json").read_text())["results"]["gae"]["compile"][
        "hf_generate_tokens_per_s"] == 8.0


def test_run_child_echoes_the_childs_lines_while_it_runs(tmp_path, capsys):
    """llm_throughput.run_child prints the child's stdout lines (indented) as they come, so that a run stopped at a
    time limit shows how far it got, and returns its exit code, stdout, stderr and peak memory. The child waits (5 s at
    most) for a file that the test writes only once the child's first line has been printed."""
    import threading

    import llm_throughput
    go = tmp_path / "go"
    child = textwrap.dedent(f"""
        import os, sys, time
        print("iter 1", flush=True)
        for _ in range(100):
            if os.path.exists({str(go)!r}):
                break
            time.sleep(0.05)
        print("iter 2, go", os.path.exists({str(go)!r}))
        sys.stderr.write("failed\\n")
        sys.exit(3)""")
    result = []
    runner = threading.Thread(target=lambda: result.append(llm_throughput.run_child([sys.executable, "-c", child])))
    runner.start()
    seen = ""
    for _ in range(200):
        seen += capsys.readouterr().out
        if "    iter 1\n" in seen:
            break
        time.sleep(0.05)
    go.touch()
    runner.join()
    seen += capsys.readouterr().out
    assert seen == "    iter 1\n    iter 2, go True\n"  # (echoed at the end only, the child would wait in vain)
    assert result == [(3, "iter 1\niter 2, go True\n", "failed\n", result[0][3])] and result[0][3] > 0


def test_scaling_efficiency_arithmetic_and_a_two_process_run(tmp_path):
    import scaling

    rows = scaling.efficiency_rows([{"nproc": 1, "sps": 100.0}, {"nproc": 2, "sps": 150.0}, {"nproc": 4, "error": "x"}])
    assert rows[1]["speedup"] == pytest.approx(1.5) and rows[1]["efficiency"] == pytest.approx(0.75)
    assert "speedup" not in rows[2]
    assert scaling.command("s.py", 1, 10, "r", [])[1:] == ["s.py", "--total-timesteps", "10", "--runs-dir", "r"]
    assert "--nproc-per-node" in scaling.command("s.py", 2, 10, "r", [])
    out = tmp_path / "sc"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scaling.py"), "--script", "ppo.py",
                          "--nprocs", "1", "2", "--iterations", "4", "--warmup-iters", "1", "--out", str(out), "--",
                          "--num-steps", "32"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads((tmp_path / "sc.json").read_text())
    assert [r["nproc"] for r in data["rows"]] == [1, 2] and all(r["sps"] > 0 for r in data["rows"])
    assert "| 2 | 8 |" in (tmp_path / "sc.md").read_text()
