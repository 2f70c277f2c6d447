"""Tests for ppo_continuous.py: pure functions against plain reference loops, then small runs.

    python -m pytest tests/test_ppo_continuous.py -q
"""

import glob
import math
import os
import re
import signal
import time
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/shared.py
import ppo_continuous as pc  # noqa: E402
from shared import ctrl_c_after_first_iteration, reference_gae  # noqa: E402

SCRIPT = os.path.join(ROOT, "ppo_continuous.py")


def run_script(*argv, env=None, timeout=120):
    return subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def one_line_error(capsys, fn, *args):
    """fn(*args) fails with bad input: a Failure of exit code 2 (one line, said by __main__), or tyro's own exit 2."""
    try:
        fn(*args)
    except pc.Failure as e:
        assert e.code == 2 and "\n" not in str(e), (e.code, str(e))
        return str(e)
    except SystemExit as e:
        assert e.code == 2
        return capsys.readouterr().err
    pytest.fail("no error")


# ---------------------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------------------
def test_running_mean_std_matches_numpy_over_the_whole_stream():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(n, 5)) * np.arange(1, 6) for n in (1, 7, 1, 64, 3, 1, 200)]
    exact = pc.RunningMeanStd((5,), epsilon=0.0)  # no prior pseudo-count: must equal numpy exactly
    default = pc.RunningMeanStd((5,))  # gymnasium's prior: mean 0, var 1 with weight 1e-4
    for i, b in enumerate(batches):
        exact.update(b)
        default.update(b)
        seen = np.concatenate(batches[: i + 1])
        np.testing.assert_allclose(exact.mean, seen.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(exact.var, seen.var(0), rtol=1e-10)
        assert exact.count == len(seen)
    # the prior is a pseudo-sample of weight 1e-4 at mean 0 with variance 1
    n, seen = len(seen), np.concatenate(batches)
    mean = seen.sum(0) / (n + 1e-4)
    var = (1e-4 * (1.0 + mean**2) + ((seen - mean) ** 2).sum(0)) / (n + 1e-4)
    np.testing.assert_allclose(default.mean, mean, rtol=1e-10)
    np.testing.assert_allclose(default.var, var, rtol=1e-9)
    # state round trip through tensors (what the checkpoint holds)
    other = pc.RunningMeanStd((5,))
    other.load_state_dict({k: v.clone() for k, v in default.state_dict().items()})
    np.testing.assert_array_equal(other.mean, default.mean)
    np.testing.assert_array_equal(other.var, default.var)
    assert other.count == default.count


def test_merge_moments_of_ranks_equals_numpy_on_the_concatenated_data(monkeypatch):
    """The torchrun merge of the normalisation statistics, without processes: 3 simulated ranks add their own batches
    to running statistics that start from a shared state; after each merge every rank holds the mean/var/count of
    all ranks' data (as numpy computes them on the concatenation), bit for bit the same on every rank."""
    rng = np.random.default_rng(4)
    # the pure function: disjoint sets (one empty) -> the moments of their union
    sets = [rng.normal(-2.0, 5.0, size=(n, 4)) * np.arange(1, 5) + 100.0 for n in (1, 37, 0, 500, 3)]
    parts = [(s.mean(0), s.var(0), len(s)) if len(s) else (np.zeros(4), np.ones(4), 0) for s in sets]
    mean, var, count = pc.merge_moments(parts)
    union = np.concatenate(sets)
    assert count == len(union)
    np.testing.assert_allclose(mean, union.mean(0), rtol=1e-13)
    np.testing.assert_allclose(var, union.var(0), rtol=1e-10)

    # the running statistics of 3 ranks over 3 rollouts, merged after each (gather_objects stands in for torchrun)
    world, shape = 3, (4,)
    ranks = []
    for _ in range(world):
        rms = pc.RunningMeanStd(shape, epsilon=0.0)
        rms.track_additions()
        ranks.append(rms)
    seen = []
    for rollout in range(3):
        for r, rms in enumerate(ranks):
            for n in (1, 5, 2) if r else (8,):  # ranks add batches of other sizes
                b = rng.normal(r + rollout, 1.0 + r, size=(n,) + shape)
                rms.update(b)
                seen.append(b)
        payloads = [[(rms.added.mean, rms.added.var, rms.added.count)] for rms in ranks]
        monkeypatch.setattr(pc, "gather_objects", lambda obj, w: payloads)
        for rms in ranks:
            pc.merge_ranks([rms], world)
        union = np.concatenate(seen)
        for rms in ranks:
            assert rms.count == len(union)
            np.testing.assert_allclose(rms.mean, union.mean(0), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(rms.var, union.var(0), rtol=1e-10)
            np.testing.assert_array_equal(rms.mean, ranks[0].mean)
            np.testing.assert_array_equal(rms.var, ranks[0].var)
            assert rms.added.count == 0  # the next rollout's additions start afresh

    # with gymnasium's prior (count 1e-4 at mean 0, var 1) the merge equals one statistics fed all the data
    one = pc.RunningMeanStd(shape)
    one.update(union)
    prior = pc.RunningMeanStd(shape)
    prior.track_additions()
    prior.update(union[:30])
    other = pc.RunningMeanStd(shape, epsilon=0.0)
    other.update(union[30:])
    mean, var, count = pc.merge_moments([prior.merged, (prior.added.mean, prior.added.var, prior.added.count),
                                         (other.mean, other.var, other.count)])
    assert count == pytest.approx(one.count, rel=1e-15)
    np.testing.assert_allclose(mean, one.mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(var, one.var, rtol=1e-10)


def test_normalize_obs_clips_and_does_not_update():
    rms = pc.RunningMeanStd((2,), epsilon=0.0)
    rms.update(np.array([[0.0, 10.0], [2.0, 10.0]]))  # mean (1, 10), var (1, 0)
    out = pc.normalize_obs(np.array([[3.0, 10.5], [-1.0, 9.0]]), rms, clip=10.0)
    np.testing.assert_allclose(out, [[2.0, 10.0], [-2.0, -10.0]], rtol=1e-6)
    assert rms.count == 2


def test_reward_scaler_matches_plain_loop_with_resets():
    gamma, n_envs, T = 0.9, 2, 60
    rng = np.random.default_rng(1)
    rewards = rng.normal(1.0, 3.0, size=(T, n_envs))
    done = np.zeros((T, n_envs), dtype=bool)
    done[[5, 17, 18, 33], 0] = True  # termination or truncation: the scaler treats both as an episode end
    done[[9, 50], 1] = True
    scaler = pc.RewardScaler(n_envs, gamma, clip=2.0)
    got = np.stack([scaler(rewards[t], done[t]) for t in range(T)])

    G = [0.0] * n_envs
    history = []
    for t in range(T):
        for i in range(n_envs):
            G[i] = gamma * G[i] + rewards[t, i]
        history += G  # every env's discounted return joins the statistics, step by step
        n = len(history)
        mean = sum(history) / (n + 1e-4)
        var = (1e-4 * (1.0 + mean**2) + sum((g - mean) ** 2 for g in history)) / (n + 1e-4)
        for i in range(n_envs):
            want = max(-2.0, min(2.0, rewards[t, i] / math.sqrt(var + 1e-8)))
            assert got[t, i] == pytest.approx(want, rel=1e-9), (t, i)
            if done[t, i]:
                G[i] = 0.0
    assert (np.abs(got) == 2.0).any() and (np.abs(got) < 2.0).any()  # the clip is exercised


# ---------------------------------------------------------------------------------------------------------
# Policy and advantages
# ---------------------------------------------------------------------------------------------------------
def test_gaussian_logprob_and_entropy_match_torch_normal():
    torch.manual_seed(0)
    mean = torch.randn(32, 6, dtype=torch.float64)
    logstd = torch.randn(1, 6, dtype=torch.float64).expand_as(mean)
    action = torch.randn(32, 6, dtype=torch.float64) * 3
    logprob, entropy = pc.gaussian_logprob_entropy(mean, logstd, action)
    ref = torch.distributions.Normal(mean, logstd.exp())
    torch.testing.assert_close(logprob, ref.log_prob(action).sum(-1))
    torch.testing.assert_close(entropy, ref.entropy().sum(-1))


def test_agent_sampling_logprob_is_the_sampled_actions_logprob():
    torch.manual_seed(0)
    agent = pc.Agent(5, 3)
    with torch.no_grad():
        agent.actor_logstd.copy_(torch.tensor([[-0.5, 0.0, 0.7]]))
    x = torch.randn(16, 5)
    action, logprob, entropy, value = agent.get_action_and_value(x)
    ref = torch.distributions.Normal(agent.actor_mean(x), agent.actor_logstd.exp().expand(16, 3))
    torch.testing.assert_close(logprob, ref.log_prob(action).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref.entropy().sum(-1))
    _, logprob2, _, value2 = agent.get_action_and_value(x, action)  # scoring the same action gives the same
    torch.testing.assert_close(logprob2, logprob, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(value2, value)
    assert value.shape == (16,)
    # the block-diagonal fused forward of the rollout is the same function
    torch.manual_seed(1)
    a1, lp1, _, v1 = agent.get_action_and_value(x)
    torch.manual_seed(1)
    a2, lp2, _, v2 = agent.get_action_and_value(x, fused=agent.fused_weights())
    for got, want in ((a2, a1), (lp2, lp1), (v2, v1)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gaussian_kl_is_the_exact_kl():
    torch.manual_seed(0)
    m0, s0, m1, s1 = torch.randn(4, 3), 0.3 * torch.randn(4, 3), torch.randn(4, 3), 0.3 * torch.randn(4, 3)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(m0, s0.exp()),
                                            torch.distributions.Normal(m1, s1.exp())).sum(-1)
    np.testing.assert_allclose(pc.gaussian_kl(m0, s0, m1, s1).numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    assert pc.gaussian_kl(m0, s0, m0, s0).abs().max() < 1e-6


def test_rollout_kl_is_the_mean_kl_over_the_rollouts_states():
    """The d of the adaptive rule: KL(pi_old(.|s) || pi(.|s)) of the diagonal Gaussians averaged over every state, in
    minibatches that do not divide the rollout (torch.distributions' KL as the reference)."""
    torch.manual_seed(0)
    agent, obs = pc.Agent(5, 2), torch.randn(10, 5)
    with torch.no_grad():
        agent.actor_logstd.fill_(-0.3)
    old_means, old_logstd = torch.randn(10, 2), torch.randn(1, 2) * 0.2
    penalty = pc.KLPenalty(pc.Args(kl_penalty_target=0.01), torch.device("cpu"))
    with torch.no_grad():
        old = torch.distributions.Normal(old_means, old_logstd.exp().expand(10, 2))
        new = torch.distributions.Normal(agent.actor_mean(obs), agent.actor_logstd.exp().expand(10, 2))
        want = torch.distributions.kl_divergence(old, new).sum(-1).mean()
        for minibatch_size in (3, 10):
            got = penalty.rollout_kl(agent, obs, old_means, old_logstd, minibatch_size)
            assert torch.allclose(got, want, atol=1e-5), (got, want)
    assert want > 0.01  # (not a trivial case)


def test_clipped_policy_loss_is_the_pessimistic_bound():
    """Per sample max(-A r, -A clip(r, 1 - eps, 1 + eps)), by hand: r = 1.5 / 0.5 with A = +1 / -1, eps = 0.2."""
    ratio, adv, z = torch.tensor([1.5, 0.5, 1.5, 0.5]), torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.zeros(4)
    _, stats = pc.ppo_loss(ratio.log(), z, adv, z, z, z, z, 0.2, False, 0.0, 0.0, False)
    assert stats["policy_loss"].item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)  # (the min would give -0.15)


def test_kl_penalty_policy_loss_and_adaptive_coefficient():
    """The KL-penalty variant: -r*A + beta*KL(pi_old(.|s)||pi(.|s)) averaged, the Gaussians' KL exact, no clipping;
    beta follows the paper's rule."""
    beta, advs = 0.3, [1.0, -1.0, 2.0, 0.5, -0.3]
    torch.manual_seed(2)
    old_mean, old_logstd = torch.randn(5, 2), torch.full((5, 2), -0.5)
    mean, logstd = old_mean + 0.3 * torch.randn(5, 2), torch.full((5, 2), -0.4)
    action = old_mean + old_logstd.exp() * torch.randn(5, 2)
    x = mean.clone().requires_grad_(True)
    newlp, _ = pc.gaussian_logprob_entropy(x, logstd, action)
    oldlp, _ = pc.gaussian_logprob_entropy(old_mean, old_logstd, action)
    z = torch.zeros(5)
    loss, stats = pc.ppo_loss(newlp, oldlp, torch.tensor(advs), z, z, z, z, 0.2, False, 0.0, 0.0, False, kl_coef=beta,
                              kl=pc.gaussian_kl(old_mean, old_logstd, x, logstd))
    loss.backward()
    # reference: a loop over the states with torch.distributions, differentiated on its own
    y = mean.clone().requires_grad_(True)
    terms = []
    for i in range(5):
        p_old = torch.distributions.Independent(torch.distributions.Normal(old_mean[i], old_logstd[i].exp()), 1)
        p = torch.distributions.Independent(torch.distributions.Normal(y[i], logstd[i].exp()), 1)
        r = torch.exp(p.log_prob(action[i]) - p_old.log_prob(action[i]))
        terms.append(-r * advs[i] + beta * torch.distributions.kl_divergence(p_old, p))
    ref = torch.stack(terms).mean()
    ref.backward()
    assert stats["policy_loss"].item() == pytest.approx(ref.item(), abs=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), y.grad.numpy(), rtol=1e-4, atol=1e-6)
    assert [pc.adapt_kl_coef(1.0, kl, 0.01) for kl in (0.006, 0.0067, 0.0149, 0.016)] == [0.5, 1.0, 1.0, 2.0]
    assert pc.adapt_kl_coef(1e-6, 0.0, 0.01) == 1e-6 and pc.adapt_kl_coef(1e6, 1.0, 0.01) == 1e6


def test_compute_gae_matches_forward_sum():
    rng = np.random.default_rng(2)
    T, N, gamma, lam = 9, 3, 0.97, 0.9
    r, v = rng.normal(size=(T, N)), rng.normal(size=(T, N))
    d = (rng.random((T, N)) < 0.3).astype(np.float64)
    nv, nd = rng.normal(size=N), np.array([0.0, 1.0, 0.0])
    assert d[1:].sum() > 0  # episode ends inside the rollout, not only at its end
    adv, ret = pc.compute_gae(r, v, d, nv, nd, gamma, lam)
    ref = reference_gae(r.tolist(), v.tolist(), d.tolist(), nv.tolist(), nd.tolist(), gamma, lam)
    np.testing.assert_allclose(adv, ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(ret, np.array(ref) + v, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------
# Truncation bootstrapping on a tiny env whose value is known
# ---------------------------------------------------------------------------------------------------------
class ForeverEnv(gym.Env):
    """Reward 1 every step, never terminates; the time limit cuts it after 5 steps. Observation: the step's parity,
    so that the final observation is one the critic has seen (a bootstrap from an input it never trained on would
    test extrapolation, not the bootstrap).
    With truncation bootstrapped, V(s) = 1 / (1 - gamma) = 5 in every state (gamma 0.8); an agent that took
    truncation for termination would learn V(t) = (1 - gamma^(5 - t)) / (1 - gamma), i.e. 3.4 ... 1.0."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float64)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0]), {}

    def step(self, action):
        assert np.all(np.abs(action) <= 1.0)  # clipped to the bounds for the env
        self.t += 1
        return np.array([float(self.t % 2)]), 1.0, False, False, {}


def test_truncation_bootstraps_the_value_of_the_final_observation(tmp_path):
    gym.register("ForeverEnv-v0", entry_point=ForeverEnv, max_episode_steps=5)
    args = pc.Args(env_id="ForeverEnv-v0", total_timesteps=4000, num_envs=2, num_steps=50, num_minibatches=2,
                   update_epochs=10, learning_rate=1e-2, anneal_lr=False, gamma=0.8, gae_lambda=1.0,
                   clip_vloss=False, max_grad_norm=100.0, norm_reward=False, runs_dir=str(tmp_path), seed=3)
    res = pc.main(args)
    assert res["obs_rms"].count > 4000  # the obs statistics were updated during the rollouts
    x = pc.normalize_obs(np.array([[0.0], [1.0]]), res["obs_rms"], args.obs_clip)
    with torch.no_grad():
        v = res["agent"].get_value(torch.as_tensor(x, dtype=torch.float32)).numpy()
    # all states, the final observation (t = 5, parity 1) included, are worth 1/(1-gamma) = 5
    np.testing.assert_allclose(v, 5.0, atol=0.5)


# ---------------------------------------------------------------------------------------------------------
# Runs: smoke, stop -> resume -> eval with the normalisation statistics, bad input
# ---------------------------------------------------------------------------------------------------------
def test_smoke_async_vector_env(tmp_path):
    r = run_script("--total-timesteps", "512", "--num-envs", "2", "--vector-mode", "async", "--num-steps", "128",
                   "--num-minibatches", "4", "--update-epochs", "2", "--runs-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "iter 2/2  global_step=512" in r.stdout
    assert re.search(r"iter 1/2 .*  eta=(\d+h\d\dm|\d+m\d\ds|\d+s)\n", r.stdout)  # the time left
    (run,) = os.listdir(tmp_path)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / run))


def test_stop_resume_eval_keeps_normalisation_statistics(tmp_path, capsys):
    common = ["--total-timesteps", "768", "--num-steps", "256", "--num-minibatches", "4", "--update-epochs", "1",
              "--runs-dir", str(tmp_path)]  # no --save-model: a run stopped along the way saves its end anyway
    r = run_script(*common, "--stop-after", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    (run,) = os.listdir(tmp_path)
    path = str(tmp_path / run / "checkpoint.pt")
    first = torch.load(path, weights_only=True)
    assert first["script"] == "ppo_continuous.py" and first["iteration"] == 1 and first["global_step"] == 256
    assert first["obs_rms"]["count"] > 256 and first["return_rms"]["count"] > 255

    r = run_script("--resume", path, "--stop-after", "0")  # continues with the saved statistics and finishes
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed" in r.stdout and "iter 3/3  global_step=768" in r.stdout
    done = torch.load(path, weights_only=True)
    assert done["iteration"] == 3
    # statistics continued from the checkpoint: 512 more observations, not restarted from zero (the episodes in
    # flight continue, so no reset observation is added)
    assert done["obs_rms"]["count"].item() == pytest.approx(first["obs_rms"]["count"].item() + 512)
    assert done["return_rms"]["count"].item() == pytest.approx(first["return_rms"]["count"].item() + 512)

    r = run_script("--resume", path, "--eval-episodes", "1")  # finished run: evaluation only, statistics frozen
    assert r.returncode == 0, r.stderr[-2000:]
    assert "eval: 1 episodes, return" in r.stdout
    after = torch.load(path, weights_only=True)
    for k in ("mean", "var", "count"):
        torch.testing.assert_close(after["obs_rms"][k], done["obs_rms"][k], rtol=0, atol=0)

    # evaluation uses the statistics: the same policy scores differently without them
    agent = pc.Agent(17, 6)
    agent.load_state_dict(done["model"])
    args = pc.Args(seed=1)
    rms = pc.RunningMeanStd((17,))
    rms.load_state_dict(done["obs_rms"])
    torch.manual_seed(0)
    with_stats = pc.evaluate(agent, args, torch.device("cpu"), 1, rms)
    torch.manual_seed(0)
    without = pc.evaluate(agent, args, torch.device("cpu"), 1, pc.RunningMeanStd((17,)))
    assert with_stats != without

    # the normalisation switches cannot change under a checkpoint
    one_line_error(capsys, pc.main, pc.parse_args(["--resume", path, "--no-norm-obs"]))


def test_deterministic_evaluation_plays_the_mean_action(monkeypatch):
    torch.manual_seed(0)
    agent = pc.Agent(3, 1)
    with torch.no_grad():
        agent.actor_mean[-1].weight.mul_(1000)  # means inside and beyond Pendulum's action bounds [-2, 2]
    args = pc.Args(env_id="Pendulum-v1", eval_deterministic=True)
    rms = pc.RunningMeanStd((3,))
    rms.mean, rms.var = np.array([0.5, -0.2, 1.0]), np.array([0.3, 2.0, 4.0])  # normalisation changes the input
    sampled = pc.evaluate(agent, pc.Args(env_id="Pendulum-v1"), torch.device("cpu"), 1, rms)
    seen, make_env = [], pc.make_env  # (the observation the policy saw, the action the environment got)

    class Recorder(gym.Wrapper):
        def reset(self, **kwargs):
            self.obs, info = self.env.reset(**kwargs)
            return self.obs, info

        def step(self, action):
            seen.append((self.obs, np.array(action)))
            self.obs, *rest = self.env.step(action)
            return self.obs, *rest

    monkeypatch.setattr(pc, "make_env", lambda *a, **k: lambda: Recorder(make_env(*a, **k)()))
    monkeypatch.setattr(agent, "get_action_and_value", lambda *a, **k: pytest.fail("sampled an action"))
    runs = []
    for seed in (1, 2):  # torch's RNG plays no part
        torch.manual_seed(seed)
        runs.append(pc.evaluate(agent, args, torch.device("cpu"), 1, rms))
    assert runs[0] == runs[1] != sampled
    # The reference: the Gaussian's mean at the normalised observation, clipped to the action bounds.
    obs, played = (np.array(x) for x in zip(*seen))
    x = np.clip((obs - rms.mean) / np.sqrt(rms.var + 1e-8), -args.obs_clip, args.obs_clip)
    with torch.no_grad():
        mean = agent.actor_mean(torch.tensor(x, dtype=torch.float32)).numpy()
    assert len(seen) == 400 and (abs(mean) > 2).any() and (abs(mean) < 2).any()
    np.testing.assert_allclose(played, np.clip(mean, -2.0, 2.0), rtol=1e-5, atol=1e-5)


def test_evaluation_feeds_the_policy_the_environments_observations(monkeypatch):
    agent, seen = pc.Agent(3, 1), []

    def act(x, deterministic=False):
        seen.append(x[0].clone())
        return torch.zeros(1, 1)

    monkeypatch.setattr(agent, "act", act)
    args = pc.Args(env_id="Pendulum-v1", eval_deterministic=True)
    pc.evaluate(agent, args, torch.device("cpu"), 1, pc.RunningMeanStd((3,)))  # (fresh statistics: mean 0, var 1)
    env = gym.make("Pendulum-v1")
    expected = [env.reset(seed=args.seed + 10_000)[0]]
    expected += [env.step(np.zeros(1, np.float32))[0] for _ in seen[1:]]
    np.testing.assert_allclose(torch.stack(seen).numpy(), np.array(expected), atol=1e-4)


def test_an_action_box_that_is_not_flat_is_one_line_error(capsys):
    import gymnasium as gym

    class Grid(gym.Env):  # (2, 2) actions: clipping (N, 4) samples to its bounds could not broadcast
        observation_space = gym.spaces.Box(-1.0, 1.0, (3,))
        action_space = gym.spaces.Box(-1.0, 1.0, (2, 2))

    gym.register("GridActions-v0", entry_point=Grid)
    try:
        assert "needs a flat Box" in one_line_error(capsys, pc.check_env, "GridActions-v0")
    finally:
        del gym.registry["GridActions-v0"]


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert "needs a flat Box (ppo.py takes discrete actions)" in one_line_error(capsys, pc.check_env, "CartPole-v1")
    assert "unknown or unusable env id" in one_line_error(capsys, pc.check_env, "NoSuchEnv-v9")
    assert "not divisible" in one_line_error(capsys, pc.parse_args, ["--num-minibatches", "3"])
    assert "less than one rollout" in one_line_error(capsys, pc.parse_args, ["--total-timesteps", "1000"])
    assert "not a whole number" in one_line_error(capsys, pc.parse_args, ["--num-envs", "1.5"])
    foreign = tmp_path / "ppo_ckpt.pt"
    torch.save({"script": "ppo.py", "env_id": "CartPole-v1", "args": {}}, foreign)
    assert "not a ppo_continuous.py checkpoint" in one_line_error(capsys, pc.parse_args, ["--resume", str(foreign)])
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    assert "cannot read checkpoint" in one_line_error(capsys, pc.parse_args, ["--resume", str(corrupt)])
    # the same through the command line: exit code 2, one line, no traceback, no run directory left behind
    r = run_script("--env-id", "CartPole-v1", "--runs-dir", str(tmp_path / "runs"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "ppo.py takes discrete" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_capture_video_without_a_renderer_is_one_line_after_the_model_is_saved(tmp_path):
    """GLFW cannot render without a display: the evaluation's first frame fails in one line, exit 2, and the trained
    model is on disk already."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    r = subprocess.run([sys.executable, SCRIPT, "--env-id", "Hopper-v5", "--total-timesteps", "128", "--num-steps",
                        "128", "--num-minibatches", "2", "--update-epochs", "1", "--capture-video", "--eval-episodes",
                        "1", "--runs-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(env, MUJOCO_GL="glfw"))
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert errors[0].startswith("error: --capture-video: cannot render Hopper-v5 offscreen") and "MUJOCO_GL=egl" in errors[0]
    assert "Traceback" not in r.stderr
    assert len(glob.glob(str(tmp_path / "*" / "checkpoint.pt"))) == 1


# ---------------------------------------------------------------------------------------------------------
# Reliability: bad input from the command line, SIGTERM, exact resume, same seed same run, non-finite updates
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["--num-envs", "abc"], "abc"),
    (["--total-timesteps", "1.5"], "not a whole number"),
    (["--num-steps", "0"], "must be positive"),
    (["--gamma", "1.5"], "must lie in [0, 1]"),
    (["--learning-rate", "-3e-4"], "must be positive"),
    (["--learning-rate", "nan"], "--learning-rate"),
    (["--kl-penalty-coef", "-1"], "must be >= 0"),
    (["--kl-penalty-target", "-0.01"], "must be positive"),
    (["--seed", "5e9"], "[0, 2**31)"),
    (["--num-envs", "1", "--num-steps", "4", "--num-minibatches", "4"], "at least 2"),
    (["--vector-mode", "fast"], "sync"),
    (["--no-such-flag"], "no-such-flag"),
    (["--env-id", "CartPole-v1"], "ppo.py takes discrete"),
    (["--resume", "{missing}"], "No such file"),
    (["--resume", "{foreign}"], "not a ppo_continuous.py checkpoint"),
    (["--resume", "{corrupt}"], "cannot read checkpoint"),
])
def test_bad_input_from_main_is_one_line_exit_2(tmp_path, argv, needle, capsys, monkeypatch):
    """In-process, through parse_args and main (a subprocess each costs a torch import; the command line itself is
    tested in test_bad_input_is_one_line_exit_2)."""
    monkeypatch.setattr(pc, "make_vector_env", lambda *a, **k: pytest.fail("bad input reached the envs"))
    torch.save({"script": "ppo.py", "env_id": "CartPole-v1", "args": {}}, tmp_path / "foreign.pt")
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "file").write_text("")
    paths = dict(missing=tmp_path / "missing.pt", foreign=tmp_path / "foreign.pt", corrupt=tmp_path / "corrupt.pt",
                 file=tmp_path / "file")
    argv = [a.format(**paths) for a in argv]
    if "--runs-dir" not in argv:
        argv += ["--runs-dir", str(tmp_path / "runs")]
    err = one_line_error(capsys, lambda: pc.main(pc.parse_args(argv)))
    assert needle in err, err
    assert not (tmp_path / "runs").exists()  # bad input leaves no run directory behind


@pytest.mark.parametrize("argv, needle", [
    (["--num-envs", "4"], "written with --num-envs 2"),
    (["--num-steps", "32"], "written with --num-steps 64"),
    (["--no-norm-reward"], "written with --norm-reward True"),
])
def test_a_checkpoint_of_another_rollout_or_normalisation_is_one_line_exit_2(hopper_checkpoint, argv, needle):
    """The iteration count and lr schedule hold for the checkpoint's rollout, the network for its normalisation."""
    before = open(hopper_checkpoint, "rb").read()
    with pytest.raises(pc.Failure) as e:
        pc.main(pc.parse_args(["--resume", hopper_checkpoint, *argv]))
    assert e.value.code == 2 and needle in str(e.value) and hopper_checkpoint in str(e.value), str(e.value)
    assert open(hopper_checkpoint, "rb").read() == before


def test_a_checkpoint_of_another_process_count_is_refused_with_the_command_that_resumes_it(hopper_checkpoint):
    ckpt = torch.load(hopper_checkpoint, weights_only=True)
    with pytest.raises(pc.Failure, match=r"written by 1 process\(es\); resume it with as many: python ppo_continuous"):
        pc.check_resume(ckpt, pc.parse_args(["--resume", hopper_checkpoint]), world=2)


def read_scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for f in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
        acc = EventAccumulator(f, size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out += [(e.step, e.value) for e in acc.Scalars(tag)]
    return sorted(out)


def test_sigterm_writes_checkpoint_and_exits_cleanly(tmp_path):
    p = subprocess.Popen([sys.executable, SCRIPT, "--total-timesteps", "1e6", "--num-steps", "256",
                          "--num-minibatches", "4", "--update-epochs", "1", "--runs-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    first = p.stdout.readline()  # the first progress line: training is under way
    assert first.startswith("iter 1/"), first + p.stderr.read()
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "(SIGTERM); continue with: python ppo_continuous.py --resume" in out
    (ckpt,) = glob.glob(str(tmp_path / "HalfCheetah-v5__ppo_continuous__1__*" / "checkpoint.pt"))
    state = torch.load(ckpt, weights_only=True)
    assert 0 < state["global_step"] < 1_000_000 and state["global_step"] == state["iteration"] * 256
    assert f"stopped at iteration {state['iteration']} (SIGTERM)" in out
    assert state["episodes"][0]["envs"][0]["mujoco"] is not None  # the episode in flight is part of it


def test_ctrl_c_to_the_process_group_of_an_async_run_checkpoints_and_exits_cleanly(tmp_path):
    """The async workers leave a Ctrl-C (sent to the whole group) to the main process: checkpoint, clean exit."""
    rc, out, err = ctrl_c_after_first_iteration([SCRIPT, "--env-id", "Hopper-v5", "--total-timesteps", "1e6",
                                                 "--num-envs", "2", "--num-steps", "128", "--num-minibatches", "4",
                                                 "--update-epochs", "1", "--vector-mode", "async", "--runs-dir",
                                                 str(tmp_path)], tmp_path)
    assert rc == 0 and "Traceback" not in err, err
    assert "(SIGINT); continue with: python ppo_continuous.py --resume" in out
    assert len(glob.glob(str(tmp_path / "Hopper-v5__ppo_continuous__1__*" / "checkpoint.pt"))) == 1


@pytest.fixture(scope="module")
def hopper_checkpoint(tmp_path_factory):
    """The checkpoint of a finished tiny Hopper run (2 envs x 64 steps, 2 iterations)."""
    return os.path.join(pc.main(tiny(tmp_path_factory.mktemp("hopper"), total_timesteps=256, save_model=True))["run_dir"],
                        "checkpoint.pt")


def tiny(tmp_path, **kw):
    base = dict(env_id="Hopper-v5", total_timesteps=768, num_envs=2, num_steps=64, num_minibatches=2,
                update_epochs=2, runs_dir=str(tmp_path), exp_name="t")  # Hopper: short episodes, many returns
    base.update(kw)
    return pc.Args(**base)


@pytest.mark.parametrize("env_id, before", [("HalfCheetah-v5", 950), ("Hopper-v5", 100), ("Ant-v5", 100)])
def test_env_state_round_trip_continues_mujoco_episodes_exactly(tmp_path, env_id, before):
    """Snapshot (through a weights_only checkpoint file) -> fresh envs with other seeds -> same future: MuJoCo's
    integration state, the body positions Ant's reward reads before its step, TimeLimit's counter (HalfCheetah's
    episodes are cut at 1000 steps, inside the 100 steps after the snapshot) and the envs' random generators (the
    resets of Hopper's episodes that end)."""
    def make():
        return gym.vector.SyncVectorEnv([pc.make_env(env_id, i) for i in range(2)],
                                        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)

    a = make()
    a.reset(seed=[1, 2])
    rng = np.random.default_rng(0)
    acts = rng.uniform(-1, 1, size=(before + 100, 2) + a.single_action_space.shape)
    for t in range(before):
        a.step(acts[t])
    torch.save(pc.env_state(a), tmp_path / "envs.pt")
    want = [a.step(acts[t])[:4] for t in range(before, before + 100)]
    b = make()
    b.reset(seed=[7, 8])
    pc.load_env_state(b, torch.load(tmp_path / "envs.pt", weights_only=True))
    got = [b.step(acts[t])[:4] for t in range(before, before + 100)]
    for t, (w, g) in enumerate(zip(want, got)):
        for x, y in zip(w, g):  # observation, reward, terminated, truncated: bit for bit
            np.testing.assert_array_equal(y, x, err_msg=f"step {before + t}")
    ended = sum(int(w[2].sum() + w[3].sum()) for w in want)
    assert ended > 0 or env_id == "Ant-v5"  # Hopper's episodes end (and reset), HalfCheetah's are cut


def test_env_state_only_for_envs_whose_whole_state_is_saved():
    """An env whose state lives outside plain attributes (Box2D's world, an emulator) gets no snapshot: restoring
    part of it would continue another episode than the one saved. Stand-in: Pendulum defined elsewhere."""
    import gymnasium as gym

    base = type(gym.make("Pendulum-v1").unwrapped)
    outside = type("Elsewhere", (base,), {"__module__": "somewhere.box2d"})
    assert pc.env_state(gym.vector.SyncVectorEnv([lambda: base()])) is not None
    assert pc.env_state(gym.vector.SyncVectorEnv([lambda: outside()])) is None


def test_load_policy_normalises_with_the_saved_statistics_and_clips(tmp_path):
    res = pc.main(tiny(tmp_path, total_timesteps=256, save_model=True))  # Hopper: 11 observations, 3 actions
    path = os.path.join(res["run_dir"], "checkpoint.pt")
    ckpt = torch.load(path, weights_only=True)
    agent = pc.Agent(11, 3)
    agent.load_state_dict(ckpt["model"])
    mean, var = ckpt["obs_rms"]["mean"].numpy(), ckpt["obs_rms"]["var"].numpy()
    assert not np.allclose(mean, 0)  # statistics that change the input
    obs = np.random.default_rng(0).normal(size=(8, 11)) * 3
    x = np.clip((obs - mean) / np.sqrt(var + 1e-8), -ckpt["args"]["obs_clip"], ckpt["args"]["obs_clip"])
    with torch.no_grad():
        expected = np.clip(agent.actor_mean(torch.as_tensor(x, dtype=torch.float32)).numpy(), -1, 1)
    greedy = pc.load_policy(path, deterministic=True)
    np.testing.assert_allclose(greedy(obs), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(greedy(obs[2]), expected[2], rtol=1e-5, atol=1e-6)
    sampled = pc.load_policy(path)(obs * 100)
    assert sampled.shape == (8, 3) and np.abs(sampled).max() <= 1.0  # Hopper's action space is [-1, 1]
    with pytest.raises(ValueError, match="expected"):
        greedy(np.zeros((2, 17)))


def test_the_docs_example_of_load_policy_runs(tmp_path, monkeypatch):
    readme = open(os.path.join(os.path.dirname(SCRIPT), "docs", "running.md")).read()
    code = readme.split("## A trained policy in your own code")[1].split("```python\n")[1].split("```")[0]
    res = pc.main(tiny(tmp_path, env_id="HalfCheetah-v5", total_timesteps=256, save_model=True))
    code = code.replace("runs/<run>/checkpoint.pt", os.path.join(res["run_dir"], "checkpoint.pt"))
    monkeypatch.syspath_prepend(os.path.dirname(SCRIPT))
    scope = {}
    exec(compile(code, "docs/running.md", "exec"), scope)
    assert scope["env"].action_space.contains(scope["policy"](scope["obs"]).astype(np.float32))


def test_the_update_uses_the_kl_penalty_loss_with_a_fixed_coefficient(tmp_path, monkeypatch):
    seen = []
    original = pc.ppo_loss
    kls, kl_args, original_kl = [], [], pc.gaussian_kl
    monkeypatch.setattr(pc, "ppo_loss", lambda *a, **k: seen.append(a[12] if len(a) > 12 else k.get("kl_coef"))
                        or kls.append(a[13] if len(a) > 13 else k.get("kl")) or original(*a, **k))
    # KL(pi_old || pi): pi_old's mean and log std (stored, no gradient) first, the new ones (differentiated) second
    monkeypatch.setattr(pc, "gaussian_kl", lambda *a: torch.is_grad_enabled() and kl_args.append(
        tuple(x.requires_grad for x in a)) or original_kl(*a))
    res = pc.main(tiny(tmp_path, total_timesteps=256, kl_penalty_coef=0.3))  # 2 iterations of 2 x 2 updates
    assert len(seen) == 8 and all(torch.is_tensor(c) and c.item() == pytest.approx(0.3) for c in seen)
    # the exact KL of each state: 0 on the first minibatch of an update (pi = pi_old), positive later
    assert all(kl.ndim == 1 and kl.requires_grad and (kl >= -1e-6).all() for kl in kls)
    assert kls[0].abs().max() < 1e-5 and kls[4].abs().max() < 1e-5 and kls[3].max() > 0
    assert kl_args == [(False, False, True, True)] * 8
    assert [v for _, v in read_scalars(res["run_dir"], "charts/kl_coef")] == pytest.approx([0.3, 0.3])


def note_normalisation(adv, eps=1e-8):
    """The note's advantage averaging, written as its three lines: mean over T, sqrt of the mean square + eps."""
    n = len(adv)
    mean = sum(adv) / n
    sigma = math.sqrt(sum((a - mean) ** 2 for a in adv) / n + eps)
    return [(a - mean) / sigma for a in adv]


def test_norm_adv_scope_rollout_is_the_notes_normalisation_once_before_the_epochs(tmp_path, monkeypatch):
    adv = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3 + 1
    assert pc.normalize_advantages_rollout(adv).tolist() == pytest.approx(note_normalisation(adv.tolist()), abs=1e-6)
    seen, original = [], pc.ppo_loss
    monkeypatch.setattr(pc, "ppo_loss", lambda *a, **k: seen.append((a[2].clone(), a[11])) or original(*a, **k))
    pc.main(tiny(tmp_path, total_timesteps=128, norm_adv_scope="rollout"))
    assert len(seen) == 2 * 2 and {flag for _, flag in seen} == {False}  # not standardised again per minibatch
    first_epoch = torch.cat([a for a, _ in seen[:2]])
    assert first_epoch.mean().item() == pytest.approx(0, abs=1e-5)
    assert first_epoch.var(unbiased=False).item() == pytest.approx(1, abs=1e-4)


def test_compile_follows_eager_with_the_adaptive_kl_penalty(tmp_path):
    """The compiled rollout and update (the fused-weights policy; pi_old's mean and log std as update inputs; a
    coefficient that doubles each iteration) take the eager run's learning path."""
    kw = dict(total_timesteps=256, kl_penalty_target=1e-7)
    eager = pc.main(tiny(tmp_path / "e", **kw))
    compiled = pc.main(tiny(tmp_path / "c", compile=True, **kw))
    # the same noise drawn -> the same episodes (actions equal up to float rounding of the compiled kernels)
    assert len(eager["returns"]) > 2 and compiled["returns"] == pytest.approx(eager["returns"], rel=1e-6)
    for k in ("value_loss", "entropy", "approx_kl"):
        assert compiled["stats"][k] == pytest.approx(eager["stats"][k], rel=1e-3, abs=1e-5), k
    for k in ("policy_loss", "kl"):
        assert compiled["stats"][k] == pytest.approx(eager["stats"][k], rel=1e-3, abs=0), k
    coefs = [v for _, v in read_scalars(compiled["run_dir"], "charts/kl_coef")]
    assert coefs == [v for _, v in read_scalars(eager["run_dir"], "charts/kl_coef")] == [1.0, 2.0]


@pytest.mark.parametrize("variant", [{}, {"kl_penalty_target": 1e-3}], ids=["clip", "adaptive-kl"])
def test_exact_resume_equals_uninterrupted_run(tmp_path, variant):
    """Stopped at an iteration boundary and resumed (sync envs, CPU): same parameters, normalisation statistics,
    logged losses and episodic returns as one uninterrupted run (and the adapted KL coefficient, if any)."""
    full = pc.main(tiny(tmp_path / "full", save_model=True, **variant))  # 6 iterations, Hopper episodes in flight
    part = pc.main(tiny(tmp_path / "split", save_model=True, stop_after=3, **variant))
    ckpt = os.path.join(part["run_dir"], "checkpoint.pt")
    assert torch.load(ckpt, weights_only=True)["iteration"] == 3
    rest = pc.main(pc.parse_args(["--resume", ckpt, "--stop-after", "0"]))
    a = torch.load(os.path.join(full["run_dir"], "checkpoint.pt"), weights_only=True)
    b = torch.load(ckpt, weights_only=True)
    assert b["global_step"] == a["global_step"] == 768
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k in ("mean", "var", "count"):
        assert torch.equal(a["obs_rms"][k], b["obs_rms"][k]) and torch.equal(a["return_rms"][k], b["return_rms"][k])
    assert rest["returns"] and full["returns"][-len(rest["returns"]):] == rest["returns"]
    for tag in ("losses/policy_loss", "losses/value_loss", "charts/episodic_return", "charts/episodic_length"):
        want, got = read_scalars(full["run_dir"], tag), read_scalars(part["run_dir"], tag)
        assert want and got == want, tag
    if variant:
        coefs = read_scalars(part["run_dir"], "charts/kl_coef")
        assert coefs == read_scalars(full["run_dir"], "charts/kl_coef") and len(coefs) == 6
        assert coefs[3][1] != 1.0 and b["kl_coef"] == a["kl_coef"]  # adapted before the stop, carried over
        kls = read_scalars(part["run_dir"], "losses/kl")
        for (_, beta), (_, kl), (_, nxt) in zip(coefs, kls, coefs[1:]):  # the paper's rule, step by step
            assert nxt == pytest.approx(pc.adapt_kl_coef(beta, kl, 1e-3))


def test_same_seed_same_run(tmp_path):
    a = pc.main(tiny(tmp_path / "a", total_timesteps=256))
    b = pc.main(tiny(tmp_path / "b", total_timesteps=256))
    c = pc.main(tiny(tmp_path / "c", total_timesteps=256, seed=2))
    assert a["returns"] and a["stats"] == b["stats"] and a["returns"] == b["returns"]
    assert a["stats"] != c["stats"] and a["returns"] != c["returns"]


def test_trains_stops_and_resumes_under_torchrun(tmp_path):
    """2 ranks on CPU (gloo), 3 iterations of 2 x 64 steps: stop after the first, resume under torchrun to the end.
    The checkpoint holds both ranks' states, and the normalisation statistics of both ranks' data."""
    def torchrun(*argv):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                               SCRIPT, *argv], capture_output=True, text=True, cwd=ROOT, timeout=180,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))

    common = ["--env-id", "Hopper-v5", "--total-timesteps", "384", "--num-steps", "64", "--num-minibatches", "2",
              "--update-epochs", "1", "--runs-dir", str(tmp_path), "--save-model"]
    first = torchrun(*common, "--stop-after", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "continue with: torchrun --nproc-per-node 2 ppo_continuous.py --resume" in first.stdout
    assert first.stdout.count("iter 1/3") == 1  # rank 0 alone prints
    (ckpt,) = glob.glob(str(tmp_path / "*" / "checkpoint.pt"))
    state = torch.load(ckpt, weights_only=True)
    assert state["iteration"] == 1 and state["global_step"] == 128
    assert state["world_size"] == 2 and len(state["episodes"]) == len(state["rng"]) == 2
    assert not torch.equal(state["episodes"][0]["next_obs"], state["episodes"][1]["next_obs"])
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])
    # both ranks' observations: each rank's reset observation and 64 steps, on top of the prior's 1e-4
    assert state["obs_rms"]["count"].item() == pytest.approx(2 + 128 + 1e-4)
    assert state["return_rms"]["count"].item() == pytest.approx(128 + 1e-4)

    rest = torchrun("--resume", ckpt, "--stop-after", "0", "--eval-episodes", "3")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert rest.stdout.count("eval: 3 episodes") == 1  # both ranks' episodes (2 + 1), logged by rank 0
    assert "iter 3/3  global_step=384" in rest.stdout
    state = torch.load(ckpt, weights_only=True)
    assert state["iteration"] == 3 and state["global_step"] == 384
    assert state["world_size"] == 2 and len(state["episodes"]) == 2
    # the episodes in flight continued on both ranks (no new reset observations): all 384 steps of both ranks
    assert state["obs_rms"]["count"].item() == pytest.approx(2 + 384 + 1e-4)
    assert state["return_rms"]["count"].item() == pytest.approx(384 + 1e-4)


def test_non_finite_update_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    calls = []
    real_gae = pc.compute_gae

    def poisoned_gae(*a, **kw):  # the third iteration's advantages are NaN: its update makes NaN losses
        calls.append(1)
        adv, ret = real_gae(*a, **kw)
        return (adv * np.nan, ret) if len(calls) == 3 else (adv, ret)

    monkeypatch.setattr(pc, "compute_gae", poisoned_gae)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(pc.Failure) as e:
        pc.main(tiny(tmp_path, checkpoint_every=1))
    assert e.value.code == 1
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # restored
    err = str(e.value)
    assert "non-finite" in err and "at iteration 3" in err and "policy_loss" in err and "checkpoint.pt" in err
    (ckpt,) = glob.glob(str(tmp_path / "*" / "checkpoint.pt"))
    state = torch.load(ckpt, weights_only=True)
    assert state["iteration"] == 2  # the checkpoint of the last good update, not one of the NaN update
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_eta_text():
    assert [pc.eta_text(x) for x in (45.9, 200, 7500, 0, math.inf, -1)] == ["45s", "3m20s", "2h05m", "0s", "?", "?"]


# --------------------------------------------------------------------------------------------------------------
# What a cluster does to a job (signals at any moment, name collisions, full disks, damaged checkpoints):
# tests/test_faults.py, for the three scripts
# --------------------------------------------------------------------------------------------------------------
