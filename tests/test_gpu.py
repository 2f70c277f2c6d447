"""Real CUDA runs of the four scripts at tiny sizes (skipped without a GPU): every path of every RL script finishes,
no compiled graph falls back from CUDA graphs, the compiled paths end with the eager path's parameters, and
checkpoints cross between CUDA and the CPU both ways; ppo_llm.py runs in bf16 on CUDA and resumes on the CPU.

    pytest -m gpu -q tests/test_gpu.py        # on a GPU machine; benchmarks/gpu_check.py stage 1 runs this
    pytest -m gpu -q -o addopts= tests/test_gpu.py    # the same without pytest-xdist (pytest.ini's -n 2 needs it)

All the runs start at once (one module fixture: the GPU and 16 cores take them side by side), then the resumes; the
whole file takes a few minutes on one H100. tests/test_gpu_check.py builds the same command lines with --no-cuda and
runs one of them on the CPU, so that these builders cannot rot where there is no GPU.
"""

import glob
import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (--cudagraphs alone is the same path as --compile --cudagraphs: compile_hot_functions reads `compile or cudagraphs`)
PATHS = {"eager": [], "compile": ["--compile"], "compile_cudagraphs": ["--compile", "--cudagraphs"]}
# A few iterations each: 4 iterations of the sizes below (a stop after 2 for the checkpoint tests)
ITERATIONS = 4
TINY = {
    "ppo.py": ["--env-id", "CartPole-v1", "--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2",
               "--update-epochs", "2", "--total-timesteps", str(ITERATIONS * 2 * 32)],
    "ppo_continuous.py": ["--env-id", "Pendulum-v1", "--num-envs", "1", "--num-steps", "64", "--num-minibatches", "2",
                          "--update-epochs", "2", "--total-timesteps", str(ITERATIONS * 64)],
    "ppo_atari_envpool.py": ["--env-id", "Breakout-v5", "--num-envs", "4", "--num-steps", "32", "--num-minibatches",
                             "2", "--update-epochs", "2", "--total-timesteps", str(ITERATIONS * 4 * 32),
                             "--torch-threads", "2"],
}
SCRIPTS = list(TINY)
# What the scripts print when a compiled graph runs without CUDA graphs (ppo*.py: "note: N compiled graph(s) run
# without CUDA graphs"), and torch's own wording of a skip
SKIP_NOTES = ("without cuda graphs", "skipping cudagraphs")
# Paths compared with eager after ITERATIONS iterations (--torch-deterministic; --compile sets inductor's
# fallback_random, so the same actions are sampled): parameters allclose at these tolerances
SAME_AS_EAGER = {"compile": dict(rtol=1e-3, atol=1e-5), "compile_cudagraphs": dict(rtol=1e-3, atol=1e-5)}
# The Atari CNN's compiled kernels round differently from cuDNN's eager ones, and Adam turns a last-bit difference in
# a near-zero gradient into a step of up to about lr: its 16 steps here (2.5e-4 each) can move a weight by 4e-3, and
# 5.8e-5 was seen on an H100. 2e-4 (5 % of those 16 steps) still fails a compiled update that differs in substance.
ATOL = {"ppo_atari_envpool.py": 2e-4}
LLM_TINY = ["--num-iterations", "2"]  # the default task and model; 2 iterations
ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # many compiling processes at once
TIMEOUT_S = 420


def device_flag(device: str) -> str:
    return "--cuda" if device == "cuda" else "--no-cuda"


def path_cmd(script: str, path: str, runs_dir, device: str = "cuda") -> list:
    """A tiny run of an RL script in one path, with a checkpoint at the end (--save-model)."""
    return [sys.executable, os.path.join(REPO, script), *TINY[script], *PATHS[path], device_flag(device),
            "--torch-deterministic", "--save-model", "--exp-name", f"{script[:-3]}_{path}", "--runs-dir",
            str(runs_dir)]


def trial_cmd(runs_dir, device: str = "cuda") -> list:
    """benchmarks/capture_trial.py: the Atari script's --compile --cudagraphs with each function captured whole."""
    cmd = path_cmd("ppo_atari_envpool.py", "compile_cudagraphs", runs_dir, device)
    return [cmd[0], os.path.join(REPO, "benchmarks", "capture_trial.py"), *cmd[2:]]


def stop_cmd(script: str, runs_dir, device: str) -> list:
    """Eager, stopped with a checkpoint after half the iterations."""
    return path_cmd(script, "eager", runs_dir, device) + ["--stop-after", str(ITERATIONS // 2)]


def resume_cmd(script: str, checkpoint: str, device: str) -> list:
    """To the end (--stop-after 0: the checkpoint's --stop-after would stop it again)."""
    return [sys.executable, os.path.join(REPO, script), "--resume", str(checkpoint), device_flag(device),
            "--stop-after", "0"]


def llm_stop_cmd(runs_dir, device: str = "cuda") -> list:
    """The default task and model (bf16 autocast on CUDA: --precision auto), stopped after iteration 1."""
    return [sys.executable, os.path.join(REPO, "ppo_llm.py"), *LLM_TINY, device_flag(device), "--stop-after", "1",
            "--runs-dir", str(runs_dir)]


def llm_resume_cmd(checkpoint: str, device: str) -> list:
    return [sys.executable, os.path.join(REPO, "ppo_llm.py"), "--resume", str(checkpoint), device_flag(device),
            "--stop-after", "0"]


def checkpoint_in(runs_dir) -> str:
    found = sorted(glob.glob(os.path.join(str(runs_dir), "*", "checkpoint.pt")))
    assert len(found) == 1, f"checkpoints under {runs_dir}: {found}"
    return found[0]


def checkpoint_or_none(runs_dir):
    try:
        return checkpoint_in(runs_dir)
    except AssertionError:
        return None


def run_all(cmds: dict, timeout: float = TIMEOUT_S) -> dict:
    """Start every command at once; {key: (exit code, stdout + stderr)}."""
    procs = {k: subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                 env=dict(os.environ, **ENV), start_new_session=True) for k, c in cmds.items()}
    out, end = {}, time.time() + timeout
    for k, p in procs.items():
        try:
            text, _ = p.communicate(timeout=max(1.0, end - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text += f"\n[test_gpu: killed after {timeout:.0f} s]"
        out[k] = (p.returncode, text)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file: the paths and the stopped runs side by side, then the resumes side by side."""
    tmp = tmp_path_factory.mktemp("gpu")
    first = {("path", s, p): path_cmd(s, p, tmp / f"{s[:-3]}_{p}") for s in SCRIPTS for p in PATHS}
    first.update({("stop", s, d): stop_cmd(s, tmp / f"{s[:-3]}_stop_{d}", d) for s in SCRIPTS for d in ("cuda", "cpu")})
    first[("llm_stop",)] = llm_stop_cmd(tmp / "llm")
    first[("trial",)] = trial_cmd(tmp / "trial")
    dirs = {k: c[c.index("--runs-dir") + 1] for k, c in first.items()}
    res = run_all(first)
    second = {}  # (a stopped run that failed or left no checkpoint has no resume: its test says so)
    for s in SCRIPTS:
        for d, other in (("cuda", "cpu"), ("cpu", "cuda")):
            ckpt = checkpoint_or_none(dirs[("stop", s, d)])
            if res[("stop", s, d)][0] == 0 and ckpt:
                second[("resume", s, d)] = resume_cmd(s, ckpt, other)
    ckpt = checkpoint_or_none(dirs[("llm_stop",)])
    if res[("llm_stop",)][0] == 0 and ckpt:
        res[("llm_stop_args",)] = torch.load(ckpt, map_location="cpu", weights_only=True)["args"]  # (before resume)
        second[("llm_resume",)] = llm_resume_cmd(ckpt, "cpu")
    res.update(run_all(second))
    return res, dirs


def finished(result, what: str) -> str:
    rc, text = result or (None, "not run: the run it resumes failed or left no checkpoint")
    assert rc == 0, f"{what}: exit code {rc}\n{text[-3000:]}"
    return text


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("script", SCRIPTS)
def test_path_finishes_without_a_cuda_graph_fallback(runs, script, path):
    res, _ = runs
    text = finished(res[("path", script, path)], f"{script} {path}")
    notes = [ln for ln in text.splitlines() if any(n in ln.lower() for n in SKIP_NOTES)]
    assert not notes, f"{script} {path}: graphs ran without CUDA graphs: {notes}"
    assert f"iter {ITERATIONS}/{ITERATIONS}" in text, text[-2000:]


@pytest.mark.parametrize("path", list(SAME_AS_EAGER))
@pytest.mark.parametrize("script", SCRIPTS)
def test_compiled_parameters_equal_eager(runs, script, path):
    res, dirs = runs
    finished(res[("path", script, "eager")], f"{script} eager")
    finished(res[("path", script, path)], f"{script} {path}")
    assert_same_parameters(dirs[("path", script, "eager")], dirs[("path", script, path)], script, path)


def test_the_hand_captured_trial_ends_with_the_eager_parameters(runs):
    res, dirs = runs
    script = "ppo_atari_envpool.py"
    finished(res[("path", script, "eager")], f"{script} eager")
    text = finished(res[("trial",)], "benchmarks/capture_trial.py --compile --cudagraphs")
    assert f"iter {ITERATIONS}/{ITERATIONS}" in text, text[-2000:]
    for name in ("policy", "update"):  # (else the run was the script's own path)
        assert f"capture_trial: {name} captured in one CUDA graph" in text, text[-2000:]
    assert_same_parameters(dirs[("path", script, "eager")], dirs[("trial",)], script, "compile_cudagraphs")


def assert_same_parameters(eager_runs, other_runs, script: str, path: str) -> None:
    eager = torch.load(checkpoint_in(eager_runs), map_location="cpu", weights_only=True)["model"]
    other = torch.load(checkpoint_in(other_runs), map_location="cpu", weights_only=True)["model"]
    assert eager.keys() == other.keys()
    tol = dict(SAME_AS_EAGER[path], **({"atol": ATOL[script]} if script in ATOL else {}))
    for k in eager:
        a, b = eager[k].float(), other[k].float()
        assert torch.allclose(a, b, **tol), f"{script} {path} {k}: max |diff| {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("saved_on,resumed_on", [("cuda", "cpu"), ("cpu", "cuda")])
@pytest.mark.parametrize("script", SCRIPTS)
def test_checkpoint_resumes_on_the_other_device(runs, script, saved_on, resumed_on):
    res, _ = runs
    stopped = finished(res[("stop", script, saved_on)], f"{script} stopped on {saved_on}")
    assert f"stopped at iteration {ITERATIONS // 2} " in stopped, stopped[-2000:]
    text = finished(res.get(("resume", script, saved_on)), f"{script}: {saved_on} checkpoint resumed on {resumed_on}")
    assert f"iter {ITERATIONS}/{ITERATIONS}" in text, text[-2000:]


def test_llm_bf16_on_cuda_stops_and_resumes_on_the_cpu(runs):
    res, _ = runs
    stopped = finished(res[("llm_stop",)], "ppo_llm.py --cuda --stop-after 1 (bf16: --precision auto)")
    assert "stopped at iteration 1 " in stopped and "iter 2/2" not in stopped, stopped[-2000:]
    saved = res[("llm_stop_args",)]
    assert saved["cuda"] is True and saved["precision"] == "auto", saved  # auto: bf16 autocast on CUDA
    text = finished(res.get(("llm_resume",)), "ppo_llm.py --resume ... --no-cuda")
    assert "iter 2/2" in text, text[-2000:]
