"""Real CUDA runs of the four scripts at tiny sizes (skipped without a GPU): every path of every RL script finishes
and says which path it is, the compiled and captured paths end with the eager path's parameters (the Atari script's
defaults too: compiled and captured on CUDA, also when stopped and resumed over games that carry no state), and
checkpoints cross between CUDA and the CPU both ways; ppo_llm.py runs in bf16 on CUDA and resumes on the CPU, and a
run stopped and resumed on CUDA samples what a straight run samples (its rollout decodes in CUDA graphs).
In-process: the CUDA-graph helper replays what eager computes, refuses other arguments, and a capture that fails is
one line naming --no-cudagraphs; ppo_llm's captured decoding gives the tokens of the same steps uncaptured, before and
after a refresh of its weights, and over a 151,936-row vocabulary (the sampler's two levels).

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


# The Atari script over tests/test_ppo_atari_envpool.py's StatelessGames (the same frame always, a reward of the action
# alone): a resumed run restarts envpool's games, so only games that carry no state meet the uninterrupted run's again
STATELESS = ("import sys; sys.path[:0] = sys.argv[1:3]; import ppo_atari_envpool as pae; "
             "from test_ppo_atari_envpool import StatelessGames; pae.make_envs = StatelessGames; "
             "pae.main(pae.parse_args(sys.argv[3:]))")


def stateless(cmd: list) -> list:
    """An Atari script command line (python, script, flags) run over StatelessGames instead of envpool's games."""
    assert cmd[1].endswith("ppo_atari_envpool.py"), cmd
    return [cmd[0], "-c", STATELESS, REPO, os.path.join(REPO, "tests"), *cmd[2:]]


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


# The sampling across a stop and a resume alone: no warm start and (almost) no learning, so that the weights after
# iteration 1 are those of the start in both runs whatever the order of a non-deterministic kernel's sums
LLM_FROZEN = ["--sft-steps", "0", "--lr", "1e-30", "--critic-lr", "1e-30"]


def llm_cmd(runs_dir, *extra) -> list:
    """The default task and model on CUDA, straight through its iterations."""
    return [sys.executable, os.path.join(REPO, "ppo_llm.py"), *LLM_TINY, "--cuda", *extra, "--runs-dir", str(runs_dir)]


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
    first[("llm_stop_cuda",)] = llm_cmd(tmp / "llm_cuda", *LLM_FROZEN, "--stop-after", "1")  # (resumed on CUDA)
    first[("llm_straight",)] = llm_cmd(tmp / "llm_straight", *LLM_FROZEN)
    first[("default",)] = default_cmd(tmp / "default")
    first[("stateless",)] = stateless(default_cmd(tmp / "stateless"))
    first[("stateless_stop",)] = stateless(default_cmd(tmp / "stateless_stop") + ["--stop-after", str(ITERATIONS // 2)])
    dirs = {k: c[c.index("--runs-dir") + 1] for k, c in first.items()}
    res = run_all(first)
    second = {}  # (a stopped run that failed or left no checkpoint has no resume: its test says so)
    for s in SCRIPTS:
        for d, other in (("cuda", "cpu"), ("cpu", "cuda")):
            ckpt = checkpoint_or_none(dirs[("stop", s, d)])
            if res[("stop", s, d)][0] == 0 and ckpt:
                second[("resume", s, d)] = resume_cmd(s, ckpt, other)
    ckpt = checkpoint_or_none(dirs[("stateless_stop",)])
    if res[("stateless_stop",)][0] == 0 and ckpt:  # (resumed on its default path, compiled and captured afresh)
        second[("stateless_resume",)] = stateless(resume_cmd("ppo_atari_envpool.py", ckpt, "cuda"))
    ckpt = checkpoint_or_none(dirs[("llm_stop",)])
    if res[("llm_stop",)][0] == 0 and ckpt:
        res[("llm_stop_args",)] = torch.load(ckpt, map_location="cpu", weights_only=True)["args"]  # (before resume)
        second[("llm_resume",)] = llm_resume_cmd(ckpt, "cpu")
    ckpt = checkpoint_or_none(dirs[("llm_stop_cuda",)])
    if res[("llm_stop_cuda",)][0] == 0 and ckpt:
        second[("llm_resume_cuda",)] = llm_resume_cmd(ckpt, "cuda")
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


def test_the_atari_default_stopped_and_resumed_ends_as_the_straight_run(runs):
    """Exact resume through the captured path: the stopped run's checkpoint resumed on CUDA (compiled and captured
    afresh, its Adam state and RNG restored) ends with the uninterrupted default run's parameters. Both over games
    that carry no state (envpool's real ones restart on resume: from there a resumed run sees other frames)."""
    res, dirs = runs
    script = "ppo_atari_envpool.py"
    finished(res[("stateless",)], f"{script} with its default path on CUDA")
    finished(res[("stateless_stop",)], f"{script} default path, --stop-after {ITERATIONS // 2}")
    text = finished(res.get(("stateless_resume",)), f"{script} --resume on its default path")
    assert f"iter {ITERATIONS}/{ITERATIONS}" in text and SAYS["compile_cudagraphs"] in text, text[-2000:]
    assert_same_parameters(dirs[("stateless",)], dirs[("stateless_stop",)], script, "compile_cudagraphs")


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


def llm_samples(runs_dir, iteration: int) -> list:
    """The logged responses (samples.jsonl: the first prompts' responses and rewards) of an iteration of the run."""
    import json

    found = glob.glob(os.path.join(str(runs_dir), "*", "samples.jsonl"))
    assert len(found) == 1, found
    with open(found[0]) as f:
        return [row for row in map(json.loads, f) if row["iteration"] == iteration]


def test_llm_a_run_resumed_on_cuda_samples_what_a_straight_run_samples(runs):
    """The rollout's decoder on CUDA (a bf16 copy, each step a CUDA graph): after a stop and a resume (a fresh copy,
    a fresh capture, the saved sampling generator), iteration 2 samples the responses of the uninterrupted run, whose
    decoding replays the graph captured in iteration 1 (LLM_FROZEN: the weights do not move)."""
    res, dirs = runs
    straight = finished(res[("llm_straight",)], "ppo_llm.py --cuda")
    assert "rollout: a bf16 copy of the policy decodes with a static KV cache" in straight, straight[-2000:]
    finished(res[("llm_stop_cuda",)], "ppo_llm.py --cuda --stop-after 1")
    finished(res.get(("llm_resume_cuda",)), "ppo_llm.py --resume ... --cuda")
    want, got = llm_samples(dirs[("llm_straight",)], 2), llm_samples(dirs[("llm_stop_cuda",)], 2)
    assert want and got == want, (want, got)


def test_llm_captured_decoding_gives_the_tokens_of_the_same_steps_uncaptured():
    """In-process: ppo_llm's StaticDecoder with its steps captured (warm-up, capture at the third step, replays) and
    without, on the same bf16 weights and equally seeded generators: the same tokens call after call, greedy and
    sampled (with top-p / top-k), the generators left in the same state; generators reseeded (as each evaluation
    reseeds its one) give the first call's tokens again; after refresh() from a changed policy the graphs read the new
    weights. As in ppo_llm.py's default run: deterministic algorithms on (warn-only), which the captured step turns
    off for its forward (plain_kernels), the uncaptured one not."""
    import ppo_llm as P

    mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        decode_as_uncaptured(P)
    finally:
        torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


def decode_as_uncaptured(P) -> None:
    tok = P.build_char_tokenizer()
    policy = P.disable_dropout(P.build_tiny_model(tok, 0, 64, 2, max_positions=512)).cuda()
    model = P.rollout_copy(policy, torch.bfloat16)
    captured, eager = P.StaticDecoder(model, keep=4), P.StaticDecoder(model, capture=False)
    rows = P.make_problems(16, torch.Generator().manual_seed(0))
    ids, mask = (x.cuda() for x in P.encode_batch(tok, rows, 64))

    def both(greedy, gens, **extra):
        return [P.generate(d, ids, mask, 40, [tok.eos_token_id], tok.pad_token_id, gen=g, greedy=greedy, **extra)
                for d, g in zip((eager, captured), gens)]
    for greedy, extra in ((True, {}), (False, {}), (False, dict(temperature=0.7, top_p=0.9, top_k=20))):
        gens = [torch.Generator("cuda").manual_seed(5) for _ in range(2)]
        calls = [both(greedy, gens, **extra) for _ in range(3)]  # (the first warms up and captures; then replays)
        assert all(a.shape[1] > 8 and torch.equal(a, b) for a, b in calls), calls
        assert torch.equal(gens[0].get_state(), gens[1].get_state())
        a, b = both(greedy, [g.manual_seed(5) for g in gens], **extra)  # (reseeded: the first call's tokens again)
        assert torch.equal(a, b) and torch.equal(a, calls[0][0])
    assert len(captured.shapes) == 3 and all(s["graph"] is not None for s in captured.shapes.values())
    before = both(True, [None, None])[0]
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    captured.refresh(policy)  # (eager reads the same tensors)
    a, b = both(True, [None, None])
    assert torch.equal(a, b) and not torch.equal(a, before)


def test_llm_captured_decoding_over_a_real_vocabulary_samples_the_uncaptured_tokens():
    """In-process: a random-weight Qwen2 of Qwen2.5's 151,936 output rows (a tiny trunk), sampling in two levels
    (sample_categorical over more than 4,096 tokens): the captured step draws the uncaptured step's tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import ppo_llm as P

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = P.rollout_copy(Qwen2ForCausalLM(cfg).cuda(), torch.bfloat16)
    captured, eager = P.StaticDecoder(model), P.StaticDecoder(model, capture=False)
    ids, mask = torch.randint(1, 151_936, (16, 12), device="cuda"), torch.ones(16, 12, dtype=torch.long, device="cuda")
    gens = [torch.Generator("cuda").manual_seed(3) for _ in range(2)]
    for _ in range(2):  # (the first call warms up and captures; the second replays)
        a, b = (P.generate(d, ids, mask, 24, [0], 0, gen=g) for d, g in zip((eager, captured), gens))
        assert a.shape == (16, 24) and torch.equal(a, b), (a, b)
        assert len(set(a.flatten().tolist())) > 300  # (spread over the vocabulary: both levels drawn from)


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
