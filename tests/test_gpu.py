"""Real CUDA runs of the four scripts at tiny sizes (skipped without a GPU): every path of every RL script finishes
and says which path it is, the compiled and captured paths end with the eager path's parameters (the Atari script's
defaults too: compiled and captured on CUDA), and checkpoints cross between CUDA and the CPU both ways; ppo_llm.py
runs in bf16 on CUDA and resumes on the CPU. In-process: the CUDA-graph helper replays what eager computes, refuses
other arguments, and a capture that fails is one line naming --no-cudagraphs.

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
sys.path.insert(0, REPO)  # (the in-process tests import a script)
# Each path by both flags (on CUDA the Atari script's default is compiled and captured: `default` below)
PATHS = {"eager": ["--no-compile", "--no-cudagraphs"], "compile": ["--compile", "--no-cudagraphs"],
         "cudagraphs": ["--no-compile", "--cudagraphs"], "compile_cudagraphs": ["--compile", "--cudagraphs"]}
# The line each path prints first (compile_hot_functions); eager prints none
SAYS = {"compile": "update compiled (", "cudagraphs": "update each captured in one CUDA graph (",
        "compile_cudagraphs": "update compiled and each captured in one CUDA graph ("}
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
# Paths compared with eager after ITERATIONS iterations (--torch-deterministic; --compile sets inductor's
# fallback_random, so the same actions are sampled): parameters allclose at these tolerances
SAME_AS_EAGER = {"compile": dict(rtol=1e-3, atol=1e-5), "cudagraphs": dict(rtol=1e-3, atol=1e-5),
                 "compile_cudagraphs": dict(rtol=1e-3, atol=1e-5)}
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


def default_cmd(runs_dir, device: str = "cuda") -> list:
    """The Atari script with its default path (no --compile / --cudagraphs flag): on CUDA, compiled and captured."""
    cmd = path_cmd("ppo_atari_envpool.py", "eager", runs_dir, device)
    return [a for a in cmd if a not in PATHS["eager"]]


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
    first[("default",)] = default_cmd(tmp / "default")
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
def test_path_finishes_and_says_which_it_is(runs, script, path):
    res, _ = runs
    text = finished(res[("path", script, path)], f"{script} {path}")
    said = [ln for ln in text.splitlines() if ln.startswith("path: ")]
    assert said == [] if path == "eager" else len(said) == 1 and SAYS[path] in said[0], said
    assert f"iter {ITERATIONS}/{ITERATIONS}" in text, text[-2000:]


@pytest.mark.parametrize("path", list(SAME_AS_EAGER))
@pytest.mark.parametrize("script", SCRIPTS)
def test_compiled_parameters_equal_eager(runs, script, path):
    res, dirs = runs
    finished(res[("path", script, "eager")], f"{script} eager")
    finished(res[("path", script, path)], f"{script} {path}")
    assert_same_parameters(dirs[("path", script, "eager")], dirs[("path", script, path)], script, path)


def test_the_atari_default_on_cuda_is_compiled_captured_and_ends_with_the_eager_parameters(runs):
    res, dirs = runs
    script = "ppo_atari_envpool.py"
    finished(res[("path", script, "eager")], f"{script} eager")
    text = finished(res[("default",)], f"{script} with its default path on CUDA")
    assert f"iter {ITERATIONS}/{ITERATIONS}" in text, text[-2000:]
    assert -1 < text.find(SAYS["compile_cudagraphs"]) < text.index("iter 1/"), text[:2000]  # said first
    assert_same_parameters(dirs[("path", script, "eager")], dirs[("default",)], script, "compile_cudagraphs")


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


def test_cuda_graphed_replays_what_eager_computes_and_refuses_other_arguments():
    """In-process: a function with in-place state (as the optimizer's) and random numbers (as the action sampling),
    run eagerly for 2 calls, captured at the 3rd, replayed after: the same outputs and state as eager, call by call."""
    import ppo_atari_envpool as pae  # (imports without side effects)

    def fn(x, scale):
        state.add_(x * scale)
        return state * 2, torch.rand_like(x)

    results = []
    for graphed in (False, True):
        state, call = torch.zeros(3, device="cuda"), pae.cuda_graphed(fn, "fn") if graphed else fn
        torch.manual_seed(0)
        results.append([[o.clone() for o in call(torch.full((3,), float(i), device="cuda"),
                                                   torch.tensor(2.0, device="cuda"))] + [state.clone()]
                        for i in range(5)])
    for eager, graphed in zip(*results):
        assert all(torch.equal(a, b) for a, b in zip(eager, graphed)), (eager, graphed)
    with pytest.raises(ValueError, match="other arguments than at its first call"):
        call(torch.zeros(4, device="cuda"), torch.tensor(2.0, device="cuda"))  # (a replay would read 3 of them)


def test_a_capture_that_fails_is_one_line_naming_no_cudagraphs():
    """(In a process of its own: a failed capture may leave CUDA's state unusable for later tests.)"""
    code = ("import sys, torch; sys.path.insert(0, '.'); import ppo_atari_envpool as pae\n"
            "call = pae.cuda_graphed(lambda x: x * float(x.sum()), 'the update')  # .item(): a host sync\n"
            "x = torch.ones(2, device='cuda')\n"
            "call(x); call(x)  # the warm-up calls run as they are\n"
            "try:\n    call(x)\nexcept pae.Failure as e:\n    print('FAILURE', e.code, str(e))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("FAILURE ")]
    assert len(lines) == 1 and lines[0].startswith("FAILURE 1 capturing the update in a CUDA graph failed: "), (
        p.stdout[-2000:], p.stderr[-2000:])
    assert lines[0].endswith("(--no-cudagraphs runs without CUDA graphs)")
