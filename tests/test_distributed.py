"""torchrun with 2 processes on CPU (gloo): DDP's averaged gradients equal one process's on the whole batch, and
each RL script trains, stops and resumes under torchrun."""
import glob
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
import distributed_worker  # noqa: E402
import ppo  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(*argv, nproc=2, timeout=240):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--standalone", *argv], capture_output=True, text=True, timeout=timeout, env=ENV,
                          cwd=ROOT)


@pytest.mark.parametrize("script", ["ppo", "ppo_continuous", "ppo_atari_envpool"])
def test_two_rank_gradient_equals_one_process_on_the_concatenated_batch(tmp_path, script):
    out = tmp_path / "grads.pt"
    res = torchrun(os.path.join(ROOT, "tests", "distributed_worker.py"), script, str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    ddp = torch.load(out, weights_only=True)
    agent, loss_fn = distributed_worker.make_case(script, 2 * distributed_worker.B)
    loss_fn(agent, torch.arange(2 * distributed_worker.B)).backward()
    for k, p in agent.named_parameters():
        assert torch.allclose(ddp[k], p.grad, atol=1e-6, rtol=1e-5), k
    # and the halves alone differ from the whole: the check can fail
    agent.zero_grad()
    loss_fn(agent, torch.arange(distributed_worker.B)).backward()
    assert any(not torch.allclose(ddp[k], p.grad, atol=1e-6) for k, p in agent.named_parameters())


def stop_after_one_iteration(script, argv, tmp_path):
    """`torchrun` 2 processes for one iteration of a 3-iteration run: (checkpoint path, its state)."""
    first = torchrun(os.path.join(ROOT, script), *argv, "--runs-dir", str(tmp_path), "--stop-after", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"continue with: torchrun --nproc-per-node 2 {script} --resume" in first.stdout
    assert first.stdout.count("iter 1/3") == 1  # rank 0 alone prints
    (ckpt,) = glob.glob(str(tmp_path / "*" / "checkpoint.pt"))
    return ckpt, torch.load(ckpt, weights_only=True)


def alone(script, *argv):
    """SCRIPT in one plain process."""
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *argv], capture_output=True, text=True,
                          timeout=300, env=ENV)


def test_ppo_trains_stops_and_resumes_under_torchrun(tmp_path):
    # 2 x 512 steps per iteration
    ckpt, state = stop_after_one_iteration("ppo.py", ["--total-timesteps", "3072", "--num-steps", "128"], tmp_path)
    assert state["global_step"] == 1024 and state["world_size"] == 2 and len(state["rng"]) == len(state["episodes"]) == 2
    # each rank played its own episodes and drew from its own RNG, and the checkpoint holds both
    assert not torch.equal(state["episodes"][0]["next_obs"], state["episodes"][1]["next_obs"])
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])
    # another number of processes would change the iterations and the lr schedule: refused (exit 2)
    with pytest.raises(ppo.Failure, match=r"written by 2 process\(es\); resume it with as many: torchrun") as e:
        ppo.main(ppo.parse_args(["--resume", ckpt]))
    assert e.value.code == 2
    rest = torchrun(os.path.join(ROOT, "ppo.py"), "--resume", ckpt, "--save-model", "--eval-episodes", "3",
                    "--capture-video")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert rest.stdout.count("eval: 3 episodes") == 1  # rank 0 evaluates
    assert len(glob.glob(str(tmp_path / "*" / "videos" / "*.mp4"))) == 3
    state = torch.load(ckpt, weights_only=True)
    assert state["global_step"] == 3072 and state["iteration"] == 3
    assert len(glob.glob(str(tmp_path / "*" / "events.out.tfevents.*"))) == 2  # rank 0's, one per process run


def test_bad_input_under_torchrun_is_said_once(tmp_path):
    """Every rank finds the bad input before the process group exists; rank 0 alone says it (the launcher then
    reports the workers' failure and exits 1, which is torchrun's own rule). ppo.py stands for the three: their
    parse_args and error boundary are the same text (test_shared_plumbing.py)."""
    res = torchrun(os.path.join(ROOT, "ppo.py"), "--num-envs", "0", "--runs-dir", str(tmp_path))
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 1 and len(errors) == 1 and "--num-envs" in errors[0], res.stderr[-3000:]
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("script, argv", [
    ("ppo.py", ["--total-timesteps", "8192", "--num-steps", "128"]),
    ("ppo_continuous.py", ["--env-id", "Hopper-v5", "--total-timesteps", "1024", "--num-steps", "64",
                           "--num-minibatches", "2", "--update-epochs", "1"]),  # (both ranks' MuJoCo states in it)
])
def test_a_full_disk_of_rank_0_under_torchrun_ends_the_job(tmp_path, script, argv):
    """Rank 0 alone writes; its failed save ends the job (torchrun's teardown stops the other rank)."""
    import resource

    def small_files():  # a file-size limit stands for the full disk (writes past it fail with EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          os.path.join(ROOT, script), *argv, "--checkpoint-every", "1", "--runs-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, env=ENV, cwd=ROOT, preexec_fn=small_files)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 1 and len(errors) == 1 and "File too large" in errors[0], res.stderr[-3000:]
    assert "cannot write" in errors[0] and "checkpoint.pt" in errors[0]


@pytest.mark.parametrize("script", ["ppo", "ppo_continuous", "ppo_atari_envpool"])
def test_the_ranks_leave_the_process_group_together(script, monkeypatch):
    """close_run: a barrier before the process group is destroyed (rank 0 evaluates after training while the others
    are done; a rank tearing gloo down alone sometimes aborted, SIGABRT); one process has no group to leave."""
    module, calls = __import__(script), []
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))
    module.close_run([], None, module.Args(), 2)
    module.close_run([], None, module.Args(), 1)
    assert calls == ["barrier", "destroy"]


def test_cudagraphs_under_torchrun_compile_without_graphs(monkeypatch):
    """DDP's all-reduce cannot be captured: --cudagraphs is accepted and the run compiles without CUDA graphs (the
    note that says so once: tests/test_ppo_atari_envpool.py)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = ppo.parse_args(["--cuda", "--compile", "--cudagraphs"])
    assert ppo.execution_path(args, 2)[:2] == (True, False) and ppo.execution_path(args, 1)[:2] == (True, True)


# ----- ppo_llm.py: statistics over the global batch, FSDP2 / DDP gradients -------------------------------------
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_ppo_llm_two_ranks_equal_one_process_on_the_whole_batch(tmp_path, strategy):
    out = tmp_path / "llm"
    res = torchrun(os.path.join(ROOT, "tests", "distributed_worker.py"), "ppo_llm", str(out), strategy)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    W = distributed_worker
    model, batch, rollout = W.llm_case()
    # reward normalisation, group statistics, whitening and the KL controller over the global batch
    single = W.llm_rewards(rollout, 0, 1)
    for name, one in single.items():
        two = [r["rewards"][name] for r in ranks]
        assert torch.allclose(torch.cat([two[0]["adv"], two[1]["adv"]]), one["adv"], atol=1e-6), name
        assert torch.allclose(torch.cat([two[0]["ret"], two[1]["ret"]]), one["ret"], atol=1e-6), name
        for r in two:
            assert torch.allclose(r["scores"], one["scores"]) and r["seq_kl"] == pytest.approx(one["seq_kl"])
            assert r["kl_coef"] == pytest.approx(one["kl_coef"]) and r["running"] == pytest.approx(one["running"])
    # whitening over each half alone differs: the comparison above can fail
    half = W.llm_rewards({k: v[:4] for k, v in rollout.items()}, 0, 1)["gae_whiten_batchnorm"]["adv"]
    assert not torch.allclose(half, single["gae_whiten_batchnorm"]["adv"][:4], atol=1e-3)
    # the gradient of a 2-rank minibatch equals one process's on the concatenated minibatch, for every aggregation
    for mode in W.AGG_MODES:
        one = W.llm_grads(model, batch, mode, 0, 1)
        for k, g in one.items():
            for r in ranks:
                assert torch.allclose(r["grads"][mode][k], g, atol=1e-6, rtol=1e-4), (mode, k)


def test_ppo_llm_trains_stops_and_resumes_under_torchrun(tmp_path):
    tiny = ["--sft-steps", "5", "--eval-prompts", "8", "--rollout-batch-size", "4", "--group-size", "2",
            "--ppo-mini-batch-size", "2", "--micro-batch-size", "2", "--num-iterations", "3", "--tiny-hidden-size",
            "128", "--tiny-num-layers", "2", "--torch-threads", "1", "--no-cuda"]
    ckpt, state = stop_after_one_iteration("ppo_llm.py", tiny, tmp_path)
    assert state["global_step"] == 8 and len(state["rng"]["gen_dev"]) == 2  # 4 prompts x 2 responses, all ranks
    # checkpoints are full: FSDP2 (2 ranks) -> one plain process -> FSDP2 again
    one = alone("ppo_llm.py", "--resume", ckpt, "--stop-after", "1")
    assert one.returncode == 0 and "continue with: python ppo_llm.py" in one.stdout, one.stderr[-3000:]
    assert torch.load(ckpt, weights_only=True)["global_step"] == 16
    rest = torchrun(os.path.join(ROOT, "ppo_llm.py"), "--resume", ckpt, "--stop-after", "0")
    assert rest.returncode == 0, rest.stderr[-3000:]
    state = torch.load(ckpt, weights_only=True)
    assert state["iteration"] == 3 and state["global_step"] == 24
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(ckpt), state["model"]["policy"]))
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    # FSDP2 saved full tensors: the optimizer moments have the parameters' full shapes
    shapes = sorted(tuple(p.shape) for p in policy.parameters())
    moments = sorted(tuple(s["exp_avg"].shape) for s in state["optimizer"][0]["state"].values())
    assert moments == shapes


def test_ppo_llm_a_full_disk_of_rank_0_under_torchrun_ends_the_job(tmp_path):
    """Rank 0 alone writes; its failed save is one line and its exit ends the job (no rank waits for the others)."""
    import resource

    def small_files():  # a file-size limit stands for the full disk (writes past it fail with EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    tiny = ["--sft-steps", "0", "--eval-prompts", "8", "--rollout-batch-size", "4", "--group-size", "2",
            "--ppo-mini-batch-size", "2", "--micro-batch-size", "2", "--num-iterations", "2", "--tiny-hidden-size",
            "128", "--tiny-num-layers", "2", "--torch-threads", "1", "--no-cuda", "--checkpoint-every", "1"]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          os.path.join(ROOT, "ppo_llm.py"), *tiny, "--runs-dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=240, env=ENV, cwd=ROOT, preexec_fn=small_files)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 1 and len(errors) == 1 and "cannot write" in errors[0], res.stderr[-3000:]
    assert "File too large" in errors[0] and "(no checkpoint was written)" in errors[0], errors[0]
    (run,) = os.listdir(tmp_path)
    assert not [f for f in os.listdir(tmp_path / run) if f.startswith(("checkpoint", "ref"))]
