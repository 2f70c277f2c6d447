"""benchmarks/gpu_check.py without a GPU: its dry run end to end (five stages in order, each ok or skipped with a
reason, a table row per command), its pure helpers against hand computations, and the command lines of
tests/test_gpu.py with --no-cuda (every flag known to its script, one of them run) so that they cannot rot here."""

import csv
import json
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import gpu_check  # noqa: E402
import test_gpu  # noqa: E402  (its command builders; its tests stay in their own module)

@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    t0 = time.time()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run", "--minutes", "2",
                        "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=400,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seconds = time.time() - t0
    assert (out / "gpu_check.json").is_file(), p.stdout[-3000:] + p.stderr[-3000:]
    with open(out / "gpu_check.json") as f:
        data = json.load(f)
    return p, data, (out / "gpu_check.md").read_text(), out, seconds


def test_dry_run_runs_the_five_stages_in_order(dry_run):
    p, data, _, _, seconds = dry_run
    assert data["dry_run"] is True
    assert [(s["number"], s["name"]) for s in data["stages"]] == list(gpu_check.STAGES.items())
    for st in data["stages"]:
        failed = {i["name"] for i in st["items"] if i["status"] == "failed"}
        assert not failed, (st["name"], [(i["name"], i.get("reason")) for i in st["items"]], p.stdout[-3000:])
        assert st["status"] in ("ok", "skipped"), st
        if st["status"] == "skipped":
            assert st.get("reason"), st
        for it in st["items"]:
            assert it["status"] in ("ok", "skipped", "failed"), it
            if it["status"] != "ok":
                assert it.get("reason"), it
            assert isinstance(it["seconds"], (int, float)) and it["command"], it
    assert p.returncode == 0, p.stderr[-2000:]  # (1 when a stage failed)
    assert "stage 5 breakout" in p.stdout and "written:" in p.stdout
    print(f"dry run: {seconds:.0f} s")  # (-s shows it; about a minute on 2 idle cores)


def test_dry_run_skips_cuda_only_commands_but_shows_them(dry_run):
    _, data, _, _, _ = dry_run
    items = {i["name"]: i for s in data["stages"] for i in s["items"]}
    for name in ("compile_warmup", "ours_compile_cudagraphs", "ppo_cuda", "ppo_continuous_cuda"):
        assert items[name]["status"] == "skipped" and items[name]["reason"] == "needs CUDA", items[name]
    assert "--cudagraphs" in items["ours_compile_cudagraphs"]["command"]
    # the command as typed: no path, device or size flag (its defaults; stopped at its time limit on the GPU)
    assert items["ours_default"]["status"] == "skipped" and "dry run" in items["ours_default"]["reason"]
    assert re.fullmatch(r"(OMP_NUM_THREADS=1 )?python ppo_atari_envpool\.py --exp-name ours_default --runs-dir \S+",
                        items["ours_default"]["command"]), items["ours_default"]["command"]
    assert "--no-compile" in items["ours_eager"]["command"] and "--no-cudagraphs" in items["ours_eager"]["command"]
    assert not re.search(r"--(no-)?(compile|cudagraphs)\b", items["breakout_learning"]["command"])  # its default
    assert "ours_hand_captured" not in items and "capture_trial" not in json.dumps(data)
    assert items["compile_warmup"]["command"].count("--compile") >= 2  # ours (LeanRL's two where tensordict is)
    assert items["ours_eager"]["status"] == "ok" and items["ours_eager"]["figures"]["sps"] > 0
    assert items["ppo_cpu"]["status"] == "ok" and items["ppo_cpu"]["figures"]["sps"] > 0
    assert items["ppo_llm_20_iterations"]["status"] == "ok"
    # stage 3's decoding side by side and one iteration at ROLL's lengths (tiny sizes here), with their figures
    decode, roll = items["llm_decode"]["figures"], items["llm_roll_lengths"]["figures"]
    assert decode["tokens_per_s"] > 0 and decode["x_hf_generate"] == decode["tokens_per_s"] / decode[
        "hf_generate_tokens_per_s"] and "--decode-only" in items["llm_decode"]["command"]
    assert roll["seconds"] > 0 and roll["generation_s"] + roll["scoring_s"] + roll["update_s"] <= roll["seconds"]
    assert "--dry-run" in items["llm_roll_lengths"]["command"] and roll["peak_gib"] is None  # (no GPU)
    assert items["pytest_gpu"]["status"] == "ok" and "skipped" in items["pytest_gpu"]["figures"]["summary"]


def test_the_roll_lengths_benchmark_dry_run_writes_its_figures(dry_run):
    """benchmarks/llm_roll_lengths.py --dry-run, as stage 3 of the dry run ran it (ROLL's lengths on a GPU; tiny sizes
    on the CPU here): one PPO iteration whose seconds, split and memory land in PREFIX.json and PREFIX.md."""
    _, data, _, out, _ = dry_run
    item = next(i for s in data["stages"] for i in s["items"] if i["name"] == "llm_roll_lengths")
    assert item["status"] == "ok", item
    result = json.loads((out / "llm_roll_lengths.json").read_text())["result"]
    assert result["error"] is None and result["peak_gib"] is None and result["peak_rss_gib"] > 0.1
    assert 0 < result["generation_s"] + result["scoring_s"] + result["update_s"] <= result["seconds"]
    assert 1 <= result["response_length_mean"] <= 24
    assert "| iteration (s) |" in (out / "llm_roll_lengths.md").read_text()


def test_dry_run_markdown_has_a_row_per_command(dry_run):
    _, data, md, out, _ = dry_run
    for st in data["stages"]:
        head = f"## Stage {st['number']}: {st['name']} — {st['status']}"
        assert head in md, head
        section = md.split(head, 1)[1].split("\n## ", 1)[0]
        for it in st["items"]:
            row = f"| {it['name']} | {it['status']} | `{it['command'].replace('|', chr(92) + '|')}` |"
            assert row in section, (row, section[:2000])
    assert (out / "stage5_breakout" / "breakout_curve.csv").is_file()
    assert (out / "logs" / "stage2_atari_speed" / "ours_eager.log").is_file()


def test_stage_budget_plan():
    plan = gpu_check.plan_stages(480, [1, 2, 3, 4, 5])
    assert plan == pytest.approx({1: 144, 2: 192, 3: 96, 4: 24, 5: 24})  # the shares of 8 minutes
    plan = gpu_check.plan_stages(100, [1, 3])  # a subset: the shares of the chosen stages, rescaled
    assert plan == pytest.approx({1: 100 * 0.30 / 0.50, 3: 100 * 0.20 / 0.50})
    assert gpu_check.share_of(100, [1, 1, 2]) == pytest.approx(25)
    assert gpu_check.share_of(100, [7]) == 100  # the last one takes what is left
    assert gpu_check.share_of(-5, [1, 1]) == 0
    # time a stage does not use goes to the later ones: stage 1 uses 20 of its 120 s
    left = 480 - 20
    assert gpu_check.share_of(left, [0.40, 0.2, 0.05, 0.05]) == pytest.approx(460 * 0.40 / 0.70)


def test_median_after_warmup():
    assert gpu_check.median_after_warmup([100, 900, 1000, 1100], 1) == 1000
    assert gpu_check.median_after_warmup([100, 900, 1000, 1100, 1300], 1) == pytest.approx(1050)
    with pytest.raises(ValueError):
        gpu_check.median_after_warmup([100, 900], 2)


def test_sps_from_cumulative_readings():
    # 1,000 steps per reading at t = 5, 6, 7, 8 s (a 4 s start-up, then 1,000 steps/s): cumulative 200, 333, 429, 500
    steps, times = [1000, 2000, 3000, 4000], [5.0, 6.0, 7.0, 8.0]
    cum = [s / t for s, t in zip(steps, times)]
    assert gpu_check.sps_from_cumulative(steps, cum, 1) == pytest.approx(1000)
    assert gpu_check.sps_from_cumulative(steps, cum, 0) == pytest.approx(3000 / 3)
    with pytest.raises(ValueError):
        gpu_check.sps_from_cumulative(steps[:2], cum[:2], 1)


def test_cleanrl_sps_from_its_printed_lines(tmp_path):
    """No events (a run stopped before its writer flushed): CleanRL's `SPS: N` lines, one per 1,000-step iteration."""
    read = gpu_check.tb_or_stdout_sps(str(tmp_path / "none"), 1, 1000, "cleanrl")
    text = "global_step=10, episodic_return=1.0\nSPS: 200\nSPS: 333\nSPS: 428\nSPS: 500\n"
    fig = read(None, text)
    assert fig["sps"] == pytest.approx(1000, rel=0.01) and "printed" in fig["source"]
    with pytest.raises(ValueError):
        read(None, "SPS: 200\n")


def test_leanrl_reader_skips_its_first_window():
    read = gpu_check.read_leanrl(1)
    text = "SPS: 900 iteration 10\nSPS: 3600 iteration 20\nSPS: 3800 iteration 30\nSPS: 3700 iteration 40\n"
    assert read(None, text)["sps"] == 3700
    # as it was seen on an H100: tqdm's bar, then the print on the same line
    bar = "speed:  3166.4 sps, returns:  1.30: 97%|#########7| 29/30 [00:16<00:00,  3.01it/s]"
    text = f"{bar}SPS: 3077 iteration 10\n\r{bar}SPS: 3166 iteration 20\n{bar}\rSPS: 3161 iteration 30\nNOT SPS: 5 iteration 1\n"
    assert read(None, text)["sps"] == pytest.approx(3163.5)


def test_stage2_puts_each_run_beside_envpool_alone_cleanrl_and_leanrl_best():
    items = [gpu_check.Item(n, []) for n in ("envpool_alone", "cleanrl", "leanrl_compile_cudagraphs", "ours_default",
                                             "ours_eager", "ours_compile")]
    for item, sps in zip(items, (4000.0, 1000.0, 3200.0, 3600.0, 1600.0, None)):
        item.figures.update({} if sps is None else {"sps": sps})
    figures = gpu_check.stage2_figures(items)
    ours = items[3].figures
    assert (ours["x_envpool_alone"], ours["x_cleanrl"], ours["x_leanrl_best"]) == (0.9, 3.6, 1.125)
    assert items[2].figures["x_leanrl_best"] == 1.0 and "x_leanrl_best" not in items[0].figures
    assert figures == {"sps": {"envpool_alone": 4000.0, "cleanrl": 1000.0, "leanrl_compile_cudagraphs": 3200.0,
                               "ours_default": 3600.0, "ours_eager": 1600.0}, "fastest_of_ours": "default"}
    assert gpu_check.figure_text("ours_default", ours) == (
        "3,600 SPS (0.90× envpool alone, 3.60× CleanRL, 1.12× LeanRL's best)")


def test_bin_curve_and_edges():
    edges = gpu_check.curve_edges(20, bins=2)
    assert edges == [0, 10, 20]
    assert gpu_check.bin_curve([0, 5, 10, 15, 20], [1, 2, 3, 4, 5], edges) == [(1.5, 2), (4.0, 3)]
    assert gpu_check.bin_curve([15], [7.0], edges) == [(None, 0), (7.0, 1)]


def test_the_breakout_curve_sits_beside_the_committed_cpu_curve(tmp_path):
    """Stage 5's CSV: this run's binned returns beside the committed CPU run's, bin by bin at the same steps."""
    steps, returns, note = gpu_check.cpu_curve()
    assert len(steps) > 100 and steps == sorted(steps) and "episodes.csv" in note, note
    ctx = gpu_check.Ctx(out=str(tmp_path), dry=True, anchors="", cuda=False, deadline=time.time() + 60, previous={})
    fig = gpu_check.write_curve(ctx, steps, [r + 1.0 for r in returns], steps[-1])  # "this run": the CPU run + 1
    with open(tmp_path / fig["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 20 and sum(int(r["cpu_episodes"]) for r in rows) == len(steps)
    for r in rows:
        if r["cpu_episodes"] != "0":
            assert float(r["gpu_mean_return"]) == pytest.approx(float(r["cpu_mean_return"]) + 1, abs=2e-3)


def test_pytest_summary_line():
    assert gpu_check.pytest_summary("....\n12 passed, 2 skipped in 31.02s\n") == "12 passed, 2 skipped in 31.02s"
    assert gpu_check.pytest_summary("x\n===== 3 failed, 1 passed in 2.00s =====\n") == "3 failed, 1 passed in 2.00s"
    assert gpu_check.pytest_summary("ssss [100%]\n28 skipped in 5.46s\n") == "28 skipped in 5.46s"
    assert gpu_check.pytest_summary("Traceback ...\n") is None


def test_llm_throughput_rows_and_ppo_llm_evaluations():
    flat = {"runs": [{"estimator": "gae", "path": "eager", "gen_tokens_per_s": 10.0, "train_tokens_per_s": 5.0},
                     {"estimator": "grpo", "path": "compile", "gen_tokens_per_s": 12.0,
                      "hf_generate_tokens_per_s": None}]}  # (None: llm_throughput.py --no-side-by-side)
    assert gpu_check.llm_throughput_rows(flat) == {"gae/eager": {"gen_tokens_per_s": 10.0, "train_tokens_per_s": 5.0},
                                                   "grpo/compile": {"gen_tokens_per_s": 12.0}}
    nested = {"gae": {"eager": {"peak_gpu_mem_gib": 3.5, "hf_generate_tokens_per_s": 7}}}
    assert gpu_check.llm_throughput_rows(nested) == {"gae/eager": {"hf_generate_tokens_per_s": 7,
                                                                   "peak_gpu_mem_gib": 3.5}}
    text = ("eval iter 0: accuracy greedy 0.400  sampled 0.350\niter 1/20 ...\n"
            "eval iter 15: accuracy greedy 0.600  sampled 0.550  pass@1 0.500\neval iter 20: accuracy greedy 0.700  "
            "sampled 0.650\n")
    assert gpu_check.llm_evaluations(text) == [(0, 0.4, 0.35), (15, 0.6, 0.55), (20, 0.7, 0.65)]
    fig = gpu_check.read_ppo_llm(must_learn=True)(None, text)
    assert fig["learned"] is True and fig["last_eval"]["iteration"] == 20
    with pytest.raises(ValueError, match="it must learn"):
        gpu_check.read_ppo_llm(must_learn=True)(None, text.replace("sampled 0.650", "sampled 0.300"))


def help_flags(script: str) -> tuple:
    return script, subprocess.Popen([sys.executable, os.path.join(ROOT, script), "--help"], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def test_gpu_test_command_lines_on_the_cpu(tmp_path):
    """tests/test_gpu.py's command builders with --no-cuda: every flag is one its script knows, and ppo.py's eager
    run with --save-model runs to its end on the CPU, as does the Atari script's run over StatelessGames (stopped with
    its checkpoint)."""
    helps = [help_flags(s) for s in [*test_gpu.SCRIPTS, "ppo_llm.py"]]
    runs = tmp_path / "runs"
    stateless = test_gpu.stateless(test_gpu.default_cmd(tmp_path / "stateless", "cpu") + ["--stop-after", "1"])
    games = subprocess.Popen(stateless, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        cmd = test_gpu.path_cmd("ppo.py", "eager", runs, device="cpu")
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
        text = games.communicate(timeout=300)[0]
    finally:
        games.kill()
    assert games.returncode == 0 and "stopped at iteration 1 " in text, text[-2000:]
    assert test_gpu.checkpoint_in(tmp_path / "stateless")
    known = {}
    for script, h in helps:
        text = h.communicate(timeout=300)[0]
        known[script] = set(re.findall(r"--[a-z0-9][a-z0-9.-]*", text))
        assert len(known[script]) > 20, text[-2000:]
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"iter {test_gpu.ITERATIONS}/{test_gpu.ITERATIONS}" in p.stdout, p.stdout[-2000:]
    ckpt = test_gpu.checkpoint_in(runs)
    built = [test_gpu.path_cmd(s, path, tmp_path, device="cpu") for s in test_gpu.SCRIPTS for path in test_gpu.PATHS]
    built += [test_gpu.stop_cmd(s, tmp_path, d) for s in test_gpu.SCRIPTS for d in ("cuda", "cpu")]
    built += [test_gpu.resume_cmd(s, ckpt, d) for s in test_gpu.SCRIPTS for d in ("cuda", "cpu")]
    built += [test_gpu.llm_stop_cmd(tmp_path, d) for d in ("cuda", "cpu")] + [test_gpu.llm_resume_cmd(ckpt, "cpu")]
    built.append(test_gpu.default_cmd(tmp_path, "cpu"))
    for c in built:
        script = os.path.basename(c[1])
        unknown = [a for a in c[2:] if a.startswith("--") and a not in known[script]]
        assert not unknown, (script, unknown)


def test_a_command_past_its_limit_gets_sigterm_then_its_group_sigkill(tmp_path):
    """The whole process group goes: a child that ignores SIGTERM, and its own child, are killed after the grace."""
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('started', flush=True); "
            "time.sleep(60)")
    item = gpu_check.Item("sleeper", [sys.executable, "-c", code], timeout=1)
    saved = gpu_check.GRACE_S
    gpu_check.GRACE_S = 1.0
    try:
        t0 = time.time()
        text = gpu_check.run_item(item, 1.0, str(tmp_path / "log" / "sleeper.log"), t0, "sleeper")
    finally:
        gpu_check.GRACE_S = saved
    assert item.limited and item.rc == -9 and time.time() - t0 < 15, (item.rc, text)
    assert "started" in text and (tmp_path / "log" / "sleeper.log").read_text().startswith("$ ")


def test_a_rerun_keeps_the_stages_it_does_not_run(tmp_path):
    earlier = {"date": "2026-11-26 10:00 UTC", "dry_run": True,
               "stages": [{"number": 2, "name": "atari_speed", "status": "ok", "seconds": 1.0, "budget_s": 5,
                           "figures": {"sps": {"ours_compile": 3000.0}, "fastest_of_ours": "compile"}, "items": []},
                          {"number": 3, "name": "ppo_llm", "status": "failed", "seconds": 1.0, "items": []}]}
    ctx = gpu_check.Ctx(out=str(tmp_path), dry=True, anchors="", cuda=False, deadline=time.time() + 60,
                        previous=earlier)
    ctx.results[3] = {"number": 3, "name": "ppo_llm", "status": "ok", "seconds": 2.0, "items": [], "figures": {}}
    data = {"command": "x", "date": "d", "dry_run": True, "minutes": 1, "seconds": 1.0,
            "machine": {"device": "cpu", "torch": "t", "cuda": None, "python": "p", "commit": "c"}}
    gpu_check.write_reports(ctx, data)
    with open(tmp_path / "gpu_check.json") as f:
        stages = json.load(f)["stages"]
    assert [(s["number"], s["status"], s.get("kept_from")) for s in stages] == [
        (2, "ok", "2026-11-26 10:00 UTC"), (3, "ok", None)]
    assert "from an earlier run (2026-11-26 10:00 UTC)" in (tmp_path / "gpu_check.md").read_text()
