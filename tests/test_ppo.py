"""Tests for ppo.py: the math against plain reference loops, the CLI, smoke runs, save/resume/evaluate."""

import glob
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/shared.py
import ppo  # noqa: E402
from shared import ctrl_c_after_first_iteration, reference_gae  # noqa: E402  (tests/shared.py)


def run_script(*argv, cwd=None, timeout=240):
    return subprocess.run([sys.executable, os.path.join(ROOT, "ppo.py"), *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def read_scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for f in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
        acc = EventAccumulator(f)
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out += [(e.step, e.value) for e in acc.Scalars(tag)]
    return sorted(out)


# --------------------------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------------------------
def test_compute_gae_matches_forward_sum_with_episode_ends():
    g = torch.Generator().manual_seed(0)
    T, N = 9, 3
    rewards = torch.randn(T, N, generator=g)
    values = torch.randn(T, N, generator=g)
    dones = torch.zeros(T, N)
    dones[3, 0] = 1  # env 0: an episode ends after step 2 (termination or, already bootstrapped, truncation)
    dones[4, 1] = dones[7, 1] = 1  # env 1: two episode ends in the middle
    next_value = torch.randn(N, generator=g)
    next_done = torch.tensor([0.0, 0.0, 1.0])  # env 2: episode ends on the last step
    adv, ret = ppo.compute_gae(rewards, values, dones, next_value, next_done, 0.99, 0.95)
    ref = reference_gae(rewards.tolist(), values.tolist(), dones.tolist(), next_value.tolist(), next_done.tolist(),
                        0.99, 0.95)
    np.testing.assert_allclose(adv.numpy(), np.array(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret.numpy(), adv.numpy() + values.numpy(), rtol=1e-6)


def test_compute_gae_lambda_one_is_discounted_return_minus_value():
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [0.25], [0.125]])
    adv, ret = ppo.compute_gae(rewards, values, torch.zeros(3, 1), torch.tensor([10.0]), torch.tensor([0.0]),
                               0.9, 1.0)
    expected = [1 + 0.9 * 2 + 0.81 * 3 + 0.729 * 10, 2 + 0.9 * 3 + 0.81 * 10, 3 + 0.9 * 10]
    np.testing.assert_allclose(ret[:, 0].numpy(), expected, rtol=1e-6)


def test_truncated_episode_is_bootstrapped_and_terminated_is_not():
    """With the reward of a truncated step already holding r + gamma*V(final obs) (as main() does), a done flag
    cuts the recursion; the terminated episode has only r."""
    gamma = 0.9
    v_final = 7.0
    rewards = torch.tensor([[1.0, 1.0]])
    rewards[0, 1] += gamma * v_final  # env 1 truncated, env 0 terminated
    adv, ret = ppo.compute_gae(rewards, torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([100.0, 100.0]),
                               torch.tensor([1.0, 1.0]), gamma, 0.95)
    assert ret[0, 0].item() == pytest.approx(1.0)
    assert ret[0, 1].item() == pytest.approx(1.0 + gamma * v_final)


def forever_env():
    """Reward 1 every step, never terminates; the time limit cuts it after 5 steps. Observation: the step's parity
    (the final observation is one the critic trains on). With truncation bootstrapped, V(s) = 1 / (1 - gamma) = 5 in
    every state (gamma 0.8); taking truncation for termination would give V(t) = (1 - gamma^(5 - t)) / (1 - gamma),
    3.4 ... 1.0."""
    import gymnasium as gym

    class Forever(gym.Env):
        observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float64)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return np.array([0.0]), {}

        def step(self, action):
            self.t += 1
            return np.array([float(self.t % 2)]), 1.0, False, False, {}

    return Forever()


def test_a_run_bootstraps_truncated_episodes_with_the_value_of_the_final_observation(tmp_path):
    import gymnasium as gym

    gym.register("ForeverDiscrete-v0", entry_point=forever_env, max_episode_steps=5)
    try:
        res = ppo.main(small_args(tmp_path, env_id="ForeverDiscrete-v0", total_timesteps=2000, num_steps=50,
                                  num_minibatches=2, update_epochs=10, learning_rate=1e-2, anneal_lr=False,
                                  gamma=0.8, gae_lambda=1.0, clip_vloss=False, max_grad_norm=100.0, seed=3,
                                  save_model=True))
    finally:
        del gym.registry["ForeverDiscrete-v0"]
    agent = ppo.Agent(1, 2)
    agent.load_state_dict(torch.load(os.path.join(res["run_dir"], "checkpoint.pt"), weights_only=True)["model"])
    with torch.no_grad():
        v = agent.get_value(torch.tensor([[0.0], [1.0]])).numpy()
    np.testing.assert_allclose(v, 5.0, atol=0.5)


def test_normalize_advantages():
    a = torch.tensor([1.0, 2.0, 3.0, 10.0])
    n = ppo.normalize_advantages(a)
    mean = sum(a.tolist()) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in a.tolist()) / 3)
    np.testing.assert_allclose(n.numpy(), [(x - mean) / (std + 1e-8) for x in a.tolist()], rtol=1e-6)
    assert abs(n.mean().item()) < 1e-6
    # a minibatch of equal advantages (a constant reward, say) has std 0: the eps keeps it at 0, not NaN
    assert ppo.normalize_advantages(torch.full((4,), 0.5)).tolist() == [0.0] * 4


def test_evaluation_plays_the_policy_on_the_environments_observations():
    """A hand-set controller (push the way the pole falls: theta + theta_dot / 2 > 0) holds CartPole for 500 steps;
    fed anything but the real observation (negated, zeros, another step's) it drops the pole within a few dozen."""
    agent = ppo.Agent(4, 2)
    with torch.no_grad():
        for p in agent.actor.parameters():
            p.zero_()
        agent.actor[0].weight[0, 2:] = torch.tensor([10.0, 5.0])
        agent.actor[2].weight[0, 0] = 1.0
        agent.actor[4].weight[:, 0] = torch.tensor([-1.0, 1.0])
    args = ppo.parse_args(["--eval-deterministic"])
    assert ppo.evaluate(agent, args, torch.device("cpu"), 2) == [500.0, 500.0]


# --------------------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------------------
def reference_policy_loss(ratios, advs, eps):
    terms = []
    for r, a in zip(ratios, advs):
        unclipped = r * a
        clipped = min(max(r, 1 - eps), 1 + eps) * a
        terms.append(-min(unclipped, clipped))
    return sum(terms) / len(terms)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_clipped_policy_loss_and_gradient(sign):
    eps = 0.2
    ratios = [0.5, 0.85, 1.0, 1.1, 1.3, 2.0]  # inside and outside the clip range on both sides
    advs = [sign * x for x in [1.0, 2.0, 0.5, 1.5, 3.0, 0.7]]
    old = torch.zeros(len(ratios))
    new = torch.tensor([math.log(r) for r in ratios], requires_grad=True)
    adv_t = torch.tensor(advs)
    zeros = torch.zeros(len(ratios))
    loss, stats = ppo.ppo_loss(new, old, adv_t, zeros, zeros, zeros, zeros, eps, False, 0.0, 0.0, False)
    assert stats["policy_loss"].item() == pytest.approx(reference_policy_loss(ratios, advs, eps), rel=1e-6)
    loss.backward()
    # The gradient is zero exactly where the clipped term is the active (smaller) objective.
    for i, (r, a) in enumerate(zip(ratios, advs)):
        clipped_active = (a > 0 and r > 1 + eps) or (a < 0 and r < 1 - eps)
        assert (new.grad[i].item() == 0.0) == clipped_active, (r, a)
    assert stats["clipfrac"].item() == pytest.approx(sum(abs(r - 1) > eps for r in ratios) / len(ratios))
    lr = [math.log(r) for r in ratios]
    assert stats["approx_kl"].item() == pytest.approx(sum((r - 1) - l for r, l in zip(ratios, lr)) / len(lr))
    assert stats["old_approx_kl"].item() == pytest.approx(-sum(lr) / len(lr))


def test_categorical_kl_is_the_exact_kl():
    torch.manual_seed(0)
    old, new = torch.randn(5, 4), torch.randn(5, 4)
    ref = [sum(math.exp(o) * (o - n) for o, n in zip(orow, nrow))
           for orow, nrow in zip(torch.log_softmax(old, -1).tolist(), torch.log_softmax(new, -1).tolist())]
    kl = ppo.categorical_kl(torch.log_softmax(old, -1), torch.log_softmax(new, -1))
    np.testing.assert_allclose(kl.numpy(), ref, rtol=1e-5)
    assert ppo.categorical_kl(torch.log_softmax(old, -1), torch.log_softmax(old, -1)).abs().max() < 1e-7


def test_kl_penalty_policy_loss_and_gradient():
    """The KL-penalty variant: -r*A + beta*KL(pi_old(.|s)||pi(.|s)) averaged, the KL exact, no clipping."""
    beta = 0.7
    torch.manual_seed(1)
    old_logits, logits = torch.randn(6, 3), torch.randn(6, 3)
    actions = torch.tensor([0, 1, 2, 2, 1, 0])
    advs = [1.0, -2.0, 0.5, 1.5, -3.0, 0.7]
    old_logp = torch.log_softmax(old_logits, -1)

    def loss_of(logits_):
        logp = torch.log_softmax(logits_, -1)
        z = torch.zeros(6)
        return ppo.ppo_loss(logp.gather(1, actions[:, None])[:, 0], old_logp.gather(1, actions[:, None])[:, 0],
                            torch.tensor(advs), z, z, z, z, 0.2, False, 0.0, 0.0, False,
                            kl_coef=torch.tensor(beta), kl=ppo.categorical_kl(old_logp, logp))

    x = logits.clone().requires_grad_(True)
    loss, stats = loss_of(x)
    loss.backward()
    # reference: a plain loop over the states, with torch.distributions' KL, differentiated on its own
    y = logits.clone().requires_grad_(True)
    terms = []
    for i in range(6):
        p_old, p = torch.distributions.Categorical(logits=old_logits[i]), torch.distributions.Categorical(logits=y[i])
        r = torch.exp(p.log_prob(actions[i]) - p_old.log_prob(actions[i]))
        terms.append(-r * advs[i] + beta * torch.distributions.kl_divergence(p_old, p))
    ref = torch.stack(terms).mean()
    ref.backward()
    assert stats["policy_loss"].item() == pytest.approx(ref.item(), abs=1e-6)  # float32 terms of size ~1
    np.testing.assert_allclose(x.grad.numpy(), y.grad.numpy(), rtol=1e-4, atol=1e-6)
    # at the start of an update (pi = pi_old) the penalty is 0 and so is its gradient
    _, at_start = loss_of(old_logits.clone())
    r_start = -sum(advs) / 6
    assert at_start["policy_loss"].item() == pytest.approx(r_start, rel=1e-6)


def test_rollout_kl_is_the_mean_kl_over_the_rollouts_states():
    """The d of the adaptive rule: KL(pi_old(.|s) || pi(.|s)) averaged over every state, in minibatches that do not
    divide the rollout (torch.distributions' KL as the reference)."""
    torch.manual_seed(0)
    agent, obs = ppo.Agent(4, 3), torch.randn(10, 4)
    old_logp_all = torch.log_softmax(torch.randn(10, 3), -1)
    penalty = ppo.KLPenalty(ppo.Args(kl_penalty_target=0.01), torch.device("cpu"))
    with torch.no_grad():
        new = torch.distributions.Categorical(logits=agent.actor(obs))
        want = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=old_logp_all), new).mean()
    for minibatch_size in (3, 10):
        assert torch.allclose(penalty.rollout_kl(agent.actor, obs, old_logp_all, minibatch_size), want, atol=1e-6)
    assert want > 0.01  # (not a trivial case)


def test_adapt_kl_coef_follows_the_papers_rule():
    assert ppo.adapt_kl_coef(1.0, 0.001, 0.01) == 0.5  # below target / 1.5
    assert ppo.adapt_kl_coef(1.0, 0.02, 0.01) == 2.0  # above 1.5 * target
    for kl in (0.0067, 0.01, 0.0149):  # inside the band: unchanged
        assert ppo.adapt_kl_coef(1.0, kl, 0.01) == 1.0
    assert ppo.adapt_kl_coef(1e-6, 0.0, 0.01) == 1e-6 and ppo.adapt_kl_coef(1e6, 1.0, 0.01) == 1e6  # bounded


def test_clipped_value_loss():
    eps = 0.2
    old_v = [0.0, 0.0, 1.0, 1.0, -1.0]
    new_v = [0.1, 0.5, 0.5, 1.3, -1.5]
    ret = [1.0, -1.0, 2.0, 1.25, 0.0]
    ref = []
    for o, n, r in zip(old_v, new_v, ret):
        clipped = o + min(max(n - o, -eps), eps)
        ref.append(max((n - r) ** 2, (clipped - r) ** 2))
    z = torch.zeros(5)
    _, stats = ppo.ppo_loss(z, z, z, torch.tensor(new_v), torch.tensor(old_v), torch.tensor(ret), z,
                            eps, True, 0.0, 0.5, False)
    assert stats["value_loss"].item() == pytest.approx(0.5 * sum(ref) / 5, rel=1e-6)
    _, stats = ppo.ppo_loss(z, z, z, torch.tensor(new_v), torch.tensor(old_v), torch.tensor(ret), z,
                            eps, False, 0.0, 0.5, False)
    assert stats["value_loss"].item() == pytest.approx(0.5 * sum((n - r) ** 2 for n, r in zip(new_v, ret)) / 5)


def test_total_loss_combines_terms():
    g = torch.Generator().manual_seed(3)
    new, old, adv = torch.randn(8, generator=g) * 0.3, torch.randn(8, generator=g) * 0.3, torch.randn(8, generator=g)
    nv, ov, ret, ent = (torch.randn(8, generator=g) for _ in range(4))
    r, a = (new - old).exp(), adv - adv.mean()
    assert ((r > 1.2) & (a > 0)).any() and ((r < 0.8) & (a < 0)).any()  # both clip bounds bind
    loss, _ = ppo.ppo_loss(new, old, adv, nv, ov, ret, ent, 0.2, True, 0.01, 0.5, True)
    # The reference, in plain Python from the inputs: CleanRL's clipped surrogate on advantages normalised with the
    # unbiased std, the clipped value loss, the entropy bonus.
    new, old, adv, nv, ov, ret, ent = (t.tolist() for t in (new, old, adv, nv, ov, ret, ent))
    n = len(adv)
    mean = sum(adv) / n
    std = math.sqrt(sum((a - mean) ** 2 for a in adv) / (n - 1))
    a_hat = [(a - mean) / (std + 1e-8) for a in adv]
    ratio = [math.exp(lp - lo) for lp, lo in zip(new, old)]
    pg = sum(max(-a * r, -a * min(max(r, 0.8), 1.2)) for a, r in zip(a_hat, ratio)) / n
    v = 0.5 * sum(max((x - r) ** 2, (o + min(max(x - o, -0.2), 0.2) - r) ** 2) for x, o, r in zip(nv, ov, ret)) / n
    assert loss.item() == pytest.approx(pg - 0.01 * sum(ent) / n + 0.5 * v, rel=1e-5)


def test_agent_sampling_matches_categorical_and_entropy():
    torch.manual_seed(0)
    agent = ppo.Agent(4, 3)
    with torch.no_grad():
        agent.actor[-1].weight.mul_(300)  # make the policy far from uniform
    x = torch.randn(1, 4).repeat(20000, 1)
    action, logprob, entropy, value = agent.get_action_and_value(x)
    dist = torch.distributions.Categorical(logits=agent.actor(x[:1]))
    freq = torch.bincount(action, minlength=3).float() / len(action)
    np.testing.assert_allclose(freq.numpy(), dist.probs[0].detach().numpy(), atol=0.015)
    np.testing.assert_allclose(logprob.detach().numpy(), dist.log_prob(action).detach().numpy(), rtol=1e-5,
                               atol=1e-6)
    assert entropy[0].item() == pytest.approx(dist.entropy().item(), rel=1e-5)
    assert value.shape == (20000,)


# --------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [("1e7", 10_000_000), ("5e5", 500_000), ("1_000_000", 1_000_000),
                                        ("1024", 1024)])
def test_counts_accept_scientific_notation(text, value):
    args = ppo.parse_args(["--total-timesteps", text, "--update-epochs", text])
    assert args.total_timesteps == value and args.update_epochs == value


def test_defaults_are_cleanrl_settings():
    a = ppo.parse_args([])
    assert (a.env_id, a.total_timesteps, a.learning_rate, a.num_envs, a.num_steps) == ("CartPole-v1", 500_000,
                                                                                       2.5e-4, 4, 128)
    assert (a.num_minibatches, a.update_epochs, a.clip_coef, a.ent_coef, a.vf_coef) == (4, 4, 0.2, 0.01, 0.5)
    assert (a.gamma, a.gae_lambda, a.max_grad_norm, a.anneal_lr, a.clip_vloss) == (0.99, 0.95, 0.5, True, True)


@pytest.mark.parametrize("argv,needle", [
    (["--kl-penalty-coef", "-0.5"], "must be >= 0"),
    (["--kl-penalty-target", "0"], "must be positive"),
    (["--target-kl", "-1"], "must be positive"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--seed", str(2**31)], "--seed must be < 2**31"),
    (["--num-envs", "2", "--num-steps", "2", "--num-minibatches", "4", "--total-timesteps", "512"], "at least 2"),
    (["--cudagraphs"], "needs --cuda"),
    (["--env-id", "Pendulum-v1", "--total-timesteps", "512"], "Discrete"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, argv, needle):
    """(the values every script checks: tests/test_faults.py)"""
    monkeypatch.setattr(ppo, "make_vector_env", lambda *a, **k: pytest.fail("bad input reached the envs"))
    with pytest.raises(ppo.Failure) as e:
        ppo.main(ppo.parse_args([*argv, "--runs-dir", str(tmp_path / "runs")]))
    assert e.value.code == 2 and "\n" not in str(e.value) and needle in str(e.value), str(e.value)
    assert not (tmp_path / "runs").exists()  # bad input leaves no run directory behind


@pytest.mark.parametrize("argv", [["--total-timesteps", "1.5e0"], ["--num-envs", "abc"], ["--vector-mode", "fast"],
                                  ["--no-such-flag"]])
def test_tyros_own_errors_exit_2(tmp_path, argv):
    with pytest.raises(SystemExit) as e:
        ppo.parse_args(argv)
    assert e.value.code == 2


# --------------------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------------------
def small_args(tmp_path, **kw):
    base = dict(total_timesteps=1024, num_envs=2, num_steps=64, runs_dir=str(tmp_path), exp_name="t")
    base.update(kw)
    return ppo.Args(**base)


def test_smoke_run_subprocess_logs_metrics(tmp_path):
    r = run_script("--total-timesteps", "512", "--num-envs", "2", "--num-steps", "64", "--runs-dir",
                   str(tmp_path), "--vector-mode", "async", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "global_step=512" in r.stdout and re.search(r"iter 4/4 .*  eta=0s\n", r.stdout)  # time left: none
    (run_dir,) = glob.glob(str(tmp_path / "CartPole-v1__ppo__1__*"))
    for tag in ["charts/episodic_return", "charts/episodic_length", "charts/learning_rate", "charts/SPS",
                "losses/value_loss", "losses/policy_loss", "losses/entropy", "losses/old_approx_kl",
                "losses/approx_kl", "losses/clipfrac", "losses/explained_variance"]:
        assert read_scalars(run_dir, tag), tag


def test_same_seed_same_run(tmp_path):
    a = ppo.main(small_args(tmp_path / "a"))
    b = ppo.main(small_args(tmp_path / "b"))
    c = ppo.main(small_args(tmp_path / "c", seed=2))
    assert a["stats"] == b["stats"] and a["returns"] == b["returns"]
    assert a["stats"] != c["stats"]


def test_save_resume_continues_step_count_and_lr_schedule(tmp_path):
    full = ppo.main(small_args(tmp_path / "full", total_timesteps=512, num_steps=32))  # 8 iterations
    first = ppo.main(small_args(tmp_path / "split", total_timesteps=512, num_steps=32, stop_after=3))
    assert first["global_step"] == 3 * 64
    ckpt = os.path.join(first["run_dir"], "checkpoint.pt")
    args = ppo.parse_args(["--resume", ckpt, "--stop-after", "3"])  # everything else comes from the checkpoint
    assert args.total_timesteps == 512 and args.num_steps == 32
    second = ppo.main(args)  # iterations 4-6
    assert second["run_dir"] == first["run_dir"] and second["global_step"] == 6 * 64
    third = ppo.main(ppo.parse_args(["--resume", ckpt]))  # the printed command: 7-8, the run's end
    assert third["global_step"] == full["global_step"] == 512
    assert torch.load(ckpt, weights_only=True)["iteration"] == 8  # without --save-model
    lr_full = read_scalars(full["run_dir"], "charts/learning_rate")
    lr_split = read_scalars(first["run_dir"], "charts/learning_rate")
    assert [s for s, _ in lr_split] == [s for s, _ in lr_full] == [64 * i for i in range(1, 9)]
    np.testing.assert_allclose([v for _, v in lr_split], [v for _, v in lr_full], rtol=1e-6)
    before = os.stat(ckpt).st_mtime_ns
    done = ppo.main(ppo.parse_args(["--resume", ckpt]))  # a finished run: nothing trains, nothing is written
    assert done["global_step"] == 512 and done["stats"] == {} and os.stat(ckpt).st_mtime_ns == before


def test_resume_with_another_rollout_size_is_one_line_exit_2(tmp_path):
    first = ppo.main(small_args(tmp_path, total_timesteps=512, num_steps=32, stop_after=1))
    ckpt = os.path.join(first["run_dir"], "checkpoint.pt")
    with pytest.raises(ppo.Failure) as e:
        ppo.main(ppo.parse_args(["--resume", ckpt, "--num-envs", "3"]))
    assert e.value.code == 2 and "written with --num-envs 2, which cannot change" in str(e.value)
    with pytest.raises(ppo.Failure) as e:  # another rollout length: the iteration count and lr schedule would jump
        ppo.main(ppo.parse_args(["--resume", ckpt, "--num-steps", "64"]))
    assert e.value.code == 2 and "written with --num-steps 32, which cannot change" in str(e.value)


def test_a_clipped_run_resumed_with_an_adaptive_kl_penalty_starts_its_coefficient_at_1(tmp_path):
    first = ppo.main(small_args(tmp_path, total_timesteps=512, num_steps=32, stop_after=1))
    ckpt = os.path.join(first["run_dir"], "checkpoint.pt")
    out = ppo.main(ppo.parse_args(["--resume", ckpt, "--kl-penalty-target", "0.01"]))
    assert out["global_step"] == 512 and math.isfinite(out["stats"]["kl"])


@pytest.mark.parametrize("script", ["ppo", "ppo_continuous", "ppo_atari_envpool"])
def test_optimizer_state_of_a_cuda_graph_run_resumes_here(script):
    """A checkpoint written by a --cuda --cudagraphs run holds capturable=True (and a CPU lr after map_location):
    loaded as torch does, the first step on the CPU fails; each script keeps its own optimizer settings instead."""
    mod = __import__(script)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    saved = torch.optim.Adam(net.parameters(), lr=torch.tensor(1e-2), eps=1e-5, fused=True)
    net(torch.randn(3, 4)).sum().backward()
    saved.step()
    state = saved.state_dict()
    state["param_groups"][0].update(capturable=True, fused=None)  # as a CUDA-graph run saves it
    mine = torch.optim.Adam(net.parameters(), lr=torch.tensor(5e-3), eps=1e-5, fused=True)
    plain = torch.optim.Adam(net.parameters(), lr=torch.tensor(5e-3), eps=1e-5, fused=True)
    plain.load_state_dict(state)
    with pytest.raises((AssertionError, RuntimeError)):
        plain.step()
    mod.load_optimizer_state(mine, state, torch.device("cpu"))
    g = mine.param_groups[0]
    assert g["fused"] and not g["capturable"] and torch.is_tensor(g["lr"]) and float(g["lr"]) == pytest.approx(1e-2)
    mine.step()
    assert mine.state[next(net.parameters())]["step"].item() == 2  # the saved step, then this one
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_evaluate_flattens_observations_as_training_does(monkeypatch):
    import gymnasium as gym

    monkeypatch.setattr(ppo, "make_env", lambda *a, **k: lambda: gym.wrappers.ReshapeObservation(
        gym.make("CartPole-v1"), (2, 2)))
    returns = ppo.evaluate(ppo.Agent(4, 2), ppo.Args(), torch.device("cpu"), 2)
    assert len(returns) == 2 and all(r >= 1 for r in returns)


def test_deterministic_evaluation_plays_the_most_likely_action(monkeypatch):
    import gymnasium as gym

    torch.manual_seed(0)
    agent = ppo.Agent(4, 2)
    with torch.no_grad():
        agent.actor[-1].bias.copy_(torch.tensor([0.0, 3.0]))  # "push right" most likely, yet not certain
    args = ppo.Args(eval_deterministic=True)
    monkeypatch.setattr(agent, "get_action_and_value", lambda *a, **k: pytest.fail("sampled an action"))
    returns = ppo.evaluate(agent, args, torch.device("cpu"), 2)
    env = gym.make("CartPole-v1")  # the same episodes played by "always push right"
    env.reset(seed=args.seed + 10_000)
    expected = []
    for _ in range(2):
        length, done = 0, False
        while not done:
            _, _, term, trunc, _ = env.step(1)
            length, done = length + 1, term or trunc
        expected.append(float(length))
        env.reset()
    assert returns == expected


def test_evaluate_a_saved_checkpoint(tmp_path, capsys):
    res = ppo.main(small_args(tmp_path, save_model=True))
    ckpt = os.path.join(res["run_dir"], "checkpoint.pt")
    r = run_script("--resume", ckpt, "--eval-episodes", "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "eval: 3 episodes, return" in r.stdout and "±" in r.stdout
    mean = float(r.stdout.split("return")[-1].split("±")[0])
    assert 8 <= mean <= 500  # a CartPole episode lasts between 8 and 500 steps
    capsys.readouterr()
    again = ppo.main(ppo.parse_args(["--resume", ckpt, "--eval-episodes", "2", "--eval-deterministic"]))
    assert "eval: 2 episodes (deterministic), return" in capsys.readouterr().out
    assert len(again["eval_returns"]) == 2 and all(8 <= x <= 500 for x in again["eval_returns"])


def test_load_policy_plays_the_saved_agent(tmp_path):
    res = ppo.main(small_args(tmp_path, total_timesteps=256, save_model=True))
    path = os.path.join(res["run_dir"], "checkpoint.pt")
    agent = ppo.Agent(4, 2)
    agent.load_state_dict(torch.load(path, weights_only=True)["model"])
    obs = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    with torch.no_grad():
        expected = agent.actor(torch.as_tensor(obs)).argmax(-1).numpy()
    greedy = ppo.load_policy(path, deterministic=True)
    assert (greedy(obs) == expected).all()  # a batch: one action per row
    assert np.ndim(greedy(obs[3])) == 0 and greedy(obs[3]) == expected[3]  # one observation: one action
    actions = ppo.load_policy(path)(np.repeat(obs[:1], 200, axis=0))  # sampled: the near-uniform policy plays both
    assert actions.shape == (200,) and set(actions.tolist()) == {0, 1}
    with pytest.raises(ValueError, match="expected"):
        greedy(np.zeros(5, dtype=np.float32))
    foreign = tmp_path / "foreign.pt"
    torch.save({"script": "ppo_continuous.py", "env_id": "Hopper-v5", "args": {}}, foreign)
    with pytest.raises(ppo.Failure, match="not a ppo.py checkpoint"):  # raised, not an exit of the caller
        ppo.load_policy(str(foreign))


def note_normalisation(adv, eps=1e-8):
    """The note's advantage averaging, written as its three lines: mean over T, sqrt of the mean square + eps."""
    n = len(adv)
    mean = sum(adv) / n
    sigma = math.sqrt(sum((a - mean) ** 2 for a in adv) / n + eps)
    return [(a - mean) / sigma for a in adv]


def test_norm_adv_scope_rollout_is_the_notes_normalisation_once_before_the_epochs(tmp_path, monkeypatch):
    adv = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3 + 1
    assert ppo.normalize_advantages_rollout(adv).tolist() == pytest.approx(note_normalisation(adv.tolist()), abs=1e-6)
    original, first_epoch = ppo.ppo_loss, {}
    for scope in ("minibatch", "rollout"):  # the same seed: the same rollout and shuffle before the first update
        seen = []
        monkeypatch.setattr(ppo, "ppo_loss", lambda *a, **k: seen.append((a[2].clone(), a[11])) or original(*a, **k))
        ppo.main(small_args(tmp_path / scope, total_timesteps=128, num_minibatches=4, norm_adv_scope=scope))
        assert len(seen) == 4 * 4 and {flag for _, flag in seen} == {scope == "minibatch"}  # ppo_loss: per minibatch?
        first_epoch[scope] = torch.cat([a for a, _ in seen[:4]])  # the 4 minibatches of epoch 1 cover the rollout
    # per minibatch: ppo_loss gets the raw GAE advantages (and standardises each minibatch itself); per rollout: the
    # note's normalisation of those same advantages, once, before the epochs
    raw = first_epoch["minibatch"]
    assert abs(raw.mean().item()) > 1e-3 or abs(raw.var().item() - 1) > 1e-2  # (not standardised already)
    assert first_epoch["rollout"].tolist() == pytest.approx(note_normalisation(raw.tolist()), abs=1e-5)


@pytest.mark.parametrize("variant", [{}, {"kl_penalty_target": 1e-7}], ids=["clip", "adaptive-kl"])
def test_compile_follows_eager_learning_path(tmp_path, variant):
    """(adaptive-kl: the compiled update reads the coefficient from a tensor that changes between iterations; a
    target far below the KL of an update doubles it each time)"""
    kw = dict(total_timesteps=256, num_steps=64, update_epochs=2, **variant)
    eager = ppo.main(small_args(tmp_path / "e", **kw))
    compiled = ppo.main(small_args(tmp_path / "c", compile=True, **kw))
    assert eager["returns"] == compiled["returns"]  # same actions sampled -> same episodes
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl") + (("kl",) if variant else ()):
        assert compiled["stats"][k] == pytest.approx(eager["stats"][k], rel=1e-3, abs=1e-5), k
    if variant:  # the penalty's terms are ~1e-4 here: a stale coefficient moves them by ~2%, more than abs=1e-5 sees
        for k in ("policy_loss", "kl"):
            assert compiled["stats"][k] == pytest.approx(eager["stats"][k], rel=1e-3, abs=0), k
        coefs = [v for _, v in read_scalars(compiled["run_dir"], "charts/kl_coef")]
        assert coefs == [v for _, v in read_scalars(eager["run_dir"], "charts/kl_coef")] and coefs[1] != coefs[0]


def test_wandb_offline_and_video_of_evaluation(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "ppo.py"), "--total-timesteps", "256", "--num-envs", "2",
                        "--num-steps", "64", "--runs-dir", str(tmp_path), "--track", "--eval-episodes", "2",
                        "--capture-video"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    videos = glob.glob(str(tmp_path / "CartPole-v1__ppo__1__*" / "videos" / "*.mp4"))
    assert len(videos) == 2
    assert glob.glob(str(tmp_path / "CartPole-v1__ppo__1__*" / "wandb" / "offline-run-*" / "*.wandb"))  # in the run


def test_ctrl_c_to_the_process_group_of_an_async_run_checkpoints_and_exits_cleanly(tmp_path):
    """A terminal's Ctrl-C reaches every process of the group: the async workers leave it to the main process,
    which finishes the iteration, writes the checkpoint and closes the envs (a worker that died of it broke the
    close with a BrokenPipeError traceback and exit code 1)."""
    rc, out, err = ctrl_c_after_first_iteration([os.path.join(ROOT, "ppo.py"), "--total-timesteps", "1e6",
                                                 "--vector-mode", "async", "--runs-dir", str(tmp_path)], tmp_path)
    assert rc == 0 and "Traceback" not in err, err
    assert "(SIGINT); continue with: python ppo.py --resume" in out
    assert len(glob.glob(str(tmp_path / "CartPole-v1__ppo__1__*" / "checkpoint.pt"))) == 1


def test_discrete_actions_that_do_not_start_at_0_are_one_line_error(capsys):
    import gymnasium as gym

    class Shifted(gym.Env):
        observation_space = gym.spaces.Box(-1.0, 1.0, (2,))
        action_space = gym.spaces.Discrete(3, start=-1)

    gym.register("ShiftedActions-v0", entry_point=Shifted)
    try:
        with pytest.raises(ppo.Failure) as e:
            ppo.validate(ppo.Args(env_id="ShiftedActions-v0"))
        assert e.value.code == 2 and "ppo.py needs Discrete actions from 0" in str(e.value)
    finally:
        del gym.registry["ShiftedActions-v0"]


def test_env_state_only_for_envs_whose_whole_state_is_saved():
    """An env whose state lives outside plain attributes (Box2D's world, an emulator) gets no snapshot: restoring
    part of it would continue another episode than the one saved. Stand-in: CartPole defined elsewhere."""
    import gymnasium as gym

    base = type(gym.make("CartPole-v1").unwrapped)
    outside = type("Elsewhere", (base,), {"__module__": "somewhere.box2d"})
    assert ppo.env_state(gym.vector.SyncVectorEnv([lambda: base()])) is not None
    assert ppo.env_state(gym.vector.SyncVectorEnv([lambda: outside()])) is None


def test_the_update_uses_the_kl_penalty_loss_with_a_fixed_coefficient(tmp_path, monkeypatch):
    seen = []

    def spy(*a, **k):
        seen.append(a[12] if len(a) > 12 else k.get("kl_coef"))
        kls.append(a[13] if len(a) > 13 else k.get("kl"))
        return original(*a, **k)

    original, original_kl = ppo.ppo_loss, ppo.categorical_kl
    monkeypatch.setattr(ppo, "ppo_loss", spy)
    kl_args = []  # (whether pi_old's log-probs carry a gradient, whether the new ones do) in each update
    monkeypatch.setattr(ppo, "categorical_kl", lambda old, new: torch.is_grad_enabled() and kl_args.append(
        (old.requires_grad, new.requires_grad)) or original_kl(old, new))
    kls = []
    res = ppo.main(small_args(tmp_path / "fixed", total_timesteps=256, kl_penalty_coef=0.3))  # 2 iterations
    assert len(seen) == 2 * 4 * 4 and all(torch.is_tensor(c) and c.item() == pytest.approx(0.3) for c in seen)
    # the exact KL of each state: 0 on the first minibatch of an update (pi = pi_old), positive later, and
    # KL(pi_old || pi): the stored rollout distribution first, the differentiated new one second
    assert all(kl.shape == (32,) and kl.requires_grad and (kl >= -1e-6).all() for kl in kls)
    assert kls[0].abs().max() < 1e-6 and kls[16].abs().max() < 1e-6 and kls[15].max() > 0
    assert kl_args == [(False, True)] * 32
    assert [v for _, v in read_scalars(res["run_dir"], "charts/kl_coef")] == pytest.approx([0.3, 0.3])
    assert len(read_scalars(res["run_dir"], "losses/kl")) == 2
    seen.clear()
    res = ppo.main(small_args(tmp_path / "clip", total_timesteps=256))
    assert len(seen) == 32 and all(c is None for c in seen)  # the clipped objective
    assert read_scalars(res["run_dir"], "charts/kl_coef") == []


@pytest.mark.parametrize("variant", [{}, {"kl_penalty_target": 1e-3}, {"env_id": "Acrobot-v1"},
                                     {"env_id": "MountainCar-v0"}], ids=["clip", "adaptive-kl", "acrobot", "mountaincar"])
def test_exact_resume_equals_uninterrupted_run(tmp_path, variant):
    """Stopped at an iteration boundary and resumed (sync envs, CPU): same parameters and logged losses, on each
    classic-control env with discrete actions (MountainCar keeps its state in a tuple); with the adaptive KL penalty
    the coefficient goes on from its adapted value."""
    kw = dict(total_timesteps=1024, num_envs=2, num_steps=64, save_model=True, **variant)  # 8 iterations
    full = ppo.main(small_args(tmp_path / "full", **kw))
    part = ppo.main(small_args(tmp_path / "split", stop_after=3, **kw))
    ckpt = os.path.join(part["run_dir"], "checkpoint.pt")
    assert torch.load(ckpt, weights_only=True)["episodes"][0]["ep_length"].max() > 0  # episodes in flight at the stop
    args = ppo.parse_args(["--resume", ckpt])
    rest = ppo.main(args)
    a = torch.load(os.path.join(full["run_dir"], "checkpoint.pt"), weights_only=True)
    b = torch.load(ckpt, weights_only=True)
    assert b["global_step"] == a["global_step"] == 1024
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert full["returns"][-3:] == rest["returns"][-3:]
    for tag in ("losses/policy_loss", "losses/value_loss", "charts/episodic_return"):
        assert read_scalars(full["run_dir"], tag) == read_scalars(part["run_dir"], tag), tag
    if "kl_penalty_target" in variant:
        coefs = read_scalars(part["run_dir"], "charts/kl_coef")
        assert coefs == read_scalars(full["run_dir"], "charts/kl_coef") and len(coefs) == 8
        assert len({v for _, v in coefs[3:]}) > 1 and coefs[3][1] != 1.0  # adapted before and after the resume
        kls = read_scalars(part["run_dir"], "losses/kl")
        for (_, beta), (_, kl), (_, nxt) in zip(coefs, kls, coefs[1:]):  # the paper's rule, step by step
            assert nxt == pytest.approx(ppo.adapt_kl_coef(beta, kl, 1e-3))
        assert b["kl_coef"] == a["kl_coef"] != 1.0


def test_unwritable_runs_dir_is_one_line_exit_1(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ppo.Failure) as e:
        ppo.main(small_args(tmp_path, runs_dir=str(blocker / "runs")))
    assert e.value.code == 1 and "cannot create the run directory" in str(e.value)


def test_eta_text():
    assert [ppo.eta_text(x) for x in (45.9, 200, 7500, 0, math.inf, -1)] == ["45s", "3m20s", "2h05m", "0s", "?", "?"]


def test_a_finished_run_resumed_trains_nothing_and_writes_nothing(tmp_path):
    res = ppo.main(small_args(tmp_path, total_timesteps=256, save_model=True))
    ckpt = os.path.join(res["run_dir"], "checkpoint.pt")
    before = os.stat(ckpt).st_mtime_ns
    done = ppo.main(ppo.parse_args(["--resume", ckpt]))
    assert done["global_step"] == 256 and done["stats"] == {} and os.stat(ckpt).st_mtime_ns == before


# --------------------------------------------------------------------------------------------------------------
# What a cluster does to a job (signals at any moment, name collisions, full disks, damaged checkpoints):
# tests/test_faults.py, for the three scripts
# --------------------------------------------------------------------------------------------------------------
