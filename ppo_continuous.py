"""PPO for continuous-action gymnasium environments (MuJoCo HalfCheetah-v5 by default), in one file.

    python ppo_continuous.py                                   # HalfCheetah-v5, 1M steps, CleanRL's settings
    python ppo_continuous.py --env-id Hopper-v5 --num-envs 4 --vector-mode async
    python ppo_continuous.py --resume runs/<run>/checkpoint.pt --eval-episodes 10 --capture-video
    torchrun --nproc-per-node 2 ppo_continuous.py              # data parallel: each process steps --num-envs envs

Read from the top: Args, environments and normalisation, Agent (diagonal Gaussian), the PPO math, the episodes in
flight (for an exact resume), then main(), whose loop is the note's five steps (docs/reading_guide.md). PPO ends at
the banner below main(); the flat helpers under it change nothing it computes.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import math
import multiprocessing
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro


@dataclass
class Args:  # Count: an int that also reads 1e6 (defined with the command line, below the banner)
    # The note's hyperparameters
    num_steps: Count = 2048  # T: steps per environment in each rollout
    update_epochs: Count = 10  # E: epochs over each rollout
    num_minibatches: Count = 32  # number of minibatches per epoch (each of M = num_envs * T / num_minibatches samples)
    clip_coef: float = 0.2  # epsilon: clip range of the probability ratio (and of the value clip)
    learning_rate: float = 3e-4  # alpha: Adam learning rate
    gamma: float = 0.99  # gamma: discount factor (also the discount of the reward scaler's running return)
    gae_lambda: float = 0.95  # lambda: GAE parameter
    vf_coef: float = 0.5  # c_v: value loss coefficient
    ent_coef: float = 0.0  # c_H: entropy bonus coefficient

    # Implementation details (CleanRL's, continuous control's) and the note's adaptive-KL-penalty variant
    anneal_lr: bool = True  # anneal the learning rate linearly to 0
    norm_adv: bool = True  # standardise the advantages (where: --norm-adv-scope)
    norm_adv_scope: Literal["minibatch", "rollout"] = "minibatch"  # per minibatch (CleanRL) or per rollout (the note)
    clip_vloss: bool = True  # clip the value loss as in the original PPO code
    max_grad_norm: float = 0.5  # global gradient norm clip
    target_kl: Optional[float] = None  # stop the epochs of an update early once approx_kl exceeds this
    norm_obs: bool = True  # normalise observations by their running mean/std (frozen in evaluation)
    obs_clip: float = 10.0  # clip normalised observations to [-obs_clip, obs_clip]
    norm_reward: bool = True  # scale rewards by the running std of the discounted return
    reward_clip: float = 10.0  # clip scaled rewards to [-reward_clip, reward_clip]
    kl_penalty_coef: Optional[float] = None  # KL-penalty variant: -r*A + coef*KL(pi_old||pi) (None: clip)
    kl_penalty_target: Optional[float] = None  # adaptive KL penalty: coef halves below target/1.5, doubles over 1.5x

    # Environment
    env_id: str = "HalfCheetah-v5"  # id of a gymnasium environment with a continuous (Box) action space
    total_timesteps: Count = 1_000_000  # total environment steps of the run
    num_envs: Count = 1  # number of parallel environments
    vector_mode: Literal["sync", "async"] = "sync"  # SyncVectorEnv (one process) or AsyncVectorEnv (one per env)

    # Run: seeds, devices, logging, checkpoints, evaluation
    exp_name: str = "ppo_continuous"  # name of this experiment (part of the run name)
    seed: Count = 1  # seed of the experiment (python, numpy, torch and the environments)
    torch_deterministic: bool = True  # deterministic torch algorithms (warn-only), cuDNN and cuBLAS
    cuda: bool = False  # run the networks on CUDA (these small MLPs train faster on the CPU)
    compile: bool = False  # torch.compile the action sampling and the update step
    cudagraphs: bool = False  # capture the action sampling and the update step each in one CUDA graph
    torch_threads: Count = 1  # torch CPU threads (1 is fastest for small networks)
    track: bool = False  # log to Weights & Biases (WANDB_MODE=offline works without network)
    wandb_project_name: str = "ppo-reference"  # wandb project name
    wandb_entity: Optional[str] = None  # wandb entity (team)
    capture_video: bool = False  # record the evaluation episodes in runs/<run>/videos (no DISPLAY: MUJOCO_GL=egl)
    save_model: bool = False  # write runs/<run>/checkpoint.pt at the end of training
    checkpoint_every: Count = 0  # also write the checkpoint every N iterations (0: only at the end with --save-model)
    resume: Optional[str] = None  # continue from this checkpoint.pt (flags not given take its values)
    stop_after: Count = 0  # stop after N iterations of this process, with a checkpoint (0: run to the end)
    eval_episodes: Count = 0  # after training (or right away for a finished --resume checkpoint) evaluate N episodes
    eval_deterministic: bool = False  # evaluate with the Gaussian's mean action instead of a sampled one
    runs_dir: str = "runs"  # directory that holds the runs


# --- Environments, and what the agent sees of them: normalised observations, scaled rewards ------------------
def make_env(env_id: str, idx: int = 0, capture_video: bool = False, video_dir: str = ""):
    def thunk():
        import gymnasium as gym

        if multiprocessing.parent_process() is not None:  # an async worker leaves a Ctrl-C (sent to the whole
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # process group) and SIGTERM to the main process, which
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # checkpoints: a dead worker would break its last step
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            return gym.wrappers.RecordVideo(env, video_dir, episode_trigger=lambda ep: True, disable_logger=True)
        return gym.make(env_id)

    return thunk


def make_vector_env(args: Args):  # SAME_STEP autoreset: the last obs is in info["final_obs"], no reset transitions
    import gymnasium as gym

    cls = gym.vector.SyncVectorEnv if args.vector_mode == "sync" else gym.vector.AsyncVectorEnv
    return cls([make_env(args.env_id, i) for i in range(args.num_envs)],
               autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


class RunningMeanStd:
    """Mean and population variance of a stream of vectors (Chan et al.'s parallel update, as in gymnasium)."""

    def __init__(self, shape: tuple = (), epsilon: float = 1e-4):  # count starts at epsilon (mean 0, var 1)
        self.mean, self.var = np.zeros(shape, dtype=np.float64), np.ones(shape, dtype=np.float64)
        self.count = float(epsilon)
        self.added = self.merged = None  # torchrun: samples added since the last merge, and that merge's state

    def update(self, x: np.ndarray) -> None:  # x: a batch (B, *shape) of new samples
        x = np.asarray(x, dtype=np.float64)
        b_count = x.shape[0]
        b_mean = x.sum(axis=0) / b_count  # = x.mean(0), x.var(0) without numpy's slow wrappers (hot loop)
        b_var = np.square(x - b_mean).sum(axis=0) / b_count
        delta, total = b_mean - self.mean, self.count + b_count
        self.mean = self.mean + delta * (b_count / total)
        self.var = (self.var * self.count + b_var * b_count + delta**2 * (self.count * b_count / total)) / total
        self.count = total
        if self.added is not None:
            self.added.update(x)

    def track_additions(self) -> None:  # torchrun: keep the state (alike on all ranks), collect new samples in added
        self.merged = (self.mean.copy(), self.var.copy(), self.count)
        self.added = RunningMeanStd(self.mean.shape, epsilon=0.0)

    def state_dict(self) -> dict:
        return {"mean": torch.tensor(self.mean), "var": torch.tensor(self.var),
                "count": torch.tensor(self.count, dtype=torch.float64)}

    def load_state_dict(self, state: dict) -> None:
        mean = state["mean"].numpy().astype(np.float64)
        if mean.shape != self.mean.shape:
            raise ValueError(f"normalisation statistics of shape {tuple(mean.shape)}, expected {self.mean.shape}")
        self.mean, self.var, self.count = mean, state["var"].numpy().astype(np.float64), float(state["count"])
        if self.added is not None:  # what this rank adds from now on, on top of the loaded state
            self.track_additions()


def normalize_obs(obs: np.ndarray, rms: RunningMeanStd, clip: float, eps: float = 1e-8) -> np.ndarray:
    """(obs - mean) / sqrt(var + eps), clipped to [-clip, clip]; uses the statistics as they are (no update)."""
    return np.clip((obs - rms.mean) / np.sqrt(rms.var + eps), -clip, clip)


def obs_tensor(obs, device: torch.device, rms: Optional[RunningMeanStd] = None, clip: float = 10.0) -> torch.Tensor:
    """Raw observations as the Agent takes them: normalised with rms as it is (None: not), float32 on `device`."""
    x = np.asarray(obs) if rms is None else normalize_obs(np.asarray(obs), rms, clip)
    return torch.from_numpy(x.astype(np.float32)).to(device)  # (numpy's cast: half torch's cost)


class RewardScaler:
    """Rewards / the running std of the discounted return G <- gamma * G + r (as gymnasium's NormalizeReward, no
    mean subtraction); G restarts at 0 after every episode end, termination or truncation."""

    def __init__(self, num_envs: int, gamma: float, clip: float = 10.0, eps: float = 1e-8):
        self.rms, self.ret = RunningMeanStd(()), np.zeros(num_envs, dtype=np.float64)
        self.gamma, self.clip, self.eps = gamma, clip, eps

    def __call__(self, reward: np.ndarray, done: np.ndarray) -> np.ndarray:
        self.ret = self.ret * self.gamma + reward
        self.rms.update(self.ret)
        scaled = np.clip(reward / np.sqrt(self.rms.var + self.eps), -self.clip, self.clip)
        self.ret[done] = 0.0
        return scaled


class Normalizer:
    """Details 6-9: observations normalised by their running mean/std (--norm-obs), rewards scaled (--norm-reward),
    both clipped. The statistics grow in rollouts only; evaluation and load_policy use them frozen."""

    def __init__(self, args: Args, obs_dim: int, device: torch.device, track_additions: bool = False):
        self.obs_rms = RunningMeanStd((obs_dim,))
        self.reward_scaler = RewardScaler(args.num_envs, args.gamma, args.reward_clip)
        self.args, self.device = args, device
        for rms in (self.obs_rms, self.reward_scaler.rms) if track_additions else ():  # torchrun: see merge_ranks
            rms.track_additions()

    def obs(self, raw: np.ndarray, update: bool = False) -> torch.Tensor:  # update: add them to the statistics first
        if update and self.args.norm_obs:
            self.obs_rms.update(raw)
        return obs_tensor(raw, self.device, self.obs_rms if self.args.norm_obs else None, self.args.obs_clip)

    def reward(self, raw: np.ndarray, done: np.ndarray) -> np.ndarray:
        return self.reward_scaler(raw, done) if self.args.norm_reward else np.asarray(raw, np.float64)


def merge_moments(parts: list) -> tuple[np.ndarray, np.ndarray, float]:
    """Mean, population variance and count of the union of disjoint sets, from each set's (mean, var, count), in
    `parts`' order (ranks that merge the same list agree bit for bit); Chan et al.'s formula for any number of sets:
        n = sum_i n_i,   mean = sum_i n_i mean_i / n,   var = sum_i n_i (var_i + (mean_i - mean)^2) / n."""
    count = sum(float(c) for _, _, c in parts)
    mean = sum(float(c) * np.asarray(m, dtype=np.float64) for m, _, c in parts) / count
    var = sum(float(c) * (np.asarray(v, dtype=np.float64) + np.square(np.asarray(m, dtype=np.float64) - mean))
              for m, v, c in parts) / count
    return mean, var, count


def merge_ranks(stats: list[RunningMeanStd], world: int) -> None:
    """Under torchrun, after each rollout (in which each rank normalised with its own data): each statistics becomes
    that of all ranks' data, the last merge's state combined with what each rank added since; one collective."""
    added = gather_objects([(rms.added.mean, rms.added.var, rms.added.count) for rms in stats], world)
    for i, rms in enumerate(stats):
        rms.mean, rms.var, rms.count = merge_moments([rms.merged] + [rank_added[i] for rank_added in added])
        rms.track_additions()


# --- Agent: separate actor and critic MLPs (64x64 tanh), orthogonal init, diagonal Gaussian policy -----------
def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)  # detail: orthogonal init with scaled gains
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int):
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)),
                                    nn.Tanh(), layer_init(nn.Linear(64, 1), std=1.0))
        self.actor_mean = nn.Sequential(  # detail: a small last-layer gain puts the mean near 0 at the start
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, act_dim), std=0.01))
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))  # detail: state-independent learnable log std

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def fused_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Actor and critic as one MLP with block-diagonal weights: the same function in half the ops, for the rollout
        (one tiny batch per env step); a fresh copy after each update. It buys 12% SPS at the defaults (CPU)."""
        a, c = self.actor_mean, self.critic
        with torch.no_grad():
            return [(torch.cat([a[0].weight, c[0].weight]), torch.cat([a[0].bias, c[0].bias])),
                    (torch.block_diag(a[2].weight, c[2].weight), torch.cat([a[2].bias, c[2].bias])),
                    (torch.block_diag(a[4].weight, c[4].weight), torch.cat([a[4].bias, c[4].bias]))]

    def get_action_and_value(self, x: torch.Tensor, action: Optional[torch.Tensor] = None, fused=None):
        """Sample (or score) an unclipped action: action, log pi(a|s), entropy, V(s); fused: fused_weights()."""
        return self(x, action, fused)[:4]

    def forward(self, x: torch.Tensor, action: Optional[torch.Tensor] = None, fused=None):
        """get_action_and_value and the Gaussian (mean, log std) of each state (for the KL variant's exact KL); the
        update calls the agent itself, so that DDP averages the gradients."""
        if fused is None:
            mean, value = self.actor_mean(x), self.get_value(x)
        else:
            (w1, b1), (w2, b2), (w3, b3) = fused
            out = F.linear(torch.tanh(F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2)), w3, b3)
            mean, value = out[..., :-1], out[..., -1]
        logstd, noise = self.actor_logstd.expand_as(mean), None
        if action is None:  # sampling: z = (a - mean) / std is the noise itself
            noise = torch.randn_like(mean)
            action = mean + torch.exp(logstd) * noise
        logprob, entropy = gaussian_logprob_entropy(mean, logstd, action, z=noise)
        return action, logprob, entropy, value, (mean, logstd)

    def act(self, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:  # to play, unclipped: sampled or mean
        return self.actor_mean(x) if deterministic else self.get_action_and_value(x)[0]


# --- The PPO math: pure functions (the tests check each against a plain loop) --------------------------------
def compute_gae(rewards, values, dones, next_value, next_done, gamma: float, lam: float):
    """GAE by the note's backward recursion, in numpy on the host: the values come over once per rollout (a T-step
    loop of tiny tensors costs ~5x more on the CPU, and ~1,150 kernel launches an iteration on CUDA).

    rewards, values, dones: (T, N) arrays; dones[t] = 1 if obs[t] came with a done (the transition at t-1 ended an
    episode, or a life in Atari). next_value, next_done: (N,) for the observation after the last step. Truncated
    episodes already carry gamma * V(final obs) in their last reward (bootstrap_truncated), so a done here always
    means "no bootstrap". Returns advantages and returns R_t = A_t + V(s_t), both (T, N).
    """
    T = rewards.shape[0]
    advantages = np.zeros_like(rewards)
    lastgaelam = np.zeros_like(next_value)
    for t in reversed(range(T)):
        if t == T - 1:
            nextnonterminal, nextvalues = 1.0 - next_done, next_value
        else:
            nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]  # TD error
        lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def bootstrap_truncated(reward: np.ndarray, terminations, truncations, infos, agent: Agent, norm: Normalizer,
                        gamma: float) -> None:
    """Truncation is not termination: reward += gamma * V(final obs) (in place) for the episodes that a time limit cut,
    the final observation normalised with the same statistics as the policy's inputs."""
    idx = np.nonzero(np.logical_and(truncations, np.logical_not(terminations)))[0]
    if len(idx):
        with torch.inference_mode():
            final_value = agent.get_value(norm.obs(np.stack(infos["final_obs"][idx])))
        reward[idx] += gamma * final_value.cpu().numpy()


def normalize_advantages(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / (std + eps), with the unbiased std as in CleanRL and the OpenAI baselines."""
    return (adv - adv.mean()) / (adv.std() + eps)


def normalize_advantages_rollout(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The note's advantage normalisation over the whole rollout: (A - mean) / sqrt(population variance + eps)."""
    return (adv - adv.mean()) / torch.sqrt(adv.var(unbiased=False) + eps)


def ppo_loss(newlogprob, oldlogprob, advantages, newvalue, oldvalue, returns, entropy,
             clip_coef: float, clip_vloss: bool, ent_coef: float, vf_coef: float, norm_adv: bool, kl_coef=None,
             kl=None):
    """Clipped policy loss + c_v * value loss - c_H * entropy, with statistics (all tensors, no host sync). kl_coef
    selects the KL-penalty policy loss instead: -r*A + kl_coef * kl, kl: each state's exact KL (gaussian_kl)."""
    logratio = newlogprob - oldlogprob
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()  # k3 estimator, unbiased and low variance
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    if norm_adv:
        advantages = normalize_advantages(advantages)
    pg_loss1 = -advantages * ratio
    if kl_coef is None:
        pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()
    else:
        pg_loss = (pg_loss1 + kl_coef * kl).mean()
    if clip_vloss:  # detail: value clipping around the old prediction
        v_unclipped = (newvalue - returns) ** 2
        v_clipped = oldvalue + torch.clamp(newvalue - oldvalue, -clip_coef, clip_coef)
        v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * ((newvalue - returns) ** 2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef
    stats = dict(policy_loss=pg_loss.detach(), value_loss=v_loss.detach(), entropy=entropy_loss.detach(),
                 old_approx_kl=old_approx_kl, approx_kl=approx_kl, clipfrac=clipfrac)
    return loss, stats


LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_logprob_entropy(mean: torch.Tensor, logstd: torch.Tensor, action: torch.Tensor, z=None):
    """log N(action; mean, exp(logstd)^2) and the entropy, summed over the (independent) action dimensions; z:
    (action - mean) / std where the caller has it. Cheaper in the hot loop than torch.distributions, compilable."""
    if z is None:
        z = (action - mean) * torch.exp(-logstd)
    logprob = (-0.5 * z * z - logstd - LOG_SQRT_2PI).sum(-1)
    entropy = (0.5 + LOG_SQRT_2PI + logstd).sum(-1)
    return logprob, entropy


def gaussian_kl(old_mean, old_logstd, mean, logstd) -> torch.Tensor:
    """KL(N(old_mean, old_std^2) || N(mean, std^2)) of each state, exact, summed over the diagonal's dimensions:
    log(std/old_std) + (old_std^2 + (old_mean - mean)^2) / (2 std^2) - 1/2 per dimension; (..., A) -> (...)."""
    return (logstd - old_logstd + (torch.exp(2 * old_logstd) + (old_mean - mean) ** 2) * (0.5 * torch.exp(-2 * logstd))
            - 0.5).sum(-1)


def adapt_kl_coef(coef: float, kl: float, target: float) -> float:
    """The PPO paper's rule: halve below target/1.5, double above 1.5*target; within [1e-6, 1e6]."""
    if kl < target / 1.5:
        coef /= 2
    elif kl > target * 1.5:
        coef *= 2
    return min(max(coef, 1e-6), 1e6)


class KLPenalty:
    """The note's adaptive-KL-penalty variant (PPO paper, sec. 4): the policy loss -r*A + beta * KL(pi_old || pi)
    (loss_terms); after each update the rollout's KL (rollout_kl) halves or doubles beta (adapt)."""

    def __init__(self, args: Args, device: torch.device):
        self.target = args.kl_penalty_target
        self.beta = 1.0 if args.kl_penalty_coef is None else args.kl_penalty_coef  # on the host, for the rule
        self.coef = torch.tensor(self.beta, device=device)  # in a tensor, which the (compiled) update reads

    def loss_terms(self, old_mean, old_logstd, mean, logstd) -> dict:  # ppo_loss's kl_coef and kl (a minibatch)
        return dict(kl_coef=self.coef, kl=gaussian_kl(old_mean, old_logstd, mean, logstd))

    @torch.no_grad()
    def rollout_kl(self, agent: Agent, b_obs, b_old_means, old_logstd, minibatch_size: int) -> torch.Tensor:
        """KL(pi_old || pi_theta) over the rollout's states after the update: the d of the adaptive rule."""
        total = torch.zeros((), device=b_obs.device)
        for start in range(0, len(b_obs), minibatch_size):
            mb = slice(start, start + minibatch_size)
            total += gaussian_kl(b_old_means[mb], old_logstd, agent.actor_mean(b_obs[mb]), agent.actor_logstd).sum()
        return total / len(b_obs)

    def adapt(self, kl: float) -> None:
        if self.target is not None:
            self.set(adapt_kl_coef(self.beta, kl, self.target))

    def set(self, beta: float) -> None:  # the coefficient of the next update (adapt; a resumed run's)
        self.beta = beta
        self.coef.fill_(beta)


# --- The episodes in flight, saved and restored for an exact resume (the checkpoint, below the banner, holds them)
EXACT_RESUME_MODULES = ("gymnasium.envs.classic_control", "gymnasium.envs.mujoco")  # whose whole state is saved


def env_state(envs) -> Optional[list]:
    """Each env of a SyncVectorEnv, enough to continue its episode bit for bit: the plain numbers and arrays of each
    wrapper and the env (TimeLimit's step counter, ...), its random generator, MuJoCo's state (mujoco_state). None
    for an AsyncVectorEnv and for envs whose state lives elsewhere (Box2D's world): the run starts new episodes."""
    if not hasattr(envs, "envs") or not envs.envs[0].unwrapped.__module__.startswith(EXACT_RESUME_MODULES):
        return None
    return [{"layers": [{k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in vars(layer).items()
                         if isinstance(v, (bool, int, float)) or isinstance(v, np.ndarray) and v.dtype.kind in "biuf"}
                        for layer in wrapper_layers(env)],
             "np_random": env.unwrapped.np_random.bit_generator.state, "mujoco": mujoco_state(env.unwrapped)}
            for env in envs.envs]


def load_env_state(envs, snapshot: list) -> None:
    for env, saved in zip(envs.envs, snapshot, strict=True):
        for layer, plain in zip(wrapper_layers(env), saved["layers"], strict=True):
            for k, v in plain.items():
                setattr(layer, k, v.numpy().copy() if isinstance(v, torch.Tensor) else v)
        env.unwrapped.np_random.bit_generator.state = saved["np_random"]
        if saved["mujoco"] is not None:
            set_mujoco_state(env.unwrapped, saved["mujoco"])


def wrapper_layers(env) -> list:  # the wrappers of an env, outermost first, then the env itself
    return [env, *wrapper_layers(env.env)] if hasattr(env, "env") else [env]


def mujoco_state(env) -> Optional[dict]:
    """A MuJoCo env's state by MuJoCo's own functions (None for other envs): mj_getState's integration state (time,
    qpos, qvel, act, warm start, ctrl, ...), whence every later step follows, and the body positions at the last
    step's start (xpos, xipos), which Ant's and Humanoid's rewards read (mj_forward would give those of its end)."""
    if type(getattr(env, "data", None)).__module__.split(".")[0] != "mujoco":
        return None
    import mujoco

    state = np.empty(mujoco.mj_stateSize(env.model, mujoco.mjtState.mjSTATE_INTEGRATION))
    mujoco.mj_getState(env.model, env.data, state, mujoco.mjtState.mjSTATE_INTEGRATION)
    return {"integration": torch.from_numpy(state), "xpos": torch.tensor(env.data.xpos),
            "xipos": torch.tensor(env.data.xipos)}


def set_mujoco_state(env, saved: dict) -> None:
    import mujoco

    state = saved["integration"].numpy()
    if state.shape != (mujoco.mj_stateSize(env.model, mujoco.mjtState.mjSTATE_INTEGRATION),):
        raise ValueError(f"a MuJoCo state of {state.size} numbers for a model of another size")
    mujoco.mj_setState(env.model, env.data, state, mujoco.mjtState.mjSTATE_INTEGRATION)
    mujoco.mj_forward(env.model, env.data)  # the quantities derived from the state (contacts, sensors, ...)
    env.data.xpos[...], env.data.xipos[...] = saved["xpos"].numpy(), saved["xipos"].numpy()


def load_episodes(ckpt: dict, rank: int, args: Args, envs, episodes: dict, norm: Normalizer, device) -> tuple:
    """This rank's episodes in flight from the checkpoint: (next_obs, next_done); (None, zeros) where they cannot go
    on (async envs, another kind of env) and the run starts new episodes."""
    saved, n = ckpt["episodes"][rank], args.num_envs
    exact = saved["envs"] is not None and args.vector_mode == "sync"
    if rank == 0:
        print(f"resumed {args.resume} at iteration {ckpt['iteration']}, global step {ckpt['global_step']}"
              + ("" if exact else " (the environments start new episodes)"))
    if not exact:
        return None, np.zeros(n, dtype=np.float32)

    def fitted(x: torch.Tensor, *shape: int) -> np.ndarray:
        if tuple(x.shape) != shape:
            raise ValueError(f"a saved state of shape {tuple(x.shape)}, expected {shape}")
        return x.numpy()

    load_env_state(envs, saved["envs"])
    episodes["return"][:], episodes["length"][:] = fitted(saved["ep_return"], n), fitted(saved["ep_length"], n)
    norm.reward_scaler.ret[:] = fitted(saved["reward_ret"], n)
    next_obs = torch.from_numpy(fitted(saved["next_obs"], n, envs.single_observation_space.shape[0])).to(device)
    return next_obs, fitted(saved["next_done"], n).astype(np.float32)


# --- Training loop -------------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    rank, world, device = setup_distributed(args.cuda)  # torchrun: one process per rank (gloo, or NCCL per GPU)
    ckpt = load_checkpoint(args.resume) if args.resume else None
    run_dir = make_run_dir(args, rank, world)

    # Seeding (each rank its own stream)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    set_torch_determinism(args.torch_deterministic)
    torch.set_num_threads(args.torch_threads)
    batch_size = args.num_envs * args.num_steps  # per process; under torchrun the global batch is world times it
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // (batch_size * world)

    # Environments, reset with one seed per env and rank (offset on a resume that cannot restore its episodes)
    envs = make_vector_env(args)
    (obs_dim,), (act_dim,) = envs.single_observation_space.shape, envs.single_action_space.shape
    act_low, act_high = envs.single_action_space.low, envs.single_action_space.high
    offset = ckpt["global_step"] if ckpt is not None else 0
    next_obs_np, _ = envs.reset(seed=[args.seed + offset + rank * args.num_envs + i for i in range(args.num_envs)])
    next_done = np.zeros(args.num_envs, dtype=np.float32)
    episodes = {"return": np.zeros(args.num_envs), "length": np.zeros(args.num_envs, dtype=np.int64), "recent": []}
    norm = Normalizer(args, obs_dim, device, track_additions=world > 1)  # details 6-9; merge_ranks: see the loop
    agent = Agent(obs_dim, act_dim).to(device)
    # lr in a tensor: annealing recompiles nothing; CPU: fused Adam (one kernel); CUDA: capturable (no host sync)
    optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(args.learning_rate, device=device), eps=1e-5,
                                 capturable=args.cuda, fused=True if not args.cuda else None)
    kl_penalty = KLPenalty(args, device) if (args.kl_penalty_coef, args.kl_penalty_target) != (None, None) else None
    first_iteration, global_step, next_obs = 1, 0, None
    if ckpt is not None:  # exact resume: networks, Adam, RNG, statistics, KL coefficient, the episodes in flight
        with checkpoint_fits(args.resume):
            check_resume(ckpt, args, world)  # the same env, processes, rollout and normalisation switches
            agent.load_state_dict(ckpt["model"])
            load_optimizer_state(optimizer, ckpt["optimizer"], device)
            set_rng_state(ckpt["rng"][rank], device)
            norm.obs_rms.load_state_dict(ckpt["obs_rms"])
            norm.reward_scaler.rms.load_state_dict(ckpt["return_rms"])
            if kl_penalty and args.kl_penalty_target is not None and ckpt["kl_coef"] is not None:
                kl_penalty.set(ckpt["kl_coef"])  # the adapted coefficient goes on
            next_obs, next_done = load_episodes(ckpt, rank, args, envs, episodes, norm, device)  # (where they can)
            first_iteration, global_step = ckpt["iteration"] + 1, ckpt["global_step"]
    writer = open_logs(args, run_dir, rank, resumed=ckpt is not None)  # TensorBoard; wandb with --track
    if next_obs is None:  # new episodes: their first observations join the statistics (unless nothing is left to do)
        next_obs = norm.obs(next_obs_np, update=first_iteration <= num_iterations)
    train_agent = agent if world == 1 else nn.parallel.DistributedDataParallel(  # DDP averages the update's gradients
        agent, device_ids=[device.index] if args.cuda else None)  # (every rank steps its own envs)
    norm_per_minibatch = args.norm_adv and args.norm_adv_scope == "minibatch"

    def policy(obs, fused):  # the rollout's action sampling (actor and critic fused: Agent.fused_weights)
        action, logprob, _, value, (mean, _) = agent(obs, fused=fused)
        return action, logprob, value, mean

    def update(mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values, mb_old_means, old_logstd):
        """One gradient step on one minibatch."""
        optimizer.zero_grad(set_to_none=False)
        _, newlogprob, entropy, newvalue, (mean, logstd) = train_agent(mb_obs, mb_actions)
        penalty = kl_penalty.loss_terms(mb_old_means, old_logstd, mean, logstd) if kl_penalty else {}
        loss, stats = ppo_loss(newlogprob, mb_logprobs, mb_advantages, newvalue, mb_values, mb_returns, entropy,
                               args.clip_coef, args.clip_vloss, args.ent_coef, args.vf_coef, norm_per_minibatch,
                               **penalty)
        loss.backward()
        stats["grad_norm"] = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return stats

    policy, update = compile_hot_functions(policy, update, agent, args)  # --compile, --cudagraphs
    # Rollout storage (T, N, ...), rewards and dones on the host (numpy, from the envs); old_means: the KL variant's
    obs = torch.zeros((args.num_steps, args.num_envs, obs_dim), device=device)
    actions, old_means = (torch.zeros((args.num_steps, args.num_envs, act_dim), device=device) for _ in range(2))
    logprobs, values = (torch.zeros((args.num_steps, args.num_envs), device=device) for _ in range(2))
    rewards, dones = (np.zeros((args.num_steps, args.num_envs), dtype=np.float32) for _ in range(2))
    # the final checkpoint: asked for, or the run writes them anyway (and the model is on disk before evaluation)
    save_final = args.save_model or args.checkpoint_every or args.stop_after or args.eval_episodes or ckpt is not None
    last_checkpoint = os.path.abspath(args.resume) if args.resume else None
    clock, stats, eval_returns = {"start": time.time(), "steps": global_step, "printed": 0.0}, {}, None
    with StopSignals() as signals:  # SIGTERM / Ctrl-C are honoured at the end of an iteration
        for iteration in range(first_iteration, num_iterations + 1):
            lr_now = args.learning_rate
            if args.anneal_lr:  # detail: linear annealing to 0 over the whole run
                lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
            optimizer.param_groups[0]["lr"].fill_(lr_now)

            # 1. Collect rollout with pi_old, the policy as it is now (fused for speed; its log std for the KL variant)
            fused, old_logstd = agent.fused_weights(), agent.actor_logstd.detach().clone()
            for step in range(args.num_steps):
                global_step += args.num_envs * world  # environment steps of all processes
                obs[step], dones[step] = next_obs, next_done
                with torch.inference_mode():
                    action, logprob, value, mean = policy(next_obs, fused)
                actions[step], logprobs[step], values[step], old_means[step] = action, logprob, value, mean

                # detail: clip to the action bounds for the env only; the buffer keeps the sample the log-prob is of
                next_obs_np, raw_reward, terminations, truncations, infos = envs.step(
                    np.clip(action.cpu().numpy(), act_low, act_high))
                done = np.logical_or(terminations, truncations)
                count_episodes(writer, episodes, raw_reward, done, global_step)  # charts/episodic_return, _length
                next_obs = norm.obs(next_obs_np, update=True)  # detail: observation normalisation and clipping
                reward = norm.reward(raw_reward, done)  # detail: reward scaling and clipping
                # Truncation is not termination: r + gamma * V(final obs) where a time limit cut the episode
                bootstrap_truncated(reward, terminations, truncations, infos, agent, norm, args.gamma)
                rewards[step], next_done = reward, done.astype(np.float32)
            if world > 1:  # every rank's normalisation statistics become those of all ranks' data
                merge_ranks([norm.obs_rms, norm.reward_scaler.rms], world)

            # 2. Compute advantages and returns (GAE), on the host where the rewards are
            with torch.inference_mode():
                next_value = agent.get_value(next_obs).cpu().numpy()
            advantages, returns = compute_gae(rewards, values.cpu().numpy(), dones, next_value, next_done, args.gamma,
                                              args.gae_lambda)
            b_obs, b_actions = obs.reshape(batch_size, obs_dim), actions.reshape(batch_size, act_dim)
            b_logprobs, b_values, b_old_means = logprobs.reshape(-1), values.reshape(-1), old_means.reshape(-1, act_dim)
            b_advantages, b_returns = (torch.from_numpy(x).to(device).reshape(-1) for x in (advantages, returns))

            # 3. Advantage normalisation: by default per minibatch inside ppo_loss (CleanRL's); the note's form,
            # once over the whole rollout, with --norm-adv-scope rollout
            if args.norm_adv and not norm_per_minibatch:
                b_advantages = normalize_advantages_rollout(b_advantages)

            # 4. Optimise policy & value for E epochs
            update_stats = []
            for epoch in range(args.update_epochs):
                b_inds = torch.randperm(batch_size, device=device)  # shuffle, then split into minibatches
                for start in range(0, batch_size, minibatch_size):
                    mb = b_inds[start:start + minibatch_size]
                    mb_stats = update(b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb], b_returns[mb],
                                      b_values[mb], b_old_means[mb], old_logstd)
                    update_stats.append({k: v.clone() for k, v in mb_stats.items()})  # a CUDA graph reuses outputs
                if args.target_kl is not None and all_ranks_mean(mb_stats["approx_kl"], world) > args.target_kl:
                    break  # detail: early stop of the epochs

            # 5. Update reference policy: theta_old <- theta, implicitly (the next rollout samples from theta). The
            # KL-penalty variant measures KL(pi_old || pi_theta) over the rollout and adapts its coefficient to it.
            kl = kl_penalty.rollout_kl(agent, b_obs, b_old_means, old_logstd, minibatch_size) if kl_penalty else None
            stats = iteration_stats(update_stats, world, signals, kl)  # the one host sync: all ranks' means, signals
            check_finite(stats, iteration, last_checkpoint)  # a non-finite update stops here (exit 1)
            stats["explained_variance"] = explained_variance(b_values.cpu().numpy(), b_returns.cpu().numpy())
            log_iteration(writer, args, stats, lr_now, kl_penalty, global_step, iteration, num_iterations,
                          batch_size * world, episodes["recent"], clock)  # TensorBoard, the progress line
            if kl_penalty:
                kl_penalty.adapt(stats["kl"])  # the coefficient of the next update

            stop = stats["signals"] > 0 or 0 < args.stop_after <= iteration - first_iteration + 1
            if stop or (args.checkpoint_every and iteration % args.checkpoint_every == 0) or (
                    iteration == num_iterations and save_final):
                last_checkpoint = save_state(run_dir, args, agent, optimizer, norm, kl_penalty, iteration, global_step,
                                             (envs, next_obs, next_done, episodes), rank, world)
            if stop and iteration < num_iterations:
                if rank == 0:
                    say_stopped(iteration, signals, stats, args, world, last_checkpoint)  # and how to continue
                break
        else:  # the trained model is on disk before the evaluation starts; a signal stops the evaluation cleanly
            if args.eval_episodes and rank == 0:
                eval_returns = evaluate(agent, args, device, args.eval_episodes, norm.obs_rms,
                                        os.path.join(run_dir, "videos"), stop=lambda: bool(signals.received))
                eval_returns = log_evaluation(writer, args, eval_returns, global_step, signals, last_checkpoint)
    close_run([envs], writer, args, world)
    return {"global_step": global_step, "run_dir": run_dir, "stats": stats, "returns": episodes["recent"],
            "agent": agent, "obs_rms": norm.obs_rms, "return_rms": norm.reward_scaler.rms,
            **({"eval_returns": eval_returns} if eval_returns is not None else {})}


# =========================================================================================================
# Plumbing: nothing below this line changes what PPO computes. torchrun, the run directory, logging,
# checkpoints, evaluation and load_policy, compile helpers, the command line and its one error boundary.
# =========================================================================================================
SCRIPT = "ppo_continuous.py"


class Failure(Exception):  # [SHARED] one line from __main__: exit 2 bad input / a checkpoint that does not fit, else 1
    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def setup_distributed(cuda: bool) -> tuple[int, int, torch.device]:  # [SHARED] rank, world size, device
    world, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:  # gloo on the CPU, NCCL with one GPU per rank
        torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=1))
    return int(os.environ.get("RANK", "0")), world, device


def all_ranks_mean(x: torch.Tensor, world: int) -> torch.Tensor:  # [SHARED]
    if world > 1:
        torch.distributed.all_reduce(x := x.clone())
    return x / world


def gather_objects(obj, world: int) -> list:  # [SHARED] [obj of rank 0, obj of rank 1, ...] on every rank
    out = [obj] * world
    if world > 1:
        torch.distributed.all_gather_object(out, obj)
    return out


def set_torch_determinism(on: bool) -> None:  # [SHARED] fresh CUDA memory is not NaN-filled: every buffer is written
    torch.backends.cudnn.deterministic = on
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def make_run_dir(args, rank: int, world: int) -> str:  # [SHARED] the resumed one, or a new one made by rank 0
    if args.resume:
        return os.path.dirname(os.path.abspath(args.resume))
    base = os.path.join(args.runs_dir, f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
    run_dir, n = base, 1
    while rank == 0:
        try:
            os.makedirs(run_dir)
            break
        except FileExistsError:  # another run started in the same second
            n, run_dir = n + 1, f"{base}-{n + 1}"
        except OSError as e:
            raise Failure(f"cannot create the run directory {run_dir}: {e.strerror or e}", code=1) from None
    return gather_objects(run_dir, world)[0]


def open_logs(args, run_dir: str, rank: int, resumed: bool):  # [SHARED] TensorBoard (wandb with --track), rank 0
    if rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True, config=vars(args),
                   name=os.path.basename(run_dir), id=os.path.basename(run_dir), resume="allow", dir=run_dir)
    writer = SummaryWriter(run_dir)
    atexit.register(writer.close)  # a run that ends on a Failure still writes its last scalars
    if not resumed:
        table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
        writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    return writer


class StopSignals:  # [SHARED] while active, SIGTERM / SIGINT are noted (main stops at the end of the iteration)
    def __enter__(self):
        self.received: list[int] = []
        self.previous = {s: signal.signal(s, lambda signum, _: self.received.append(signum))
                         for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def check_finite(stats: dict, iteration: int, last_checkpoint: Optional[str]) -> None:  # [SHARED]
    if bad := [k for k, v in stats.items() if not math.isfinite(v)]:
        kept = f"last checkpoint: {last_checkpoint}" if last_checkpoint else "no checkpoint was written"
        raise Failure(f"non-finite {', '.join(bad)} at iteration {iteration}; stopping ({kept})", code=1)


def eta_text(seconds: float) -> str:  # [SHARED] 2h05m, 13m20s or 45s ("?" before the speed is known)
    s = int(seconds) if 0 <= seconds < math.inf else -1
    h, m = s // 3600, s // 60 % 60
    return "?" if s < 0 else f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s" if m else f"{s}s"


def explained_variance(y_pred: np.ndarray, y_true: np.ndarray) -> float:  # [SHARED]
    var_y = np.var(y_true)
    return float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y)


def launcher(world: int) -> str:  # [SHARED]
    return f"{f'torchrun --nproc-per-node {world}' if world > 1 else 'python'} {SCRIPT}"


def count_episodes(writer, episodes: dict, reward: np.ndarray, done: np.ndarray, global_step: int) -> None:
    episodes["return"] += reward  # a step's raw rewards; the episodes that end are logged, their returns kept
    episodes["length"] += 1
    for i in np.nonzero(done)[0]:
        episodes["recent"].append(float(episodes["return"][i]))
        if writer is not None:
            writer.add_scalar("charts/episodic_return", episodes["return"][i], global_step)
            writer.add_scalar("charts/episodic_length", episodes["length"][i], global_step)
    episodes["return"][done], episodes["length"][done] = 0.0, 0


def iteration_stats(update_stats: list[dict], world: int, signals: StopSignals, kl=None) -> dict:
    # The one host sync: the update's statistics (and the rollout's KL), means over minibatches and ranks; signals
    stats = {k: torch.stack([s[k] for s in update_stats]).mean() for k in update_stats[0]} | (
        {} if kl is None else {"kl": kl})
    stats["signals"] = torch.full_like(stats["approx_kl"], float(bool(signals.received)))
    stats = dict(zip(stats, all_ranks_mean(torch.stack([v.float() for v in stats.values()]), world).tolist()))
    return {**stats, "signals": round(stats["signals"] * world)}


def log_iteration(writer, args: Args, stats: dict, lr: float, kl_penalty, global_step: int, iteration: int,
                  num_iterations: int, steps_per_iteration: int, recent: list, clock: dict) -> None:
    if writer is None:  # rank 0: TensorBoard's scalars and, every 5 s and at the end, the progress line
        return
    rate = (global_step - clock["steps"]) / max(time.time() - clock["start"], 1e-9)  # steps/s, all processes
    scalars = {"charts/learning_rate": lr, "charts/SPS": int(rate), **{f"losses/{k}": stats[k] for k in (
        "value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "explained_variance")},
        **({"losses/kl": stats["kl"], "charts/kl_coef": kl_penalty.beta} if kl_penalty else {})}  # (this update's)
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, global_step)
    if time.time() - clock["printed"] >= 5.0 or iteration == num_iterations:
        clock["printed"] = time.time()
        eta = eta_text((num_iterations - iteration) * steps_per_iteration / rate if rate > 0 else math.inf)
        kl = f"  kl={stats['kl']:.4f} kl_coef={kl_penalty.beta:.3g}" if kl_penalty else ""
        print(f"iter {iteration}/{num_iterations}  global_step={global_step}  SPS={int(rate)}  return(last 20)="
              f"{np.mean(recent[-20:]) if recent else math.nan:.1f}  approx_kl={stats['approx_kl']:.4f}{kl}  eta={eta}",
              flush=True)


def say_stopped(iteration: int, signals: StopSignals, stats: dict, args: Args, world: int, path: str) -> None:
    why = signal.Signals(signals.received[0]).name if signals.received else (
        "a signal to another rank" if stats["signals"] > 0 else f"--stop-after {args.stop_after}")
    print(f"stopped at iteration {iteration} ({why}); continue with: {launcher(world)} --resume {path}", flush=True)


def evaluate(agent: Agent, args: Args, device: torch.device, episodes: int, obs_rms: RunningMeanStd,
             video_dir: str = "", stop=lambda: False) -> list[float]:  # raw returns (fewer once stop() says so)
    env = make_env(args.env_id, 0, args.capture_video, video_dir)()
    try:
        obs, _ = env.reset(seed=args.seed + 10_000)  # (RecordVideo renders its first frame here)
    except Exception as e:
        if not args.capture_video:
            raise
        raise Failure(f"--capture-video: cannot render {args.env_id} offscreen: {type(e).__name__}: {first_line(e)} "
                      "(headless: MUJOCO_GL=egl or MUJOCO_GL=osmesa)") from None
    returns, ep_ret = [], 0.0
    while len(returns) < episodes and not stop():
        with torch.inference_mode():
            action = agent.act(obs_tensor(obs[None], device, obs_rms if args.norm_obs else None, args.obs_clip),
                               args.eval_deterministic)
        obs, r, term, trunc, _ = env.step(np.clip(action[0].cpu().numpy(), env.action_space.low, env.action_space.high))
        ep_ret += float(r)
        if term or trunc:
            returns.append(ep_ret)
            ep_ret = 0.0
            if len(returns) < episodes:  # no reset after the last one: RecordVideo would start an empty video
                obs, _ = env.reset()
    env.close()
    return returns


def log_evaluation(writer, args: Args, returns: list, step: int, signals: StopSignals, path: str) -> Optional[list]:
    if signals.received:  # the evaluation's returns, or None after a stop signal, which the line says
        return print(f"stopped during the evaluation ({signal.Signals(signals.received[0]).name}); the trained model "
                     f"is in {path}", flush=True)
    writer.add_scalar("eval/episodic_return", float(np.mean(returns)), step)
    print(f"eval: {len(returns)} episodes{' (deterministic)' if args.eval_deterministic else ''}, return "
          f"{np.mean(returns):.2f} ± {np.std(returns):.2f}")
    return returns


def close_run(envs: list, writer, args: Args, world: int) -> None:  # envs: the vector envs (Atari: its pools)
    for env in envs:
        env.close()
    if writer is not None:
        writer.close()
        if args.track:
            import wandb
            wandb.finish()
    if world > 1:
        torch.distributed.barrier()  # (rank 0 may still be evaluating: the ranks leave the group together)
        torch.distributed.destroy_process_group()


# --- checkpoints ------------------------------------------------------------------------------------------
def save_checkpoint(path: str, state: dict) -> None:  # [SHARED] through a temporary file: the last one survives a kill
    try:
        with open(f"{path}.tmp", "wb") as f:
            torch.save(state, f)
        os.replace(f"{path}.tmp", path)
    except Exception as e:
        with contextlib.suppress(OSError):
            os.remove(f"{path}.tmp")
        cause = next((c for c in (e, e.__cause__, e.__context__) if isinstance(c, OSError)), None)  # (torch wraps it)
        if cause is None:
            raise
        kept = "the previous checkpoint is kept" if os.path.exists(path) else "no checkpoint was written"
        raise Failure(f"cannot write {path}: {cause.strerror or cause} ({kept})", code=1) from None


def load_checkpoint(path: str) -> dict:  # [SHARED]
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise Failure(f"cannot read checkpoint {path}: {type(e).__name__}: {first_line(e)}") from None
    if not isinstance(ckpt, dict) or ckpt.get("script") != SCRIPT:
        raise Failure(f"{path} is not a {SCRIPT} checkpoint")
    return ckpt


@contextlib.contextmanager
def checkpoint_fits(path: str):  # [SHARED] what torch or the envs raise on a checkpoint that does not fit: one line
    try:
        yield
    except Failure:
        raise
    except Exception as e:
        raise Failure(f"checkpoint {path} does not fit this run: {type(e).__name__}: {first_line(e)}") from None


def first_line(e: BaseException) -> str:  # [SHARED]
    return (str(e).splitlines() or [""])[0]


def rng_state() -> dict:  # [SHARED] torch's CPU generator, and this process's CUDA one when it is in use
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_initialized() else {}
    return {"torch": torch.get_rng_state(), **cuda}


def set_rng_state(state: dict, device: torch.device) -> None:  # [SHARED]
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, device: torch.device) -> None:  # [SHARED]
    # Adam's moments, steps and lr under this run's settings (fused, capturable; torch then puts the step on the
    # parameter's device); the moments take the parameter's memory layout (a fused kernel pairs raw memory)
    groups = [{**g, "params": saved["params"], "lr": torch.tensor(float(saved["lr"]), device=device)}
              for g, saved in zip(optimizer.state_dict()["param_groups"], state["param_groups"], strict=True)]
    optimizer.load_state_dict({"state": state["state"], "param_groups": groups})
    for p, st in optimizer.state.items():
        st.update({k: torch.empty_like(p).copy_(v) for k, v in st.items() if k != "step"})


def save_state(run_dir: str, args: Args, agent: Agent, optimizer, norm: Normalizer, kl_penalty, iteration: int,
               global_step: int, rollout: tuple, rank: int, world: int) -> str:  # every rank's RNG and episodes
    envs, next_obs, next_done, episodes = rollout
    mine = dict(envs=env_state(envs), next_obs=next_obs.cpu(), next_done=torch.tensor(next_done),
                ep_return=torch.tensor(episodes["return"]), ep_length=torch.tensor(episodes["length"]),
                reward_ret=torch.tensor(norm.reward_scaler.ret))
    ranks, path = gather_objects((rng_state(), mine), world), os.path.abspath(os.path.join(run_dir, "checkpoint.pt"))
    if rank == 0:
        save_checkpoint(path, {
            "script": SCRIPT, "env_id": args.env_id, "args": {**dataclasses.asdict(args), "stop_after": 0},
            "model": agent.state_dict(), "optimizer": optimizer.state_dict(), "iteration": iteration,
            "global_step": global_step, "kl_coef": kl_penalty.beta if kl_penalty else None, "world_size": world,
            "rng": [r for r, _ in ranks], "episodes": [e for _, e in ranks],
            "obs_rms": norm.obs_rms.state_dict(), "return_rms": norm.reward_scaler.rms.state_dict()})
    return path


def check_resume(ckpt: dict, args: Args, world: int) -> None:  # env, processes, rollout, normalisation switches
    need(ckpt["env_id"] == args.env_id, f"{args.resume} was trained on {ckpt['env_id']}, not {args.env_id}")
    need(ckpt["world_size"] == world, f"{args.resume} was written by {ckpt['world_size']} process(es); resume it with "
         f"as many: {launcher(ckpt['world_size'])} --resume {args.resume}")  # iterations, seeds, envs are per process
    for name in ("num_envs", "num_steps", "norm_obs", "norm_reward"):  # the iteration count, lr schedule, inputs
        need(ckpt["args"][name] == getattr(args, name), f"{args.resume} was written with "
             f"--{name.replace('_', '-')} {ckpt['args'][name]}, which cannot change on --resume")


def need(ok: bool, message: str) -> None:  # bad input: one line, exit 2
    if not ok:
        raise Failure(message)


def load_policy(path: str, deterministic: bool = False, device: str = "cpu"):
    """`policy = load_policy("runs/<run>/checkpoint.pt")`: `policy(obs)` is the clipped action for one raw observation
    of the checkpoint's env or a batch of them, normalised with the saved statistics (Failure: not a checkpoint)."""
    import gymnasium as gym

    ckpt = load_checkpoint(path)
    with contextlib.closing(gym.make(ckpt["env_id"])) as probe:
        obs_dim, low, high = probe.observation_space.shape[0], probe.action_space.low, probe.action_space.high
    agent = Agent(obs_dim, low.shape[0]).to(device)
    agent.load_state_dict(ckpt["model"])
    obs_rms = RunningMeanStd((obs_dim,))
    obs_rms.load_state_dict(ckpt["obs_rms"])
    rms, clip = obs_rms if ckpt["args"]["norm_obs"] else None, ckpt["args"]["obs_clip"]

    @torch.inference_mode()
    def policy(obs):
        obs = np.asarray(obs)
        if obs.shape[-1:] != (obs_dim,) or obs.ndim > 2:
            raise ValueError(f"an observation of shape {obs.shape}: expected ({obs_dim},) or a batch of them")
        actions = agent.act(obs_tensor(obs.reshape(-1, obs_dim), device, rms, clip), deterministic).cpu().numpy()
        actions = np.clip(actions, low, high)
        return actions if obs.ndim == 2 else actions[0]

    return policy


# --- compile and CUDA-graph helpers -----------------------------------------------------------------------
def compile_hot_functions(policy, update, agent, args):  # [SHARED] eager, compiled and/or captured (execution_path)
    for p in agent.parameters():  # allocated here, outside any graph's pool: the update zeroes them in place
        p.grad = torch.zeros_like(p)
    compiled, graphs, lines = execution_path(args, int(os.environ.get("WORLD_SIZE", "1")))
    if lines and int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(lines), flush=True)
    if compiled:
        torch._inductor.config.fallback_random = args.torch_deterministic  # compiled code draws eager's random numbers
        policy, update = compile_or_fail(policy), compile_or_fail(update)
    if graphs:
        policy, update = cuda_graphed(policy, "the action sampling"), cuda_graphed(update, "the update")
    return policy, update


def execution_path(args, world: int) -> tuple[bool, bool, list[str]]:  # [SHARED] compiled?, captured?, lines to say
    compiled, graphs = (args.cuda if on is None else on for on in (args.compile, args.cudagraphs))  # unset: as --cuda
    lines = []
    if graphs and world > 1:
        graphs = False
        lines.append("note: no CUDA graphs under torchrun (DDP's all-reduce cannot be captured)")
    if compiled or graphs:
        how = " and ".join(["compiled"] * compiled + ["each captured in one CUDA graph"] * graphs)
        off = " ".join(["--no-compile"] * compiled + ["--no-cudagraphs"] * graphs)
        lines.append(f"path: the action sampling and the update {how} ({off}: eager); the first iterations "
                     f"{'compile' if compiled else 'capture'} them")
    return compiled, graphs, lines


def compile_or_fail(fn):  # [SHARED] torch.compile's default mode; a failure to compile is one line (exit 1)
    def failure(e: Exception) -> Failure:
        return Failure(f"torch.compile failed: {type(e).__name__}: {first_line(e)} (--no-compile runs without it)", 1)
    try:
        compiled = torch.compile(fn)
    except Exception as e:
        raise failure(e) from None

    def run(*args):
        try:
            return compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:  # (raised at the calls that compile)
            raise failure(e) from None
    return run


def cuda_graphed(fn, name: str, warmup: int = 2):  # [SHARED]
    """fn run as it is for its first `warmup` calls (on a side stream: they compile, and the update's first creates
    the optimizer's state), then captured whole in one CUDA graph at the next call and replayed from then on. fn
    always gets the input tensors of its first call (so torch.compile sees the same kind of tensor at every call):
    each call copies its tensor arguments into them, and a replay returns the captured outputs, which the next call
    overwrites."""
    stream, state = torch.cuda.Stream(), {"calls": 0}

    def signature(x):  # a tensor's shape and dtype (a replay reads those), anything else's value
        return (x.shape, x.dtype) if isinstance(x, torch.Tensor) else x

    def run(*args):
        flat, spec = torch.utils._pytree.tree_flatten(args)
        if "inputs" not in state:
            state["inputs"], state["spec"] = [x.clone() if isinstance(x, torch.Tensor) else x for x in flat], spec
            state["args"] = torch.utils._pytree.tree_unflatten(state["inputs"], spec)
            state["signature"] = [signature(x) for x in flat]
        if spec != state["spec"] or [signature(x) for x in flat] != state["signature"]:
            raise ValueError(f"{name}: called with other arguments than at its first call (its graph replays those)")
        for static, x in zip(state["inputs"], flat):
            if isinstance(static, torch.Tensor):
                static.copy_(x)
        if state["calls"] < warmup:
            state["calls"] += 1
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = fn(*state["args"])
            torch.cuda.current_stream().wait_stream(stream)
            return out
        if "graph" not in state:
            state["graph"] = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(state["graph"]):  # records fn's kernels without running them
                    state["outputs"] = fn(*state["args"])
            except Failure:
                raise
            except Exception as e:
                raise Failure(f"capturing {name} in a CUDA graph failed: {type(e).__name__}: {first_line(e)} "
                              "(--no-cudagraphs runs without CUDA graphs)", 1) from None
        state["graph"].replay()
        return state["outputs"]
    return run


# --- command line -----------------------------------------------------------------------------------------
def parse_count(text: str) -> int:  # [SHARED] 500000, 5e5, 1e7 or 1_000_000; a number that is not whole is an error
    if not float(text).is_integer():  # (ValueError: tyro says the flag wants an INT)
        raise ValueError(f"{text!r} is not a whole number")
    return int(float(text))


Count = Annotated[int, tyro.constructors.PrimitiveConstructorSpec(  # [SHARED]
    nargs=1, metavar="INT", instance_from_str=lambda a: parse_count(a[0]),
    is_instance=lambda x: isinstance(x, int) and not isinstance(x, bool), str_from_instance=lambda x: [str(x)])]


def parse_args(argv: Optional[list[str]] = None) -> Args:  # [SHARED] with --resume, its arguments are the defaults
    argv = sys.argv[1:] if argv is None else argv
    resume = next((a.split("=", 1)[1] if "=" in a else argv[i + 1] for i, a in enumerate(argv)
                   if (a == "--resume" and i + 1 < len(argv)) or a.startswith("--resume=")), None)
    saved = load_checkpoint(resume) if resume else None
    with checkpoint_fits(resume) if resume else contextlib.nullcontext():  # its arguments missing or edited
        default = Args(**{k: v for k, v in saved["args"].items() if k in Args.__dataclass_fields__}) if resume else None
        args = tyro.cli(Args, args=argv, default=default)
        validate(args)  # bad values: one line, exit 2, before anything is written
    return args


def validate(args: Args) -> None:  # bad values: one line, exit 2, before anything is written
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs", "torch_threads",
                 "learning_rate", "clip_coef", "max_grad_norm", "obs_clip", "reward_clip", "target_kl",
                 "kl_penalty_target"):  # (nan fails these too)
        need(getattr(args, name) is None or getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive")
    for name in ("eval_episodes", "checkpoint_every", "stop_after", "ent_coef", "vf_coef", "kl_penalty_coef"):
        need(getattr(args, name) is None or getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be >= 0")
    need(all(math.isfinite(v) for v in vars(args).values() if isinstance(v, float)), "a value is not a finite number")
    need(0 <= args.gamma <= 1 and 0 <= args.gae_lambda <= 1, "--gamma and --gae-lambda must lie in [0, 1]")
    need(0 <= args.seed < 2**31, f"--seed must lie in [0, 2**31), got {args.seed}")
    batch, world = args.num_envs * args.num_steps, int(os.environ.get("WORLD_SIZE", "1"))
    need(args.total_timesteps >= batch * world, f"--total-timesteps {args.total_timesteps} is less than one rollout "
         f"({batch} steps of num_envs x num_steps, times {world} process(es))")
    need(batch % args.num_minibatches == 0, f"num_envs*num_steps = {batch} is not divisible by --num-minibatches")
    need(not args.norm_adv or args.norm_adv_scope == "rollout" or batch // args.num_minibatches >= 2,
         "--norm-adv needs minibatches of at least 2 samples (their std)")
    need(not args.cuda or torch.cuda.is_available(), "--cuda given (or the checkpoint's: --no-cuda resumes on the "
         "CPU) but torch finds no CUDA device")
    need(not args.cuda or torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
         "--cuda needs a GPU for each process on this machine")
    need(not args.cudagraphs or args.cuda, "--cudagraphs needs --cuda (CUDA graphs exist only on a GPU)")
    if args.capture_video and not os.environ.get("DISPLAY"):  # (read when mujoco is imported: before check_env)
        os.environ.setdefault("MUJOCO_GL", "egl")
    check_env(args.env_id)


def check_env(env_id: str) -> None:  # an env id that makes an env with flat Box action and observation spaces
    import gymnasium as gym

    try:
        with contextlib.closing(gym.make(env_id)) as probe:
            spaces = {"action": probe.action_space, "observation": probe.observation_space}
    except Exception as e:  # an unknown id, a missing optional dependency of the env, ...
        raise Failure(f"unknown or unusable env id {env_id!r}: {type(e).__name__}: {first_line(e)}") from None
    for what, space in spaces.items():  # (N, dim) batches, actions clipped to the bounds
        discrete = " (ppo.py takes discrete actions)" if isinstance(space, gym.spaces.Discrete) else ""
        need(isinstance(space, gym.spaces.Box) and len(space.shape) == 1,
             f"{env_id} has a {space} {what} space; {SCRIPT} needs a flat Box{discrete}")


# --- the one error boundary -------------------------------------------------------------------------------
if __name__ == "__main__":  # the one error boundary
    try:
        main(parse_args())
    except Failure as e:  # every rank finds bad input and rank 0 says it; a failed write is said where it happened
        if e.code == 1 or int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        else:  # torchrun ends the job when a rank exits: give rank 0 the time to say it
            time.sleep(5)
        sys.exit(e.code)
    except KeyboardInterrupt:  # Ctrl-C before the loop (in it, the run stops at the end of the iteration)
        sys.exit(130)
