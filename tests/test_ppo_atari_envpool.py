"""Tests for ppo_atari_envpool.py (CPU, small): CLI, whole-game episode statistics, envpool observations, the pure
functions against plain loops, a smoke run, stop -> resume, and 2 processes under torchrun."""

import copy
import glob
import math
import os
import re
import signal
import subprocess
import time
import sys
import types

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/shared.py
import ppo_atari_envpool as pae  # noqa: E402
from shared import handlers, reference_gae, stand_in_for_cuda_graphs  # noqa: E402  (tests/shared.py)

SCRIPT = os.path.join(ROOT, "ppo_atari_envpool.py")


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------
def test_cli_total_timesteps_1e7_and_cleanrl_defaults():
    args = pae.parse_args(["--total-timesteps", "1e7"])
    assert args.total_timesteps == 10_000_000 and isinstance(args.total_timesteps, int)
    assert (args.env_id, args.num_envs, args.num_steps, args.num_minibatches, args.update_epochs) == (
        "Breakout-v5", 8, 128, 4, 4)
    assert (args.learning_rate, args.clip_coef, args.ent_coef, args.vf_coef) == (2.5e-4, 0.1, 0.01, 0.5)
    assert (args.gamma, args.gae_lambda, args.max_grad_norm, args.anneal_lr) == (0.99, 0.95, 0.5, True)
    assert not args.sticky_actions and args.num_threads == 0
    args = pae.parse_args(["--sticky-actions", "--no-anneal-lr"])
    assert args.sticky_actions is True and args.anneal_lr is False


def boundary(argv) -> tuple:
    """main(parse_args(argv)) as __main__ runs it: (exit code, the error line) of a Failure; tyro's own errors
    exit 2 by themselves (its message is its own)."""
    try:
        pae.main(pae.parse_args(argv))
    except pae.Failure as e:
        return e.code, str(e)
    except SystemExit as e:
        return e.code, ""
    return 0, ""


@pytest.mark.parametrize("argv, needle", [
    (["--env-id", "Breakot-v5"], "did you mean Breakout-v5"),
    (["--env-id", "CartPole-v1"], "unknown envpool Atari task"),  # envpool's, not an Atari task
    (["--env-id", "HalfCheetah-v4"], "unknown envpool Atari task"),
    (["--num-envs", "abc"], ""),  # tyro's own error (exit 2)
    (["--gamma", "-0.1"], "must lie in [0, 1]"),
    (["--learning-rate", "inf"], "finite"),
    (["--total-timesteps", "100"], "less than one rollout"),
    (["--seed", "-1"], "envpool seeds"),
    (["--seed", "2147000000"], "envpool seeds"),  # + 10M steps passes envpool's int32
    (["--no-such-flag"], ""),
    (["--resume", "{missing}"], "No such file"),
    (["--resume", "{foreign}"], "not a ppo_atari_envpool.py checkpoint"),
    (["--resume", "{corrupt}"], "cannot read checkpoint"),
    (["--no-cuda", "--cudagraphs"], "--cudagraphs needs --cuda"),  # (--no-cuda: also where torch sees a GPU)
    (["--num-minibatches", "3"], "not divisible"),
    (["--num-steps", "0"], "must be positive"),
    (["--learning-rate", "-1"], "must be positive"),
    (["--kl-penalty-coef", "-1"], "must be >= 0"),
    (["--kl-penalty-target", "0"], "must be positive"),
])
def test_bad_input_one_line_exit_2(tmp_path, argv, needle, monkeypatch):
    """In-process (a subprocess each costs a torch import); the command line itself is tested below."""
    monkeypatch.setattr(pae, "make_envs", lambda *a, **k: pytest.fail("bad input reached the envs"))
    torch.save({"script": "ppo.py", "env_id": "CartPole-v1", "args": {}}, tmp_path / "foreign.pt")
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "file").write_text("")
    paths = dict(missing=tmp_path / "missing.pt", foreign=tmp_path / "foreign.pt", corrupt=tmp_path / "corrupt.pt",
                 file=tmp_path / "file")
    argv = [a.format(**paths) for a in argv]
    if "--runs-dir" not in argv:
        argv += ["--runs-dir", str(tmp_path / "runs")]
    code, message = boundary(argv)
    assert code == 2 and needle in message and "\n" not in message, (code, message)
    assert not (tmp_path / "runs").exists()


def test_bad_input_from_the_command_line_is_one_line(tmp_path):
    """As a user meets it: tyro's own error (exit 2), a bad value found by validate() and a run directory that
    cannot be made (exit 1, a failed write), each one line from the error boundary."""
    p = subprocess.run([sys.executable, SCRIPT, "--num-envs", "1.5"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "'1.5' is not a whole number" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, SCRIPT, "--gamma", "2"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr == "error: --gamma and --gae-lambda must lie in [0, 1]\n", p.stderr
    (tmp_path / "file").write_text("")
    p = subprocess.run([sys.executable, SCRIPT, "--runs-dir", str(tmp_path / "file" / "runs"), "--no-cuda"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.startswith("error: cannot create the run directory"), p.stderr
    assert p.stderr.count("\n") == 1


# ---------------------------------------------------------------------------------------------------------
# Whole-game episode statistics
# ---------------------------------------------------------------------------------------------------------
def reference_games(seq):
    """Plain loop: seq of (raw reward, terminated, truncated, game_over) for one env in next-step autoreset."""
    games, ret, length, skip = [], 0.0, 0, False
    for r, term, trunc, over in seq:
        if not skip:  # the step after a done is envpool's reset step
            ret += r
            length += 1
        if over or trunc:
            games.append((ret, length))
            ret, length = 0.0, 0
        skip = term or trunc
    return games


def test_episode_stats_scripted_lives_and_truncation():
    # 3 lives; a life loss is terminated=True but not game over; reset steps come with reward 0 and are not steps
    seq = [(0, 0, 0, 0), (4, 0, 0, 0), (0, 1, 0, 0),  # life lost (clipped reward would say 1; raw is 4)
           (0, 0, 0, 0),  # reset step after the life loss (FIRE), action ignored
           (7, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 0),  # second life lost + reset step
           (1, 0, 0, 0), (0, 1, 0, 1),  # last life: game over -> one game: 4 + 7 + 1 = 12
           (0, 0, 0, 0),  # reset step of the new game
           (2, 0, 0, 0), (3, 0, 1, 0),  # truncated by the time limit: a game of return 5, length 2
           (0, 0, 0, 0), (1, 0, 0, 0)]
    stats = pae.EpisodeStats(1)
    got = []
    for r, term, trunc, over in seq:
        for i, ret, length in stats.update(np.array([r], np.float32), np.array([term], bool),
                                           np.array([trunc], bool), np.array([over], np.int32)):
            assert i == 0
            got.append((ret, length))
    assert got == [(12.0, 7), (5.0, 2)] == reference_games(seq)


def test_episode_stats_vectorised_matches_reference():
    rng = np.random.default_rng(0)
    n, T = 3, 400
    seqs = []
    for _ in range(n):
        seq, lives, after = [], 3, False
        for _ in range(T):
            if after:
                seq.append((0.0, False, False, False))
                after = False
                continue
            trunc = rng.random() < 0.01
            lost = rng.random() < 0.05
            over = lost and lives == 1
            lives = 3 if (over or trunc) else lives - int(lost)
            seq.append((float(rng.integers(0, 50)), lost, trunc, over))
            after = lost or trunc
        seqs.append(seq)
    stats = pae.EpisodeStats(n)
    got = [[] for _ in range(n)]
    for t in range(T):
        r, term, trunc, over = (np.array([seqs[i][t][k] for i in range(n)]) for k in range(4))
        for i, ret, length in stats.update(r, term.astype(bool), trunc.astype(bool), over):
            got[i].append((ret, length))
    for i in range(n):
        assert got[i] == reference_games(seqs[i]) and len(got[i]) >= 2


def test_episode_stats_on_real_breakout_game():
    """Random play until a whole game ends: the length equals envpool's elapsed_step, the return the sum of the
    unclipped rewards, and the game went through several life losses (terminated=True without game over)."""
    args = pae.Args()
    env = pae.make_envs(args, 1, seed=3)
    env.reset()
    stats, rng = pae.EpisodeStats(1), np.random.default_rng(0)
    life_losses, raw_sum = 0, 0.0
    for _ in range(5000):
        _, r, term, trunc, info = env.step(rng.integers(0, 4, size=1))
        assert r[0] in (0.0, 1.0, -1.0)  # clipped for training
        raw_sum += float(info["reward"][0])
        life_losses += int(term[0] and not info["terminated"][0])
        finished = stats.update(info["reward"], term, trunc, info["terminated"])
        if finished:
            (_, ret, length), = finished
            assert length == int(info["elapsed_step"][0]) and ret == raw_sum
            break
    else:
        pytest.fail("no game ended")
    env.close()
    assert life_losses == 4  # Breakout: 5 lives


def test_life_lost_on_the_time_limit_step_is_not_bootstrapped():
    """Breakout with NOOP: the ball is missed on step 24. With a 24-step limit that step is a life loss and the
    time limit at once, which envpool reports as truncated only; with 37 steps the truncation is a plain one."""
    for limit, plain in ((24, False), (37, True)):
        env = pae.make_envs(pae.Args(max_episode_steps=limit), 2, seed=1)
        _, info = env.reset()
        lives, cut, bootstrapped = info["lives"], [], []
        for t in range(1, limit + 3):  # (the reset step after a life loss is not counted by the limit)
            _, _, term, trunc, info = env.step(np.zeros(2, dtype=np.int64))
            cut += [t] if trunc[0] else []
            bootstrapped += [t] if pae.to_bootstrap(term, trunc, lives, info["lives"], info["terminated"])[0] else []
            lives = info["lives"]
        env.close()
        assert len(cut) == 1 and bootstrapped == (cut if plain else [])


def test_game_over_on_the_time_limit_step_is_not_bootstrapped_in_a_game_without_lives():
    """Pong has no lives (0 throughout): a game lost with NOOP on exactly the time limit's step is reported as
    truncated only, and info["terminated"] is what tells it from a plain truncation 50 steps earlier."""
    def play(limit):
        env = pae.make_envs(pae.Args(env_id="Pong-v5", max_episode_steps=limit), 1, seed=1)
        _, info = env.reset()
        lives = info["lives"]
        for t in range(1, limit + 1):
            _, _, term, trunc, info = env.step(np.zeros(1, dtype=np.int64))
            if term[0] or trunc[0]:
                env.close()
                return t, bool(term[0]), bool(trunc[0]), pae.to_bootstrap(term, trunc, lives, info["lives"],
                                                                          info["terminated"])[0], info["lives"][0]
            lives = info["lives"]

    end, term, trunc, boot, lives = play(27_000)
    assert term and not trunc and not boot and lives == 0 and 100 < end < 27_000  # the game lost, no limit
    assert play(end) == (end, False, True, False, 0)  # game over on the limit's step: truncated only, terminal
    assert play(end - 50) == (end - 50, False, True, True, 0)  # a plain truncation: bootstrapped


# ---------------------------------------------------------------------------------------------------------
# Observations and network
# ---------------------------------------------------------------------------------------------------------
def test_observation_shape_dtype_and_agent():
    env = pae.make_envs(pae.Args(), 2, seed=1)
    obs, _ = env.reset()
    assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8 and obs.max() > 0
    assert env.single_action_space.n == 4
    env.close()
    torch.manual_seed(0)
    agent = pae.Agent(4)
    action, logprob, entropy, value = agent.get_action_and_value(torch.from_numpy(obs))
    assert action.shape == logprob.shape == entropy.shape == value.shape == (2,)
    assert torch.allclose(entropy, torch.full((2,), np.log(4.0)), atol=1e-3)  # std 0.01 head: near uniform
    assert torch.allclose(agent.get_value(torch.from_numpy(obs)), value)


# ---------------------------------------------------------------------------------------------------------
# Pure functions vs plain loops
# ---------------------------------------------------------------------------------------------------------
def test_gae_and_truncation_bootstrap_against_forward_sum():
    torch.manual_seed(0)
    T, N, gamma, lam = 7, 3, 0.9, 0.8
    rewards, values = torch.randn(T, N), torch.randn(T, N)
    dones = (torch.rand(T, N) < 0.3).float()
    truncs = (torch.rand(T, N) < 0.3).float()
    next_value, next_done = torch.randn(N), torch.tensor([0.0, 1.0, 0.0])
    assert dones[1:].sum() > 0 and truncs.sum() > 0
    # (on the host, in numpy: the script's GAE runs there)
    r2 = pae.bootstrap_truncated(rewards.numpy(), values.numpy(), next_value.numpy(), truncs.numpy(), gamma)
    # a step cut by the time limit gets r + gamma * V(the observation after it), every other step its r
    for t in range(T):
        for n in range(N):
            v_after = values[t + 1, n].item() if t + 1 < T else next_value[n].item()
            want = rewards[t, n].item() + (gamma * v_after if truncs[t, n] else 0.0)
            assert r2[t, n] == pytest.approx(want, abs=1e-6)
    adv, ret = pae.compute_gae(r2, values.numpy(), dones.numpy(), next_value.numpy(), next_done.numpy(), gamma, lam)
    ref = reference_gae(r2.tolist(), values.tolist(), dones.tolist(), next_value.tolist(), next_done.tolist(),
                        gamma, lam)
    assert adv.dtype == ret.dtype == np.float32
    np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, adv + values.numpy(), rtol=1e-6)


def plain_loss(newlp, oldlp, adv, newv, oldv, ret, ent, clip, ent_coef, vf_coef):
    """CleanRL's loss written per sample (0-d tensors, so that autograd gives the reference gradients too)."""
    n = len(adv)
    mean = sum(adv.tolist()) / n
    std = math.sqrt(sum((a - mean) ** 2 for a in adv.tolist()) / (n - 1))
    pg = v = h = 0.0
    for i in range(n):
        a = (adv[i].item() - mean) / (std + 1e-8)
        r = (newlp[i] - oldlp[i]).exp()
        r_clipped = min(max(r, torch.tensor(1 - clip)), torch.tensor(1 + clip))
        pg = pg + max(-a * r, -a * r_clipped)
        v_clipped = oldv[i] + min(max(newv[i] - oldv[i], torch.tensor(-clip)), torch.tensor(clip))
        v = v + max((newv[i] - ret[i]) ** 2, (v_clipped - ret[i]) ** 2)
        h = h + ent[i]
    return pg / n - ent_coef * h / n + vf_coef * 0.5 * v / n


def test_ppo_loss_mask_equals_loss_on_real_transitions():
    torch.manual_seed(0)
    B = 32
    newlp, oldlp = torch.randn(B) * 0.1 - 1.3, torch.randn(B) * 0.1 - 1.3
    adv, newv, oldv, ret, ent = torch.randn(B), torch.randn(B), torch.randn(B), torch.randn(B), torch.rand(B)
    mask = (torch.rand(B) > 0.25).float()
    keep = mask.bool()
    kw = dict(clip_coef=0.1, clip_vloss=True, ent_coef=0.01, vf_coef=0.5, norm_adv=True)
    full, _ = pae.ppo_loss(newlp, oldlp, adv, newv, oldv, ret, ent, torch.ones(B), **kw)
    assert torch.allclose(full, plain_loss(newlp, oldlp, adv, newv, oldv, ret, ent, 0.1, 0.01, 0.5), atol=1e-6)
    lp, v = newlp.clone().requires_grad_(), newv.clone().requires_grad_()
    masked, stats = pae.ppo_loss(lp, oldlp, adv, v, oldv, ret, ent, mask, **kw)
    masked.backward()
    lp_ref, v_ref = newlp[keep].clone().requires_grad_(), newv[keep].clone().requires_grad_()
    ref = plain_loss(lp_ref, oldlp[keep], adv[keep], v_ref, oldv[keep], ret[keep], ent[keep], 0.1, 0.01, 0.5)
    ref.backward()
    assert torch.allclose(masked, ref, atol=1e-6) and not torch.allclose(masked, full)
    # gradients: the reference's on the real transitions, exactly 0 on the masked ones
    assert torch.allclose(lp.grad[keep], lp_ref.grad, atol=1e-6) and torch.allclose(v.grad[keep], v_ref.grad, atol=1e-6)
    assert (lp.grad[~keep] == 0).all() and (v.grad[~keep] == 0).all() and lp_ref.grad.abs().sum() > 0
    # statistics over the real transitions only
    logr = (newlp[keep] - oldlp[keep]).tolist()
    m = len(logr)
    assert stats["old_approx_kl"].item() == pytest.approx(sum(-x for x in logr) / m, abs=1e-6)
    assert stats["approx_kl"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in logr) / m, abs=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(sum(abs(math.exp(x) - 1) > 0.1 for x in logr) / m, abs=1e-6)


def test_rollout_kl_is_the_mean_kl_over_the_rollouts_real_transitions():
    """The d of the adaptive rule: KL(pi_old(.|s) || pi(.|s)) averaged over the real transitions only (mask 1), in
    minibatches that do not divide the rollout (torch.distributions' KL as the reference)."""
    torch.manual_seed(0)
    agent = pae.Agent(4)
    obs = torch.randint(0, 256, (6, 4, 84, 84), dtype=torch.uint8)
    old_logp_all, mask = torch.log_softmax(torch.randn(6, 4) * 3, -1), torch.tensor([1., 0., 1., 1., 0., 1.])
    penalty = pae.KLPenalty(pae.Args(kl_penalty_target=0.01), torch.device("cpu"))
    with torch.no_grad():
        new = torch.distributions.Categorical(logits=agent.actor(agent.hidden(obs)))
        kl = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=old_logp_all), new)
        want = kl[mask.bool()].mean()
    for minibatch_size in (4, 6):
        got = penalty.rollout_kl(agent, obs, old_logp_all, mask, minibatch_size)
        assert torch.allclose(got, want, atol=1e-5), (got, want)
    assert want > 0.01 and not torch.allclose(kl.mean(), want)  # (the masked states count: they would change it)


def test_kl_penalty_loss_with_mask_and_the_adaptive_rule():
    """The KL-penalty variant: masked mean of -r*A + beta*KL(pi_old(.|s)||pi(.|s)) over the real transitions, the KL
    exact, no clipping."""
    torch.manual_seed(1)
    B, A, beta = 16, 4, 0.5
    old_logp, logp = torch.log_softmax(torch.randn(B, A), -1), torch.log_softmax(torch.randn(B, A), -1)
    actions, adv = torch.randint(0, A, (B,)), torch.randn(B)
    newlp, oldlp = logp.gather(1, actions[:, None])[:, 0], old_logp.gather(1, actions[:, None])[:, 0]
    mask = (torch.rand(B) > 0.3).float()
    z = torch.zeros(B)
    kl = pae.categorical_kl(old_logp, logp)
    _, stats = pae.ppo_loss(newlp, oldlp, adv, z, z, z, z, mask, 0.1, False, 0.0, 0.0, False, kl_coef=beta, kl=kl)
    ref = []
    for i in range(B):
        if mask[i]:
            p_old, p = (torch.distributions.Categorical(logits=x[i]) for x in (old_logp, logp))
            ref.append(-math.exp(newlp[i] - oldlp[i]) * adv[i].item()
                       + beta * torch.distributions.kl_divergence(p_old, p).item())
    assert stats["policy_loss"].item() == pytest.approx(sum(ref) / len(ref), abs=1e-6)
    assert [pae.adapt_kl_coef(2.0, kl, 0.03) for kl in (0.01, 0.03, 0.05)] == [1.0, 2.0, 4.0]


# ---------------------------------------------------------------------------------------------------------
# End to end (subprocess, tiny sizes)
# ---------------------------------------------------------------------------------------------------------
TINY = ["--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "1",
        "--torch-threads", "1", "--num-threads", "1", "--no-cuda"]


def run(argv, cwd):
    p = subprocess.run([sys.executable, SCRIPT, *argv], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def test_smoke_run_stops_then_resumes_with_steps_lr_schedule_and_tags(tmp_path):
    """A smoke run of 512 steps in two pieces (one subprocess each: the run as a user starts it)."""
    common = ["--total-timesteps", "512", "--runs-dir", str(tmp_path), *TINY]  # 8 iterations of 64 steps
    out = run([*common, "--stop-after", "3"], tmp_path)
    assert "stopped at iteration 3 (--stop-after 3); continue with: python ppo_atari_envpool.py --resume" in out
    (run_dir,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert (ckpt["iteration"], ckpt["global_step"], ckpt["script"]) == (3, 192, "ppo_atari_envpool.py")
    # the printed command runs to the end (--stop-after is not kept), and brings the checkpoint to the end without
    # --save-model
    out = run(["--resume", ckpt_path, "--eval-episodes", "1"], tmp_path)
    assert "resumed" in out and "global step 192" in out and "iter 8/8" in out and "eval: 1 games" in out
    assert re.search(r"eval game 1/1: score \d+, \d+ steps", out)  # progress of a long evaluation
    assert os.listdir(tmp_path) == [os.path.basename(run_dir)]  # same run directory
    final = torch.load(ckpt_path, weights_only=True)
    assert (final["iteration"], final["global_step"]) == (8, 512)
    assert final["args"]["num_envs"] == 2  # flags taken from the checkpoint
    assert not torch.equal(final["model"]["actor.weight"], ckpt["model"]["actor.weight"])  # it trained on
    lr = scalars(run_dir, "charts/learning_rate")
    assert [s for s, _ in lr] == [64 * k for k in range(1, 9)]  # one point per iteration, no gap, no repeat
    assert np.allclose([v for _, v in lr], [(1 - (k - 1) / 8) * 2.5e-4 for k in range(1, 9)])
    assert "global_step=512" in out and re.search(r"iter 8/8 .*  eta=0s\n", out)
    for tag in ("charts/SPS", "losses/value_loss", "losses/policy_loss", "losses/entropy", "losses/approx_kl",
                "losses/clipfrac", "losses/explained_variance"):
        values = scalars(run_dir, tag)
        assert [s for s, _ in values] == [64 * k for k in range(1, 9)] and all(np.isfinite(v) for _, v in values), tag


# ---------------------------------------------------------------------------------------------------------
# Reliability: what --resume restores, SIGTERM, same seed same run, non-finite updates
# ---------------------------------------------------------------------------------------------------------
def tiny(tmp_path, **kw):
    base = dict(total_timesteps=256, num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, torch_threads=1,
                num_threads=1, runs_dir=str(tmp_path), exp_name="t", cuda=False)
    base.update(kw)
    return pae.Args(**base)


class StatelessGames:
    """Stands for envpool's envs where a resumed run can meet the same games as an uninterrupted one: the same
    observation always, a reward that depends on the action alone, no life lost, no game over."""

    single_observation_space = types.SimpleNamespace(shape=(4, 84, 84))
    single_action_space = types.SimpleNamespace(n=4)

    def __init__(self, args, num_envs, seed, **kw):
        self.obs = np.random.default_rng(0).integers(0, 256, (num_envs, 4, 84, 84), dtype=np.uint8)
        self.info = dict(lives=np.full(num_envs, 5), terminated=np.zeros(num_envs, np.int32))

    def reset(self):
        return self.obs, self.info

    def send(self, action):  # (main steps envpool's envs by send, then recv)
        self.action = np.asarray(action)

    def recv(self):
        reward = (self.action == 2).astype(np.float32)
        no = np.zeros(len(self.action), dtype=bool)
        return self.obs, reward, no, no, {**self.info, "reward": reward}

    def close(self):
        pass


def test_stopped_and_resumed_learner_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    """Exact resume of everything but envpool's games (which start anew): networks, Adam, lr schedule, step counters
    and the RNG. With games that carry no state, 1 + 2 iterations end with the parameters of 3 in one go."""
    monkeypatch.setattr(pae, "make_envs", StatelessGames)
    whole = pae.main(tiny(tmp_path / "whole", total_timesteps=192, save_model=True))
    part = pae.main(tiny(tmp_path / "part", total_timesteps=192, stop_after=1))
    path = os.path.join(part["run_dir"], "checkpoint.pt")
    stopped = torch.load(path, weights_only=True)
    assert stopped["optimizer"]["state"]  # Adam's moments exist after one update
    rest = pae.main(pae.parse_args(["--resume", path]))
    assert rest["global_step"] == whole["global_step"] == 192
    a, b = (torch.load(os.path.join(r["run_dir"], "checkpoint.pt"), weights_only=True) for r in (whole, rest))
    assert (a["iteration"], a["global_step"]) == (b["iteration"], b["global_step"]) == (3, 192)
    for k, v in a["model"].items():
        assert torch.equal(b["model"][k], v), k
    for i, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(b["optimizer"]["state"][i][k], v), (i, k)
    assert torch.equal(a["rng"][0]["torch"], b["rng"][0]["torch"])
    assert not torch.equal(a["model"]["actor.weight"], stopped["model"]["actor.weight"])  # (it trained on)


def test_overlapped_pools_step_the_same_games_as_one_pool(tmp_path):
    """--overlap-envs: two envpools of half the envs, one stepping while the other's actions are computed. Env i keeps
    its seed and the actions are drawn in the same order, so on the CPU the run is the one-pool run: the same games
    (the logged returns), and parameters equal up to the float sums of half-size batches."""
    made, real = [], pae.make_envs
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pae, "make_envs", lambda args, n, seed, **k: made.append((n, seed)) or real(args, n, seed, **k))
        one, two = (pae.main(tiny(tmp_path / str(o), num_envs=4, num_steps=64, total_timesteps=1024, overlap_envs=o,
                                  save_model=True)) for o in (False, True))
    assert made == [(4, 1), (2, 1), (2, 3)]  # env i seeded with 1 + i either way
    assert len(one["returns"]) > 0 and one["returns"] == two["returns"]
    a, b = (torch.load(os.path.join(r["run_dir"], "checkpoint.pt"), weights_only=True)["model"] for r in (one, two))
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, rtol=1e-4, atol=1e-5, msg=k)
    assert scalars(one["run_dir"], "charts/episodic_return") == scalars(two["run_dir"], "charts/episodic_return")


def test_load_policy_plays_the_saved_agent(tmp_path):
    res = pae.main(tiny(tmp_path, total_timesteps=64, save_model=True))
    path = os.path.join(res["run_dir"], "checkpoint.pt")
    agent = pae.Agent(4)  # Breakout: 4 actions
    agent.load_state_dict(torch.load(path, weights_only=True)["model"])
    obs = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = agent.actor(agent.hidden(obs)).argmax(-1).numpy()
    greedy = pae.load_policy(path, deterministic=True)
    assert (greedy(obs.numpy()) == expected).all() and greedy(obs[1].numpy()) == expected[1]
    assert pae.load_policy(path)(obs.numpy()).shape == (3,)
    with pytest.raises(ValueError, match="uint8"):
        greedy(obs.numpy() / 255.0)  # scaled frames would be scaled twice


def test_the_update_uses_the_kl_penalty_loss_with_a_fixed_coefficient(tmp_path, monkeypatch):
    seen = []
    original = pae.ppo_loss
    kls, kl_args, original_kl = [], [], pae.categorical_kl
    monkeypatch.setattr(pae, "ppo_loss", lambda *a, **k: seen.append(a[13] if len(a) > 13 else k.get("kl_coef"))
                        or kls.append(a[14] if len(a) > 14 else k.get("kl")) or original(*a, **k))
    # KL(pi_old || pi): the stored rollout log-probs (no gradient) first, the new ones (differentiated) second
    monkeypatch.setattr(pae, "categorical_kl", lambda old, new: torch.is_grad_enabled() and kl_args.append(
        (old.requires_grad, new.requires_grad)) or original_kl(old, new))
    res = pae.main(tiny(tmp_path, total_timesteps=128, kl_penalty_coef=0.3))  # 2 iterations of 2 updates
    assert len(seen) == 4 and all(torch.is_tensor(c) and c.item() == pytest.approx(0.3) for c in seen)
    assert kl_args == [(False, True)] * 4
    # the exact KL of each state: 0 on the first minibatch of an update (pi = pi_old), positive later
    assert all(kl.ndim == 1 and kl.requires_grad and (kl >= -1e-6).all() for kl in kls)
    assert kls[0].abs().max() < 1e-5 and kls[2].abs().max() < 1e-5 and kls[1].max() > 0
    assert [v for _, v in scalars(res["run_dir"], "charts/kl_coef")] == pytest.approx([0.3, 0.3])


def test_adaptive_kl_penalty_logs_adapts_and_resumes_its_coefficient(tmp_path, capsys):
    target = 1e-7  # far below the KL of an update: the coefficient doubles each time (1, 2, then 4 saved)
    part = pae.main(tiny(tmp_path, stop_after=2, kl_penalty_target=target))
    path = os.path.join(part["run_dir"], "checkpoint.pt")
    kls, coefs = scalars(part["run_dir"], "losses/kl"), scalars(part["run_dir"], "charts/kl_coef")
    assert len(kls) == len(coefs) == 2 and coefs[0][1] == 1.0 and kls[0][1] > 0
    assert coefs[1][1] == pytest.approx(pae.adapt_kl_coef(1.0, kls[0][1], target)) != 1.0
    saved = torch.load(path, weights_only=True)["kl_coef"]
    assert saved == pytest.approx(pae.adapt_kl_coef(coefs[1][1], kls[1][1], target)) == 4.0
    pae.main(pae.parse_args(["--resume", path, "--stop-after", "1", "--kl-penalty-coef", "1.0"]))
    assert scalars(part["run_dir"], "charts/kl_coef")[2][1] == pytest.approx(saved)  # goes on from the saved value


def test_deterministic_evaluation_plays_the_most_likely_action(monkeypatch, capsys):
    torch.manual_seed(0)
    agent = pae.Agent(4)
    args = pae.Args(eval_deterministic=True, max_episode_steps=100, num_threads=1)
    monkeypatch.setattr(agent, "get_action_and_value", lambda *a, **k: pytest.fail("sampled an action"))
    played, act = [], agent.act

    def spy(obs, deterministic=False):
        action = act(obs, deterministic)
        played.append((obs.clone(), deterministic, action.clone()))
        return action

    monkeypatch.setattr(agent, "act", spy)
    runs = []
    for seed in (1, 2):  # torch's RNG plays no part
        torch.manual_seed(seed)
        runs.append(pae.evaluate(agent, args, torch.device("cpu"), 1))
    assert len(runs[0]) == 1 and runs[0] == runs[1]
    assert "eval game 1/1" in capsys.readouterr().out
    assert len(played) >= 2 * 100 and all(flag for _, flag, _ in played)
    obs = torch.cat([o for o, _, _ in played])
    with torch.no_grad():  # each action played is the argmax of the policy's logits for that observation
        assert torch.equal(torch.cat([a for *_, a in played]), agent.actor(agent.hidden(obs)).argmax(-1))


def test_norm_adv_scope_rollout_is_the_notes_normalisation_over_the_valid_steps(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    adv, mask = torch.randn(40, generator=g) * 3 + 1, (torch.rand(40, generator=g) > 0.2).float()
    valid = adv[mask.bool()].tolist()
    mean = sum(valid) / len(valid)
    sigma = math.sqrt(sum((a - mean) ** 2 for a in valid) / len(valid) + 1e-8)  # the note's: population, eps inside
    assert pae.normalize_advantages_rollout(adv, mask).tolist() == pytest.approx(
        [(a - mean) / sigma for a in adv.tolist()], abs=1e-6)
    seen, original = [], pae.ppo_loss
    monkeypatch.setattr(pae, "ppo_loss", lambda *a, **k: seen.append((a[2].clone(), a[7].clone(), a[12]))
                        or original(*a, **k))
    pae.main(tiny(tmp_path, total_timesteps=64, update_epochs=2, norm_adv_scope="rollout"))
    assert len(seen) == 2 * 2 and {flag for *_, flag in seen} == {False}
    a, m = (torch.cat([x[i] for x in seen[:2]]) for i in (0, 1))  # epoch 1: the whole rollout
    mean = (a * m).sum() / m.sum()
    assert mean.item() == pytest.approx(0, abs=1e-5)
    assert ((((a - mean) ** 2) * m).sum() / m.sum()).item() == pytest.approx(1, abs=1e-4)


def test_evaluation_flags_without_evaluation_games_get_a_note(capsys):
    pae.validate(pae.Args(capture_video=True, eval_deterministic=True))
    out = capsys.readouterr().out
    assert "--capture-video applies to the --eval-episodes games; none asked" in out
    assert "--eval-deterministic applies" in out
    pae.validate(pae.Args(capture_video=True, eval_episodes=2))
    assert "note" not in capsys.readouterr().out


def test_resume_with_another_rollout_size_env_or_world_is_one_line_error(stopped_run, tmp_path, monkeypatch):
    path = os.path.join(stopped_run, "checkpoint.pt")
    for argv, needle in ((["--num-steps", "4"], "resume with the same"), (["--num-envs", "4"], "resume with the same"),
                         (["--env-id", "Pong-v5"], "was trained on Breakout-v5, not Pong-v5")):
        code, message = boundary(["--resume", path, *argv])
        assert code == 2 and needle in message, message
    ckpt = torch.load(path, weights_only=True)
    with pytest.raises(pae.Failure, match=r"written by 1 process\(es\); resume it with as many: python ppo_atari"):
        pae.check_resume(ckpt, pae.parse_args(["--resume", path]), world=2)


def test_adam_moments_of_a_contiguous_run_resume_into_channels_last():
    """A --cuda run saves Adam moments in the default layout; on the CPU the network is channels_last and the
    fused Adam pairs tensors by raw memory: the loaded moments take the parameters' layout, so the next step
    equals plain Adam's on the same numbers (the same gradients are given to both)."""
    torch.manual_seed(0)
    cuda_like = pae.Agent(4)
    cpu = pae.Agent(4).to(memory_format=torch.channels_last)
    grads = [[torch.randn_like(p, memory_format=torch.contiguous_format) for p in cuda_like.parameters()]
             for _ in range(3)]

    def step(net, opt, g):
        for p, gp in zip(net.parameters(), g):
            p.grad = torch.empty_like(p).copy_(gp)  # each network's own layout
        opt.step()
    saved = torch.optim.Adam(cuda_like.parameters(), lr=1e-3, eps=1e-5)
    step(cuda_like, saved, grads[0])
    step(cuda_like, saved, grads[1])
    cpu.load_state_dict(cuda_like.state_dict())
    fused = torch.optim.Adam(cpu.parameters(), lr=torch.tensor(1e-3), eps=1e-5, fused=True)  # (as main on the CPU)
    pae.load_optimizer_state(fused, copy.deepcopy(saved.state_dict()), torch.device("cpu"))  # (as torch.load)
    step(cuda_like, saved, grads[2])
    step(cpu, fused, grads[2])
    for (name, a), b in zip(cuda_like.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_sigterm_writes_checkpoint_and_exits_cleanly(tmp_path):
    p = subprocess.Popen([sys.executable, SCRIPT, "--total-timesteps", "1e6", "--runs-dir", str(tmp_path), *TINY],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    first = p.stdout.readline()  # the first progress line: training is under way
    assert first.startswith("iter 1/"), first + p.stderr.read()
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "(SIGTERM); continue with: python ppo_atari_envpool.py --resume" in out
    (ckpt,) = glob.glob(str(tmp_path / "Breakout-v5__ppo_atari_envpool__1__*" / "checkpoint.pt"))
    state = torch.load(ckpt, weights_only=True)
    assert 0 < state["global_step"] < 1_000_000 and state["global_step"] == state["iteration"] * 64
    assert f"stopped at iteration {state['iteration']} (SIGTERM)" in out


def test_same_seed_same_run(tmp_path):
    a = pae.main(tiny(tmp_path / "a", total_timesteps=128))
    b = pae.main(tiny(tmp_path / "b", total_timesteps=128))
    c = pae.main(tiny(tmp_path / "c", total_timesteps=128, seed=2))
    assert a["stats"] == b["stats"] and a["returns"] == b["returns"]
    assert a["stats"] != c["stats"]


@pytest.mark.parametrize("variant", [{}, {"kl_penalty_target": 1e-7}], ids=["clip", "adaptive-kl"])
def test_compile_follows_eager_learning_path(tmp_path, variant):
    """The compiled rollout (action sampling) and update (the whole minibatch step, the KL coefficient read from a
    tensor that changes between iterations) follow the eager run: the same actions, so the same observations, the
    same losses and the same weights at the end, up to float rounding of the compiled kernels."""
    kw = dict(total_timesteps=128, update_epochs=2, save_model=True, **variant)
    eager = pae.main(tiny(tmp_path / "e", **kw))
    compiled = pae.main(tiny(tmp_path / "c", compile=True, **kw))
    weights = [torch.load(os.path.join(r["run_dir"], "checkpoint.pt"), weights_only=True)["model"]
               for r in (eager, compiled)]
    for k, v in weights[0].items():
        assert torch.allclose(weights[1][k], v, rtol=1e-3, atol=1e-5), k
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl") + (("kl",) if variant else ()):
        assert compiled["stats"][k] == pytest.approx(eager["stats"][k], rel=1e-3, abs=1e-5), k
    if variant:  # a stale coefficient (1 instead of 2) would move the penalty's terms by far more than rel=1e-3
        for k in ("policy_loss", "kl"):
            assert compiled["stats"][k] == pytest.approx(eager["stats"][k], rel=1e-3, abs=0), k
        coefs = [v for _, v in scalars(compiled["run_dir"], "charts/kl_coef")]
        assert coefs == [v for _, v in scalars(eager["run_dir"], "charts/kl_coef")] and coefs == [1.0, 2.0]


def test_non_finite_update_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    calls = []
    real_gae = pae.compute_gae

    def poisoned_gae(*a, **kw):  # the third iteration's advantages are NaN: its update makes NaN losses
        calls.append(1)
        adv, ret = real_gae(*a, **kw)
        return (adv * float("nan"), ret) if len(calls) == 3 else (adv, ret)

    monkeypatch.setattr(pae, "compute_gae", poisoned_gae)
    before = handlers()
    with pytest.raises(pae.Failure) as e:
        pae.main(tiny(tmp_path, checkpoint_every=1))
    assert e.value.code == 1 and handlers() == before  # restored
    err = str(e.value)
    assert "non-finite" in err and "at iteration 3" in err and "policy_loss" in err and "last checkpoint" in err
    (ckpt,) = glob.glob(str(tmp_path / "*" / "checkpoint.pt"))
    state = torch.load(ckpt, weights_only=True)
    assert state["iteration"] == 2  # the checkpoint of the last good update, not one of the NaN update
    assert all(torch.isfinite(v).all() for v in state["model"].values())


# ---------------------------------------------------------------------------------------------------------
# torchrun: 2 processes on CPU (gloo), data parallel
# ---------------------------------------------------------------------------------------------------------
def torchrun(argv, cwd, nproc=2):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
                        SCRIPT, *argv], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_torchrun_two_ranks_stop_then_resume(tmp_path):
    # 3 iterations of 2 ranks x 2 envs x 32 steps = 128 environment steps each
    out = torchrun(["--total-timesteps", "384", "--runs-dir", str(tmp_path), *TINY, "--stop-after", "1"], tmp_path)
    assert "stopped at iteration 1 (--stop-after 1); continue with: torchrun --nproc-per-node 2 " \
           "ppo_atari_envpool.py --resume" in out
    assert out.count("iter 1/3") == 1 and out.count("continue with") == 1  # rank 0 alone prints
    (run_dir,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path)]  # one run name agreed by both ranks
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert (ckpt["iteration"], ckpt["global_step"], ckpt["world_size"]) == (1, 128, 2)
    assert len(ckpt["rng"]) == 2  # rank 1's RNG too: it drew its own actions and shuffles
    assert not torch.equal(ckpt["rng"][0]["torch"], ckpt["rng"][1]["torch"])

    out = torchrun(["--resume", ckpt_path, "--save-model", "--eval-episodes", "3"], tmp_path)
    assert out.count("resumed") == 1 and "global step 128" in out and "iter 3/3" in out
    assert "eval game 3/3:" in out  # rank 0 evaluates
    assert out.count("eval: 3 games") == 1
    final = torch.load(ckpt_path, weights_only=True)
    assert (final["iteration"], final["global_step"], final["world_size"]) == (3, 384, 2)
    assert len(final["rng"]) == 2
    assert not torch.equal(final["model"]["actor.weight"], ckpt["model"]["actor.weight"])  # it trained on
    # rank 0 alone logs: one event file per launch, one point per iteration and step
    assert len(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))) == 2
    for tag in ("charts/SPS", "charts/learning_rate"):
        assert [s for s, _ in scalars(run_dir, tag)] == [128, 256, 384], tag


# ---------------------------------------------------------------------------------------------------------
# Execution paths: on CUDA compiled and captured by default (execution_path, the three scripts' shared helper)
# ---------------------------------------------------------------------------------------------------------
def pretend_cuda(monkeypatch, available: bool) -> None:  # (parsing and resolution only: nothing runs on it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(available))


def test_on_the_cpu_the_default_is_eager_and_says_nothing(monkeypatch, capsys):
    pretend_cuda(monkeypatch, False)
    args = pae.parse_args([])
    assert (args.cuda, args.compile, args.cudagraphs) == (False, None, None)
    assert pae.execution_path(args, 1) == (False, False, [])
    agent, update = torch.nn.Linear(2, 2), object()
    assert pae.compile_hot_functions(agent, update, agent, args) == (agent, update)  # the functions as they are
    assert capsys.readouterr().out == ""
    assert pae.execution_path(pae.parse_args(["--compile"]), 1)[:2] == (True, False)  # asked for by name


def test_on_cuda_the_default_is_compiled_and_captured_and_says_so(monkeypatch, capsys):
    pretend_cuda(monkeypatch, True)
    args = pae.parse_args(["--total-timesteps", "1e7"])
    compiled, graphs, lines = pae.execution_path(args, 1)
    assert (args.cuda, compiled, graphs) == (True, True, True) and len(lines) == 1
    assert "compiled and each captured in one CUDA graph" in lines[0] and "first iterations compile" in lines[0]
    assert "--no-compile --no-cudagraphs: eager" in lines[0]
    paths = {flag: pae.execution_path(pae.parse_args([flag]), 1)[:2]
             for flag in ("--no-compile", "--no-cudagraphs", "--no-cuda")}
    assert paths == {"--no-compile": (False, True), "--no-cudagraphs": (True, False), "--no-cuda": (False, False)}
    assert pae.execution_path(pae.parse_args(["--no-compile", "--no-cudagraphs"]), 1) == (False, False, [])
    monkeypatch.setenv("COLUMNS", "1000")  # tyro's help on one line per flag
    with pytest.raises(SystemExit):
        pae.parse_args(["--help"])
    assert capsys.readouterr().out.count("(default: on with --cuda)") == 2  # --compile, --cudagraphs


def test_the_mlp_scripts_keep_their_cpu_default_on_cuda():
    import ppo
    import ppo_continuous

    for mod in (ppo, ppo_continuous):
        assert mod.execution_path(mod.Args(cuda=True), 1) == (False, False, [])
        assert mod.execution_path(mod.Args(cuda=True, compile=True, cudagraphs=True), 1)[:2] == (True, True)


def test_under_torchrun_the_graphs_are_off_and_rank_0_says_so_once(monkeypatch, capsys):
    args = pae.Args(cuda=True)  # the default path (not validated: torch here may see no GPU)
    compiled, graphs, lines = pae.execution_path(args, 2)
    assert (compiled, graphs) == (True, False)
    assert lines[0] == "note: no CUDA graphs under torchrun (DDP's all-reduce cannot be captured)"
    assert "compiled (--no-compile: eager)" in lines[1] and "CUDA graph" not in lines[1]
    monkeypatch.setenv("WORLD_SIZE", "2")
    agent, update = torch.nn.Linear(2, 2), lambda: None
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        pae.compile_hot_functions(agent, update, agent, args)  # (lazy: nothing compiles until a call)
    assert capsys.readouterr().out.splitlines() == lines  # rank 0's lines, once
    pretend_cuda(monkeypatch, True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert pae.parse_args(["--cuda", "--cudagraphs"]).cudagraphs is True  # no longer refused: run without graphs


def test_a_compile_failure_is_one_line_naming_the_flag_that_avoids_it(monkeypatch):
    """torch.compile fails where it is called (an unsupported Python) or at the first calls, which compile; either
    way one line, exit code 1, naming --no-compile. Captures fail the same way (tests/test_gpu.py)."""
    agent = torch.nn.Linear(2, 2)

    def unsupported(fn, **kw):
        raise RuntimeError("torch.compile is not supported on Python 3.15+\n(a second line)")

    monkeypatch.setattr(torch, "compile", unsupported)
    with pytest.raises(pae.Failure) as e:
        pae.compile_hot_functions(agent, agent, agent, pae.Args(cuda=False, compile=True))
    assert e.value.code == 1 and str(e.value) == ("torch.compile failed: RuntimeError: torch.compile is not supported "
                                                  "on Python 3.15+ (--no-compile runs without it)")

    def fails_when_called(*a):
        raise torch._dynamo.exc.TorchRuntimeError("no C++ compiler found\nTraceback ...")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fails_when_called)
    policy, update = pae.compile_hot_functions(agent, agent, agent, pae.Args(cuda=False, compile=True))
    with pytest.raises(pae.Failure) as e:
        policy(torch.zeros(1, 2))
    assert e.value.code == 1 and "\n" not in str(e.value) and str(e.value).endswith("(--no-compile runs without it)")
    assert "TorchRuntimeError: no C++ compiler found" in str(e.value)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *a: 1 / 0)  # not compile's: as it is
    with pytest.raises(ZeroDivisionError):
        pae.compile_hot_functions(agent, agent, agent, pae.Args(cuda=False, compile=True))[0](torch.zeros(1, 2))


def test_a_compile_failure_in_a_run_is_one_line_from_the_error_boundary(tmp_path, monkeypatch):
    def unsupported(fn, **kw):
        raise RuntimeError("torch.compile is not supported here")

    monkeypatch.setattr(torch, "compile", unsupported)
    code, message = boundary(["--no-cuda", "--compile", "--num-envs", "2", "--num-steps", "32", "--total-timesteps",
                              "64", "--torch-threads", "1", "--num-threads", "1", "--runs-dir", str(tmp_path)])
    assert code == 1 and "--no-compile" in message and "\n" not in message, (code, message)


def test_cuda_graphed_warms_up_then_captures_once_and_replays(monkeypatch):
    """The CUDA-graph helper's dispatch on the CPU, torch.cuda's streams and graphs stood in for (a "capture" runs
    fn once; a replay runs nothing): the real capture and replay are tested on a GPU (tests/test_gpu.py)."""
    events = []
    stand_in_for_cuda_graphs(monkeypatch, events)
    seen = []

    def fn(x, pair):
        seen.append(x)
        events.append("run")
        return x + pair[0]

    call = pae.cuda_graphed(fn, "the update")
    outs = [call(torch.full((2,), float(i)), (torch.ones(2), None)) for i in range(4)]
    assert events == ["run", "run", "capture", "run", "captured", "replay", "replay"]
    assert all(x is seen[0] for x in seen) and seen[0].tolist() == [3.0, 3.0]  # each call's inputs copied into it
    assert outs[2] is outs[3]  # a replay returns the captured outputs
    for args in ((torch.zeros(3), (torch.ones(2), None)), (torch.zeros(2), (torch.ones(2), 1.0))):
        with pytest.raises(ValueError, match="other arguments than at its first call"):
            call(*args)

    def fails_in_capture(x):
        if events[-1] == "capture":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
        return x

    call = pae.cuda_graphed(fails_in_capture, "the action sampling")
    call(torch.zeros(1))
    call(torch.zeros(1))
    with pytest.raises(pae.Failure) as e:
        call(torch.zeros(1))
    assert e.value.code == 1 and str(e.value) == (
        "capturing the action sampling in a CUDA graph failed: RuntimeError: CUDA error: operation not permitted "
        "when stream is capturing (--no-cudagraphs runs without CUDA graphs)")


def test_eta_text():
    assert [pae.eta_text(x) for x in (45.9, 200, 7500, 0, math.inf, -1)] == ["45s", "3m20s", "2h05m", "0s", "?", "?"]


# --------------------------------------------------------------------------------------------------------------
# Device: the GPU where torch sees one (as CleanRL's script), checked on the CPU with torch's answer patched
# (parsing and validation only: nothing trains with the patched answer)
# --------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """One run stopped after the first of its 2 iterations, trained once for the tests that resume it."""
    return pae.main(tiny(tmp_path_factory.mktemp("stopped"), total_timesteps=128, stop_after=1))["run_dir"]


def test_the_gpu_is_the_default_where_torch_sees_one(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pae.parse_args(["--total-timesteps", "1e7"]).cuda is True and pae.Args().cuda is True
    assert pae.parse_args(["--no-cuda"]).cuda is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pae.parse_args(["--total-timesteps", "1e7"]).cuda is False and pae.Args().cuda is False
    with pytest.raises(pae.Failure, match="--cuda given but torch finds no CUDA device") as e:  # asked for by name
        pae.parse_args(["--cuda"])
    assert e.value.code == 2
    monkeypatch.setenv("COLUMNS", "1000")  # tyro's help on one line per flag
    with pytest.raises(SystemExit):
        pae.parse_args(["--help"])
    assert "the default where torch sees a GPU" in capsys.readouterr().out


def test_a_checkpoint_resumes_on_this_machines_device(stopped_run, tmp_path, monkeypatch):
    """The device is no argument of the checkpoint: a resumed run takes the machine's default (a GPU's checkpoint
    resumes on the CPU where there is none, and the reverse); --cuda by name without a GPU is refused."""
    path = os.path.join(stopped_run, "checkpoint.pt")
    saved = torch.load(path, weights_only=True)["args"]
    assert "cuda" not in saved and (saved["compile"], saved["cudagraphs"]) == (None, None)  # unset: as --cuda
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (also on a machine with a GPU)
    assert pae.parse_args(["--resume", path]).cuda is False
    with pytest.raises(pae.Failure):
        pae.parse_args(["--resume", path, "--cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pae.parse_args(["--resume", path]).cuda is True
    assert pae.execution_path(pae.parse_args(["--resume", path]), 1)[:2] == (True, True)  # this machine's default
    monkeypatch.setenv("WORLD_SIZE", "4")  # `torchrun --nproc-per-node 4` where torch sees 1 GPU: the CPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert pae.parse_args([]).cuda is False and pae.Args().cuda is False
    with pytest.raises(pae.Failure, match=r"--cuda with 4 processes on this machine but 1 GPU\(s\)"):
        pae.parse_args(["--cuda"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert pae.parse_args([]).cuda is True and pae.Args().cuda is True
