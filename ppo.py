"""PPO for discrete-action gymnasium environments (CartPole-v1 by default), in one file.

    python ppo.py                                  # CartPole-v1, 500k steps, CleanRL's settings
    python ppo.py --env-id Acrobot-v1 --total-timesteps 1e6 --compile
    python ppo.py --resume runs/<run>/checkpoint.pt --eval-episodes 10
    torchrun --nproc-per-node 2 ppo.py             # data parallel: each process steps its own --num-envs envs

Read from the top: Args -> environments -> Agent -> the PPO math (compute_gae, advantage normalisation, ppo_loss,
the adaptive-KL-penalty variant) -> main(), whose loop is the PPO note's steps (docs/reading_guide.md):
1. Collect rollout, 2. Compute advantages and returns (GAE), 3. Advantage normalisation,
4. Optimise policy & value for E epochs, 5. Update reference policy.
PPO ends at the banner below main(). What follows it (run context: torchrun, logging, signals; checkpoints and
exact resume; evaluation and load_policy; compile helpers; the command line) changes nothing that PPO computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import io
import math
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
import typing
import warnings
import zipfile
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import numpy as np
import torch
import torch.nn as nn
import tyro


@dataclass
class Args:  # Count: an int that also reads 1e7 (defined with the command line, below the banner)
    # The note's hyperparameters
    num_steps: Count = 128
    """T: steps per environment in each rollout"""
    update_epochs: Count = 4
    """E: epochs over each rollout"""
    num_minibatches: Count = 4
    """number of minibatches per epoch (each of M = num_envs * T / num_minibatches samples)"""
    clip_coef: float = 0.2
    """epsilon: clip range of the probability ratio (and of the value clip)"""
    learning_rate: float = 2.5e-4
    """alpha: Adam learning rate"""
    gamma: float = 0.99
    """gamma: discount factor"""
    gae_lambda: float = 0.95
    """lambda: GAE parameter"""
    vf_coef: float = 0.5
    """c_v: value loss coefficient"""
    ent_coef: float = 0.01
    """c_H: entropy bonus coefficient"""

    # Implementation details (CleanRL's) and the note's adaptive-KL-penalty variant
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0"""
    norm_adv: bool = True
    """standardise the advantages (where: --norm-adv-scope)"""
    norm_adv_scope: Literal["minibatch", "rollout"] = "minibatch"
    """minibatch: in each minibatch, (A-mean)/(std+eps) (CleanRL); rollout: once, (A-mean)/sqrt(var+eps) (the note)"""
    clip_vloss: bool = True
    """clip the value loss as in the original PPO code"""
    max_grad_norm: float = 0.5
    """global gradient norm clip"""
    target_kl: Optional[float] = None
    """stop the epochs of an update early once approx_kl exceeds this"""
    kl_penalty_coef: Optional[float] = None
    """KL-penalty variant (PPO paper): -r*A + coef*KL(pi_old||pi), no ratio clip; None: clip (1 with a target)"""
    kl_penalty_target: Optional[float] = None
    """adaptive KL penalty: the coef (--kl-penalty-coef, else 1) halves when KL < target/1.5, doubles if > 1.5*target"""

    # Environment
    env_id: str = "CartPole-v1"
    """id of a gymnasium environment with a discrete action space"""
    total_timesteps: Count = 500_000
    """total environment steps of the run"""
    num_envs: Count = 4
    """number of parallel environments"""
    vector_mode: Literal["sync", "async"] = "sync"
    """gymnasium SyncVectorEnv (one process) or AsyncVectorEnv (one process per env)"""

    # Run: seeds, devices, logging, checkpoints, evaluation
    exp_name: str = "ppo"
    """name of this experiment (part of the run name)"""
    seed: Count = 1
    """seed of the experiment (python, numpy, torch and the environments)"""
    torch_deterministic: bool = True
    """deterministic torch algorithms (torch.use_deterministic_algorithms, warn-only; cuDNN; cuBLAS workspace)"""
    cuda: bool = False
    """run the networks on CUDA (these small MLPs train faster on the CPU)"""
    compile: bool = False
    """torch.compile the action sampling and the update step"""
    cudagraphs: bool = False
    """capture the action sampling and the update step in CUDA graphs (needs --cuda)"""
    torch_threads: Count = 1
    """torch CPU threads (1 is fastest for small networks)"""
    track: bool = False
    """log to Weights & Biases (WANDB_MODE=offline works without network)"""
    wandb_project_name: str = "ppo-reference"
    """wandb project name"""
    wandb_entity: Optional[str] = None
    """wandb entity (team)"""
    capture_video: bool = False
    """record videos of the evaluation episodes under runs/<run>/videos"""
    save_model: bool = False
    """write runs/<run>/checkpoint.pt at the end of training"""
    checkpoint_every: Count = 0
    """also write the checkpoint every N iterations (0: only at the end with --save-model)"""
    resume: Optional[str] = None
    """continue from this checkpoint.pt (its run directory, step count, lr schedule); flags not given take its values"""
    stop_after: Count = 0
    """stop this process after N iterations with a checkpoint (0: run to the end); --resume continues"""
    eval_episodes: Count = 0
    """after training (or right away for a finished --resume checkpoint) evaluate N episodes"""
    eval_deterministic: bool = False
    """evaluate with the most likely action (argmax of the logits) instead of a sampled one"""
    runs_dir: str = "runs"
    """directory that holds the runs"""


# ---------------------------------------------------------------------------------------------------------
# Environments
# ---------------------------------------------------------------------------------------------------------
def make_env(env_id: str, idx: int = 0, capture_video: bool = False, video_dir: str = ""):
    def thunk():
        import gymnasium as gym

        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, video_dir, episode_trigger=lambda ep: True, disable_logger=True)
        else:
            env = gym.make(env_id)
        return env

    return thunk


def make_vector_env(args: Args):
    """Vector env in SAME_STEP autoreset mode: a finished episode is reset inside the same step() call and its last
    observation comes back in info["final_obs"], so every stored transition is a real one (no reset transitions)."""
    import gymnasium as gym

    fns = [make_env(args.env_id, i) for i in range(args.num_envs)]
    cls = gym.vector.SyncVectorEnv if args.vector_mode == "sync" else gym.vector.AsyncVectorEnv
    if args.vector_mode == "async":
        fns = [leave_signals_to_main(fn) for fn in fns]
    return cls(fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def obs_tensor(obs, device: torch.device) -> torch.Tensor:
    """A batch of observations as the Agent takes them: float32, each one flattened (image observations too)."""
    x = torch.as_tensor(np.asarray(obs), dtype=torch.float32, device=device)
    return x.reshape(x.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------
# Agent: separate actor and critic MLPs (64x64 tanh), orthogonal init
# ---------------------------------------------------------------------------------------------------------
def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)  # detail: orthogonal init with scaled gains
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, n_actions), std=0.01),  # detail: small last-layer gain -> near-uniform start
        )

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def get_action_and_value(self, x: torch.Tensor, action: Optional[torch.Tensor] = None):
        """Sample (or score) an action. Returns action, log pi(a|s), entropy, V(s)."""
        return self(x, action)[:4]

    def forward(self, x: torch.Tensor, action: Optional[torch.Tensor] = None):
        """get_action_and_value, plus log pi(.|s) of every action (the KL-penalty variant's exact KL compares the old
        and the new ones). The update calls the agent itself, so that DDP can average the gradients."""
        logits = self.actor(x)
        logp_all = torch.log_softmax(logits, dim=-1)
        if action is None:  # Gumbel-max sampling: one draw from Categorical(logits), cheap and compilable
            u = torch.rand_like(logits).clamp_(min=1e-20)
            action = torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)
        logprob = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return action, logprob, entropy, self.get_value(x), logp_all

    def act(self, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """The action to play (evaluation, load_policy): sampled, or the most likely one."""
        return self.actor(x).argmax(-1) if deterministic else self.get_action_and_value(x)[0]


# ---------------------------------------------------------------------------------------------------------
# The PPO math: pure functions (the tests check each against a plain loop)
# ---------------------------------------------------------------------------------------------------------
def compute_gae(rewards, values, dones, next_value, next_done, gamma: float, lam: float):
    """Generalized advantage estimation by the backward recursion of the note.

    rewards, values, dones: (T, N); dones[t] = 1 if obs[t] is the first of a new episode (the transition at t-1
    ended one). next_value, next_done: (N,) for the observation after the last step. Truncated episodes must
    already carry gamma * V(final_obs) in their last reward (see main), so a done here always means "no bootstrap".
    Returns advantages and returns R_t = A_t + V(s_t), both (T, N).
    """
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        if t == T - 1:
            nextnonterminal, nextvalues = 1.0 - next_done, next_value
        else:
            nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]  # TD error
        lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def normalize_advantages(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / (std + eps), with the unbiased std as in CleanRL and the OpenAI baselines."""
    return (adv - adv.mean()) / (adv.std() + eps)


def normalize_advantages_rollout(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The note's advantage normalisation over the whole rollout: (A - mean) / sqrt(population variance + eps)."""
    return (adv - adv.mean()) / torch.sqrt(adv.var(unbiased=False) + eps)


def ppo_loss(newlogprob, oldlogprob, advantages, newvalue, oldvalue, returns, entropy,
             clip_coef: float, clip_vloss: bool, ent_coef: float, vf_coef: float, norm_adv: bool, kl_coef=None,
             kl=None):
    """Clipped policy loss + c_v * value loss - c_H * entropy, with statistics (all tensors, no host sync).
    kl_coef (a number or 0-d tensor) selects the KL-penalty policy loss instead: -r*A + kl_coef * kl, with kl the
    exact KL(pi_old(.|s) || pi(.|s)) of each sample's state (categorical_kl), as in the PPO paper."""
    if kl_coef is not None and kl is None:
        raise ValueError("ppo_loss: kl_coef needs kl, the KL(pi_old(.|s) || pi(.|s)) of each sample")
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


def categorical_kl(old_logp: torch.Tensor, new_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_old(.|s) || pi(.|s)) of each state, exact: the sum over actions of p_old * (log p_old - log p).
    (..., A) -> (...)."""
    return (old_logp.exp() * (old_logp - new_logp)).sum(-1)


def adapt_kl_coef(coef: float, kl: float, target: float) -> float:
    """The PPO paper's rule for the KL-penalty variant: halve the coefficient when the update moved the policy by
    less than target/1.5, double it above 1.5*target; kept within [1e-6, 1e6] so that it can always come back."""
    if kl < target / 1.5:
        coef /= 2
    elif kl > target * 1.5:
        coef *= 2
    return min(max(coef, 1e-6), 1e6)


class KLPenalty:
    """The note's adaptive-KL-penalty variant in one place (PPO paper, sec. 4): each minibatch's policy loss is
    -r*A + beta * KL(pi_old(.|s) || pi(.|s)) instead of the clipped one (loss_terms); after each update the rollout's
    KL (rollout_kl) halves or doubles beta with --kl-penalty-target (adapt)."""

    def __init__(self, args: Args, device: torch.device):
        self.target = args.kl_penalty_target
        self.beta = 1.0 if args.kl_penalty_coef is None else args.kl_penalty_coef  # on the host, for the rule
        self.coef = torch.tensor(self.beta, device=device)  # in a tensor, which the (compiled) update reads

    def loss_terms(self, old_logp_all: torch.Tensor, logp_all: torch.Tensor) -> dict:
        """ppo_loss's keyword arguments kl_coef and kl for one minibatch."""
        return dict(kl_coef=self.coef, kl=categorical_kl(old_logp_all, logp_all))

    @torch.no_grad()
    def rollout_kl(self, actor: nn.Module, b_obs, b_old_logp_all, minibatch_size: int) -> torch.Tensor:
        """KL(pi_old || pi_theta) averaged over the rollout's states after the update: the d of the adaptive rule."""
        total = torch.zeros((), device=b_obs.device)
        for start in range(0, len(b_obs), minibatch_size):
            mb = slice(start, start + minibatch_size)
            total += categorical_kl(b_old_logp_all[mb], torch.log_softmax(actor(b_obs[mb]), -1)).sum()
        return total / len(b_obs)

    def adapt(self, kl: float) -> None:
        if self.target is not None:
            self.set(adapt_kl_coef(self.beta, kl, self.target))

    def set(self, beta: float) -> None:
        """The coefficient of the next update (adapt; a resumed run's adapted value)."""
        self.beta = beta
        self.coef.fill_(beta)


# ---------------------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    with Run(args) as run:  # process group, seeds, run directory, logging, signals, checkpoints (all below the banner)
        device, world = run.device, run.world
        batch_size = args.num_envs * args.num_steps  # per process; under torchrun the global batch is world times it
        minibatch_size = batch_size // args.num_minibatches
        num_iterations = args.total_timesteps // (batch_size * world)

        envs = make_vector_env(args)
        obs_dim, n_actions = int(np.prod(envs.single_observation_space.shape)), int(envs.single_action_space.n)
        agent = Agent(obs_dim, n_actions).to(device)
        # lr in a tensor, so that annealing it recompiles nothing; fused: one kernel per step, CUDA-graph safe
        optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(args.learning_rate, device=device), eps=1e-5,
                                     fused=True)
        penalised = args.kl_penalty_coef is not None or args.kl_penalty_target is not None
        kl_penalty = KLPenalty(args, device) if penalised else None
        # a fresh start (envs reset), or the state a checkpoint stopped in: networks, optimizer, RNG, episodes
        first_iteration, global_step, next_obs, next_done = run.start(envs, agent, optimizer, kl_penalty,
                                                                      num_iterations)
        train_agent = run.data_parallel(agent)  # the update calls it: under torchrun DDP averages the gradients
        norm_per_minibatch = args.norm_adv and args.norm_adv_scope == "minibatch"

        def policy(obs):  # the rollout's action sampling
            action, logprob, _, value, logp_all = agent(obs)
            return action, logprob, value, logp_all

        def update(mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values, mb_old_logp_all):
            """One gradient step on one minibatch."""
            optimizer.zero_grad(set_to_none=False)
            _, newlogprob, entropy, newvalue, logp_all = train_agent(mb_obs, mb_actions)
            penalty = kl_penalty.loss_terms(mb_old_logp_all, logp_all) if kl_penalty else {}
            loss, stats = ppo_loss(newlogprob, mb_logprobs, mb_advantages, newvalue, mb_values, mb_returns, entropy,
                                   args.clip_coef, args.clip_vloss, args.ent_coef, args.vf_coef, norm_per_minibatch,
                                   **penalty)
            loss.backward()
            stats["grad_norm"] = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
            return stats

        policy, update = compile_hot_functions(policy, update, agent, args)  # --compile, --cudagraphs

        # Rollout storage (T, N, ...); old_logp_all: log pi_old(.|s) of every action (the KL-penalty variant's KL)
        obs = torch.zeros((args.num_steps, args.num_envs, obs_dim), device=device)
        actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long, device=device)
        logprobs, rewards, dones, values = (torch.zeros((args.num_steps, args.num_envs), device=device)
                                            for _ in range(4))
        old_logp_all = torch.zeros((args.num_steps, args.num_envs, n_actions), device=device)

        for iteration in range(first_iteration, num_iterations + 1):
            lr_now = args.learning_rate
            if args.anneal_lr:  # detail: linear annealing to 0 over the whole run
                lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
            optimizer.param_groups[0]["lr"].fill_(lr_now)

            # 1. Collect rollout
            for step in range(args.num_steps):
                global_step += args.num_envs * world  # environment steps of all processes
                obs[step], dones[step] = next_obs, next_done
                with torch.inference_mode():
                    action, logprob, value, logp_all = policy(next_obs)
                actions[step], logprobs[step], values[step], old_logp_all[step] = action, logprob, value, logp_all

                next_obs_np, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                reward = np.asarray(reward, dtype=np.float32)
                done = np.logical_or(terminations, truncations)
                run.count_episodes(reward, done, global_step)  # episodic return and length (charts/)
                # Truncation is not termination: bootstrap r + gamma * V(final obs) for episodes cut by a time limit.
                trunc_only = np.logical_and(truncations, np.logical_not(terminations))
                if trunc_only.any():
                    idx = np.nonzero(trunc_only)[0]
                    with torch.inference_mode():
                        final_value = agent.get_value(obs_tensor(np.stack(infos["final_obs"][idx]), device))
                    reward[idx] += args.gamma * final_value.cpu().numpy()
                rewards[step] = torch.as_tensor(reward, device=device)
                next_obs = obs_tensor(next_obs_np, device)
                next_done = torch.as_tensor(done, dtype=torch.float32, device=device)

            # 2. Compute advantages and returns (GAE)
            with torch.no_grad():
                advantages, returns = compute_gae(rewards, values, dones, agent.get_value(next_obs), next_done,
                                                  args.gamma, args.gae_lambda)
            b_obs, b_actions, b_logprobs = obs.reshape(batch_size, obs_dim), actions.reshape(-1), logprobs.reshape(-1)
            b_advantages, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)
            b_old_logp_all = old_logp_all.reshape(batch_size, n_actions)

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
                    stats = update(b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb], b_returns[mb],
                                   b_values[mb], b_old_logp_all[mb])
                    update_stats.append({k: v.clone() for k, v in stats.items()})  # a CUDA graph reuses its outputs
                if args.target_kl is not None and run.mean_over_ranks(stats["approx_kl"]) > args.target_kl:
                    break  # detail: early stop of the epochs

            # 5. Update reference policy: theta_old <- theta, implicitly (the next rollout samples from theta). The
            # KL-penalty variant measures KL(pi_old || pi_theta) over the rollout and adapts its coefficient to it.
            rollout_kl = kl_penalty.rollout_kl(agent.actor, b_obs, b_old_logp_all, minibatch_size) if kl_penalty else None
            stats = run.log_iteration(iteration, global_step, lr_now, update_stats, rollout_kl, b_values, b_returns)
            if stats is None:  # a non-finite update: the run stops with the last good checkpoint
                break
            if kl_penalty:
                kl_penalty.adapt(stats["kl"])  # the coefficient of the next update
            if run.end_of_iteration(iteration, global_step, next_obs, next_done):  # checkpoints; --stop-after, signals
                break
        run.finish(global_step, next_obs, next_done)  # the final checkpoint, then --eval-episodes
    return run.result


# =========================================================================================================
# Plumbing: nothing below this line changes what PPO computes. Run context (torchrun, seeds, run directory,
# logging, signals), checkpoints and exact resume, evaluation and load_policy, compile helpers, command line.
# =========================================================================================================
SCRIPT = "ppo.py"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class WriteError(Exception):
    """A file of the run could not be written (disk full, quota, read-only file system): one line, exit 1."""


class Run:
    """What one run owns around the algorithm, from the first line of main() to the last: SIGTERM / SIGINT (honoured
    at the end of an iteration, after the final checkpoint and during the evaluation), the torchrun process group,
    seeds, the run directory and its lock, TensorBoard / wandb and the progress line, checkpoints and exact resume,
    and the one-line errors of a write that failed."""

    def __init__(self, args: Args):
        self.args = args
        self.signals: list[int] = []
        self.stop_requested = False  # a signal reached this or another process (all-reduced each iteration)
        self.finished, self.failed = True, False  # failed: a non-finite update (exit 1)
        self.rank, self.world, self.device = 0, 1, torch.device("cpu")  # until setup() knows them
        self.ckpt, self.writer, self.wandb, self.envs, self.lock_fd = None, None, False, None, None
        self.checkpoint_path, self.final_saved = None, False  # final_saved: the trained state is in a checkpoint
        self.write_error: Optional[str] = None  # a failed write of rank 0, which every rank stops on together
        self.recent_returns: list[float] = []
        self.last_stats: dict = {}
        self.result: dict = {}

    # --- setup and teardown ---------------------------------------------------------------------------------
    def __enter__(self) -> Run:
        self.previous = {sig: signal.signal(sig, lambda signum, frame: self.signals.append(signum))
                         for sig in STOP_SIGNALS}
        self.previous_hook = threading.excepthook
        threading.excepthook = quiet_event_writer_thread(self.previous_hook)
        self.previous_deterministic = (torch.are_deterministic_algorithms_enabled(),
                                       torch.is_deterministic_algorithms_warn_only_enabled())
        try:
            self.setup()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def setup(self) -> None:
        args = self.args
        if args.cuda and args.torch_deterministic:  # cuBLAS is deterministic with a fixed workspace (before its start)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.rank, self.world, self.device = setup_distributed(args)
        if args.resume:
            self.ckpt_key = checkpoint_key(args.resume)
            self.ckpt = load_checkpoint(args.resume, args.env_id)
            check_resume(self.ckpt, args, self.world)
        check_env(args)
        self.run_dir = self.make_run_dir()
        self.run_name = os.path.basename(self.run_dir)
        if self.ckpt is not None:
            self.checkpoint_path = os.path.abspath(args.resume)
        # Seeding
        random.seed(args.seed + self.rank)
        np.random.seed(args.seed + self.rank)
        torch.manual_seed(args.seed + self.rank)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
        torch.set_num_threads(args.torch_threads)

    def make_run_dir(self) -> str:
        """A new run gets a directory of its own (`<env>__<exp>__<seed>__<time>`, then -2, -3, ... if taken); a resumed
        run uses its checkpoint's. Rank 0 locks it: a directory that another live process holds is refused."""
        args, error, run_dir = self.args, None, None
        if self.rank == 0 and self.ckpt is not None:
            run_dir = os.path.dirname(os.path.abspath(args.resume))
        elif self.rank == 0:
            base = os.path.join(args.runs_dir, f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
            run_dir, n = base, 1
            try:
                while not make_new_dir(run_dir):
                    n += 1
                    run_dir = f"{base}-{n}"
            except OSError as e:
                error = f"cannot create run directory {run_dir}: {e.strerror or e}"
        if self.rank == 0 and error is None:
            try:
                self.lock_fd = lock_run_dir(run_dir)
                if self.ckpt is not None and checkpoint_key(args.resume) != self.ckpt_key:
                    error = (f"{args.resume} was rewritten by another process while this one started (a job still "
                             "running?); start again to resume the new checkpoint")
            except OSError as e:
                error = f"cannot write in run directory {run_dir}: {e.strerror or e}"
            except RunDirBusy as e:
                error = str(e)
        run_dir, error = gather_objects((run_dir, error), self.world)[0]
        if error:
            die(error)
        return run_dir

    def __exit__(self, exc_type, exc, tb) -> bool:
        clean = exc_type is None
        try:
            if self.envs is not None:
                close_envs(self.envs, clean)
            worker_died = isinstance(exc, (EOFError, ConnectionError)) and self.args.vector_mode == "async"
            if worker_died:  # (killed: by the OOM killer?)
                self.write_error = f"an environment worker process died ({exc_type.__name__})"
            if self.writer is not None:
                self.writer_call("close")
            if exc_type is WriteError:
                self.write_error = str(exc)
            if self.world > 1 and torch.distributed.is_initialized():
                import torch.distributed as dist

                if clean:  # no rank leaves while another still works; a failed write of rank 0 stops them all
                    self.write_error = first_error(self.write_error, self.world)[1]
                dist.destroy_process_group()
            if self.write_error:  # (a failed write, said by rank 0 for all; or this rank's dead env worker)
                if self.rank == 0 or worker_died:
                    print(f"error: {self.write_error} ({self.kept()})", file=sys.stderr)
                self.failed = True
            if self.wandb:
                import wandb

                wandb.finish(exit_code=int(self.failed or not clean))
        finally:
            if self.lock_fd is not None:
                release_lock(self.lock_fd)
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            threading.excepthook = self.previous_hook
            enabled, warn_only = self.previous_deterministic
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        if self.failed:
            if self.world > 1:  # as at the end of __main__: skip the teardown where gloo's threads can abort
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(1)
            raise SystemExit(1)
        return False

    def kept(self) -> str:
        return f"last checkpoint kept: {self.checkpoint_path}" if self.checkpoint_path else "no checkpoint was written"

    # --- the state a run starts from --------------------------------------------------------------------------
    def start(self, envs, agent: Agent, optimizer, kl_penalty: Optional[KLPenalty], num_iterations: int):
        """Networks, optimizer, RNG and the KL coefficient from the checkpoint (if any), then the environments: reset
        with per-env seeds, or (exact resume) the episodes in flight where they stopped. Also opens the logs.
        Returns (first iteration, global step, next_obs, next_done)."""
        args, ckpt, rank, device = self.args, self.ckpt, self.rank, self.device
        self.envs, self.agent, self.optimizer, self.kl_penalty = envs, agent, optimizer, kl_penalty
        self.num_iterations, first, global_step = num_iterations, 1, 0
        mine = ckpt if rank == 0 or ckpt is None else ckpt["other_ranks"][rank - 1]  # this rank's RNG and envs
        fresh_episodes = False
        next_obs_np, _ = envs.reset(seed=[args.seed + (ckpt["global_step"] if ckpt else 0) + rank * args.num_envs + i
                                          for i in range(args.num_envs)])
        next_obs, next_done = obs_tensor(next_obs_np, device), torch.zeros(args.num_envs, device=device)
        self.ep_return, self.ep_length = np.zeros(args.num_envs), np.zeros(args.num_envs, dtype=np.int64)
        if ckpt is not None:
            error = None
            try:  # whatever torch or the envs raise on a checkpoint that does not fit is one line
                agent.load_state_dict(ckpt["model"])
                load_optimizer_state(optimizer, ckpt["optimizer"], device)
                set_rng_state(mine["rng"], device)
                saved = mine["rollout"]
                if saved["envs"] is not None and args.vector_mode == "sync":
                    # exact resume: the episodes in flight continue where they stopped
                    load_env_state(envs, saved["envs"])
                    next_obs, next_done = (fitted(saved[k], x.shape).to(device) for k, x in
                                           (("next_obs", next_obs), ("next_done", next_done)))
                    self.ep_return, self.ep_length = (fitted(saved[k], x.shape).numpy().astype(x.dtype) for k, x in
                                                      (("ep_return", self.ep_return), ("ep_length", self.ep_length)))
                else:
                    fresh_episodes = True
            except Exception as e:
                error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            # under torchrun each rank restores its own states: a state that only one rank finds unfit stops them all
            r, error = first_error(error, self.world)
            if error:
                die(f"checkpoint {args.resume} does not fit this run{f' (the state of rank {r})' if r else ''}: {error}")
            first, global_step = ckpt["iteration"] + 1, ckpt["global_step"]
            if adapted_kl_coef(args, ckpt) is not None:
                kl_penalty.set(ckpt["kl_coef"])  # the adapted value goes on
        self.open_logs()
        if ckpt is not None and rank == 0:
            print(f"resumed {args.resume} at iteration {first - 1}, global step {global_step}")
            saved_total = ckpt["args"].get("total_timesteps", args.total_timesteps)
            if args.anneal_lr and saved_total != args.total_timesteps:  # not silent: the lr jumps
                print(f"note: --total-timesteps {args.total_timesteps} differs from the checkpoint's {saved_total}: "
                      "the learning rate now anneals to 0 at the new total")
            if adapted_kl_coef(args, ckpt) is not None:
                print(f"note: the adaptive KL-penalty coefficient goes on from the checkpoint's {ckpt['kl_coef']:.3g} "
                      "(--kl-penalty-coef sets the start of a new run only)")
            if fresh_episodes:
                print("note: environments start new episodes (exact resume needs --vector-mode sync, then and now, and "
                      "an env whose whole state the script saves)")
        self.first_iteration, self.steps_at_start = first, global_step
        self.final_saved = ckpt is not None and first > num_iterations  # a finished run's checkpoint: final already
        self.start_time, self.last_print = time.time(), 0.0
        return first, global_step, next_obs, next_done

    def data_parallel(self, agent: Agent) -> nn.Module:
        if self.world == 1:
            return agent
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(agent, device_ids=[self.device.index] if self.args.cuda else None)

    # --- logging ----------------------------------------------------------------------------------------------
    def open_logs(self) -> None:
        """TensorBoard (and wandb with --track) in the run directory; rank 0 alone logs."""
        args = self.args
        if self.rank != 0:
            return
        from torch.utils.tensorboard import SummaryWriter

        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                       config=vars(args), name=self.run_name, dir=self.run_dir, resume="allow", id=self.run_name)
            self.wandb = True
        self.writer = SummaryWriter(self.run_dir)
        if self.ckpt is None:
            self.writer_call("add_text", "hyperparameters", "|param|value|\n|-|-|\n" +
                             "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))

    def writer_call(self, method: str, *a) -> None:
        """A call of the TensorBoard writer; its background thread's failed write (disk full) surfaces here. The run
        stops on it at the end of the iteration (all ranks together), or at its end."""
        try:
            getattr(self.writer, method)(*a)
        except Exception as e:
            reason = os_error(e)
            if reason is None:
                raise
            self.writer = None  # nothing more goes to it
            self.write_error = self.write_error or f"cannot write the TensorBoard events in {self.run_dir}: {reason}"

    def log(self, tag: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer_call("add_scalar", tag, value, step)

    def count_episodes(self, reward: np.ndarray, done: np.ndarray, global_step: int) -> None:
        self.ep_return += reward
        self.ep_length += 1
        for i in np.nonzero(done)[0]:
            self.recent_returns.append(float(self.ep_return[i]))
            self.log("charts/episodic_return", self.ep_return[i], global_step)
            self.log("charts/episodic_length", self.ep_length[i], global_step)
        self.ep_return[done] = 0.0
        self.ep_length[done] = 0

    def mean_over_ranks(self, x: torch.Tensor) -> float:
        return float(all_ranks_sum(x, self.world)) / self.world

    def log_iteration(self, iteration: int, global_step: int, lr: float, update_stats: list[dict],
                      rollout_kl: Optional[torch.Tensor], b_values, b_returns) -> Optional[dict]:
        """One host sync per iteration: the update's statistics averaged over minibatches and processes, and whether a
        process got a stop signal. Logs them and prints the progress line. None after a non-finite update (exit 1)."""
        args, world, kl_penalty = self.args, self.world, self.kl_penalty
        names = list(update_stats[0])
        sums = [torch.stack([s[k] for s in update_stats]).sum() for k in names]
        extra = [] if rollout_kl is None else [rollout_kl]
        flags = torch.tensor([float(len(self.signals)), float(self.write_error is not None)], device=self.device)
        *values, signals, write_failed = all_ranks_sum(torch.cat([torch.stack([*sums, *extra]), flags]), world).tolist()
        if write_failed:  # rank 0 could not write its logs: every rank stops here
            raise WriteError(self.write_error or "rank 0 could not write its logs")
        stats = {k: v / (len(update_stats) * world) for k, v in zip(names, values)}
        if extra:
            stats["kl"] = values[-1] / world
        self.stop_requested = signals > 0
        bad = [k for k, v in stats.items() if not math.isfinite(v)]
        if bad:
            if self.rank == 0:  # (every rank sees the same all-reduced statistics)
                print(f"error: non-finite {', '.join(bad)} at iteration {iteration}; stopping ({self.kept()})",
                      file=sys.stderr)
            self.finished, self.failed = False, True  # no final checkpoint and no evaluation; exit 1 at the end
            return None
        stats["explained_variance"] = explained_variance(b_values.cpu().numpy(), b_returns.cpu().numpy())
        rate = (global_step - self.steps_at_start) / (time.time() - self.start_time)  # steps/s, all processes
        self.log("charts/learning_rate", lr, global_step)
        for k in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac",
                  "explained_variance"):
            self.log(f"losses/{k}", stats[k], global_step)
        self.log("charts/SPS", int(rate), global_step)
        if kl_penalty is not None:
            self.log("losses/kl", stats["kl"], global_step)
            self.log("charts/kl_coef", kl_penalty.beta, global_step)  # the coefficient this update used
        now = time.time()
        if self.rank == 0 and (now - self.last_print >= 5.0 or iteration == self.num_iterations):
            self.last_print = now
            recent = np.mean(self.recent_returns[-20:]) if self.recent_returns else float("nan")
            steps_left = (self.num_iterations - iteration) * args.num_envs * args.num_steps * world
            print(f"iter {iteration}/{self.num_iterations}  global_step={global_step}  SPS={int(rate)}  "
                  f"return(last 20)={recent:.1f}  approx_kl={stats['approx_kl']:.4f}"
                  + (f"  kl={stats['kl']:.4f} kl_coef={kl_penalty.beta:.3g}" if kl_penalty else "")
                  + f"  eta={eta_text(steps_left / rate if rate > 0 else math.inf)}", flush=True)
        if args.cudagraphs and iteration == self.first_iteration and self.rank == 0 and cudagraph_skips():
            print(f"note: {cudagraph_skips()} compiled graph(s) run without CUDA graphs (TORCH_LOGS=cudagraphs says "
                  "why)", flush=True)
        self.last_stats = stats
        return stats

    # --- checkpoints and stops --------------------------------------------------------------------------------
    def checkpoint(self, iteration: int, global_step: int, next_obs, next_done) -> None:
        """Called by every rank at the same iteration; rank 0 writes the states of all ranks."""
        rollout = dict(envs=env_state(self.envs), next_obs=next_obs.cpu(), next_done=next_done.cpu(),
                       ep_return=torch.from_numpy(self.ep_return), ep_length=torch.from_numpy(self.ep_length))
        ranks = gather_objects({"rng": rng_state(), "rollout": rollout}, self.world)
        path, error = os.path.join(self.run_dir, "checkpoint.pt"), None
        if self.rank == 0:
            try:
                save_checkpoint(path, self.agent, self.optimizer, self.args, global_step, iteration, rollout,
                                ranks[1:], self.kl_penalty.beta if self.kl_penalty else None)
            except WriteError as e:
                error = str(e)
        error = first_error(error, self.world)[1]
        if error:  # every rank stops on a failed save of rank 0
            raise WriteError(error)
        self.checkpoint_path = path

    def end_of_iteration(self, iteration: int, global_step: int, next_obs, next_done) -> bool:
        """A checkpoint every --checkpoint-every iterations; True (stop, with a checkpoint) after --stop-after
        iterations of this process or a signal to any process."""
        args = self.args
        stop_now = args.stop_after and iteration - self.first_iteration + 1 >= args.stop_after
        if (stop_now or self.stop_requested) and iteration < self.num_iterations:
            self.checkpoint(iteration, global_step, next_obs, next_done)
            why = (signal.Signals(self.signals[0]).name if self.signals else "a signal to another rank"
                   if self.stop_requested else f"--stop-after {args.stop_after}")
            if self.rank == 0:
                print(f"stopped at iteration {iteration} ({why}); continue with: {launcher(self.world)} --resume "
                      f"{self.checkpoint_path}" + (f" (which stops again after {args.stop_after} iterations, the "
                      "checkpoint's --stop-after; add --stop-after 0 to run to the end)" if args.stop_after else ""),
                      flush=True)
            self.finished = False
            return True
        if args.checkpoint_every and iteration % args.checkpoint_every == 0:
            self.checkpoint(iteration, global_step, next_obs, next_done)
        return False

    def finish(self, global_step: int, next_obs, next_done) -> None:
        """After the loop: the final checkpoint (with --save-model, or when the run writes checkpoints along the way,
        so that a --resume of the finished run evaluates instead of training), then --eval-episodes. A signal at the
        end of the run or during the evaluation stops it, and a failed write of its videos ends it, with the trained
        state saved."""
        args, world, rank = self.args, self.world, self.rank
        self.result = {"global_step": global_step, "run_dir": self.run_dir, "stats": self.last_stats,
                       "returns": self.recent_returns}
        if not self.finished:
            return
        rng = rng_state()  # the state the trained run ends in, whatever the evaluation draws

        def save_final(again: bool = False) -> None:  # again: --save-model rewrites a finished run's checkpoint too
            if again or not self.final_saved:
                set_rng_state(rng, self.device)
                self.checkpoint(max(self.num_iterations, self.first_iteration - 1), global_step, next_obs, next_done)
                self.final_saved = True
                if rank == 0:
                    print(f"checkpoint written to {self.checkpoint_path}")

        if args.save_model or args.checkpoint_every or args.stop_after or self.ckpt is not None:
            save_final(again=args.save_model)
        # under torchrun every rank plays its share of the evaluation episodes; rank 0 logs them all
        share = args.eval_episodes // world + int(rank < args.eval_episodes % world)
        mine, error = [], None
        try:
            if share:
                mine = evaluate(self.agent, args, self.device, share, os.path.join(self.run_dir, "videos"), rank,
                                stop=lambda: bool(self.signals))
        except Exception as e:  # (a full disk under the videos)
            if os_error(e) is None:
                raise
            error = f"cannot write the evaluation videos in {os.path.join(self.run_dir, 'videos')}: {os_error(e)}"
        parts = gather_objects((mine, [signal.Signals(s).name for s in self.signals], error), world)
        names, error = [n for _, sigs, _ in parts for n in sigs], next((e for _, _, e in parts if e), None)
        if names or error:  # the trained state first
            save_final()
            if error:
                raise WriteError(error)
            if rank == 0:
                print(f"stopped at the end of the run ({names[0]}); the trained model is in {self.checkpoint_path}"
                      + (f"; evaluate it with: {launcher(self.world)} --resume {self.checkpoint_path} --eval-episodes "
                         f"{args.eval_episodes}" if args.eval_episodes else ""), flush=True)
            return
        if args.eval_episodes:
            eval_returns = [r for part, _, _ in parts for r in part]
            mean, std = float(np.mean(eval_returns)), float(np.std(eval_returns))
            self.log("eval/episodic_return", mean, global_step)
            if rank == 0:
                print(f"eval: {args.eval_episodes} episodes{' (deterministic)' if args.eval_deterministic else ''}, "
                      f"return {mean:.2f} ± {std:.2f}")
            self.result["eval_returns"] = eval_returns


def quiet_event_writer_thread(previous):
    """threading.excepthook during a run: TensorBoard's writer thread re-raises a failed write (disk full), which the
    main thread's next call of the writer reports in one line (Run.writer_call); other threads go to `previous`."""
    return lambda hook_args: None if type(hook_args.thread).__name__ == "_AsyncWriterThread" else previous(hook_args)


def close_envs(envs, clean: bool) -> None:
    """Close the vector env; after an error, when an async worker may be gone, end the workers without waiting on
    them (waiting on a dead worker's pipe would hang the exit)."""
    if clean:
        envs.close()
        return
    for process in getattr(envs, "processes", []):
        process.kill()  # (the workers ignore SIGTERM: leave_signals_to_main)
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("Calling close while waiting for a pending call to step")
        envs.close(terminate=True)
    envs.closed = True


def leave_signals_to_main(make):
    """An async worker ignores SIGINT and SIGTERM: a Ctrl-C reaches the whole process group, and a worker that died
    of it would break the main process's last step and close instead of its checkpoint and clean exit. (gymnasium
    also calls the first thunk in the main process, for the spaces: that one leaves the handlers alone.)"""
    def thunk():
        if multiprocessing.parent_process() is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return make()

    return thunk


class RunDirBusy(Exception):
    pass


def make_new_dir(path: str) -> bool:
    """Create `path` (and its parents); False if it exists already (another run took the name)."""
    try:
        os.makedirs(path)
        return True
    except FileExistsError:
        if os.path.isdir(path):
            return False
        raise


LOCK_FDS: set = set()  # the run-directory locks this process holds; a forked child (an async env worker) drops them


def drop_locks() -> None:
    for fd in LOCK_FDS:
        os.close(fd)
    LOCK_FDS.clear()


os.register_at_fork(after_in_child=drop_locks)


def lock_run_dir(run_dir: str) -> int:
    """Hold an exclusive lock on run_dir/.lock for the life of this process (the OS releases it, even after kill -9);
    RunDirBusy if another live process holds it."""
    fd = os.open(os.path.join(run_dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RunDirBusy(f"run directory {run_dir} is in use by another process (pid {pid}): wait for it to end or "
                         "stop it first") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    LOCK_FDS.add(fd)
    return fd


def release_lock(fd: int) -> None:
    LOCK_FDS.discard(fd)
    os.close(fd)


def os_error(e: BaseException) -> Optional[str]:
    """The reason of a failed write, from the OSError in the exception's chain (torch wraps it in a RuntimeError)."""
    while e is not None:
        if isinstance(e, OSError):
            return e.strerror or str(e)
        e = e.__cause__ or e.__context__
    return None


def explained_variance(y_pred: np.ndarray, y_true: np.ndarray) -> float:
    var_y = np.var(y_true)
    return float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y)


def eta_text(seconds: float) -> str:
    """Time left for the progress line: 2h05m, 13m20s or 45s ("?" before the speed is known)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# ---------------------------------------------------------------------------------------------------------
# Distributed (torchrun): data parallel, every rank steps its own envs, DDP averages the gradients
# ---------------------------------------------------------------------------------------------------------
def setup_distributed(args: Args) -> tuple[int, int, torch.device]:
    """Rank, world size and device. Without torchrun (or with one process) no process group is created."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device("cuda" if args.cuda else "cpu")
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu")
    if args.cuda:  # one GPU per rank
        if local_rank >= torch.cuda.device_count():  # (validate refuses fewer GPUs than local processes)
            die(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible)", every_rank=True)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    # one hour (NCCL's default is 10 minutes): at the end the ranks wait while rank 0 writes its videos and the
    # checkpoint, and for the longest share of the evaluation episodes
    dist.init_process_group("nccl" if args.cuda else "gloo", timeout=datetime.timedelta(hours=1))
    return dist.get_rank(), world, device


def all_ranks_sum(x: torch.Tensor, world: int) -> torch.Tensor:
    """Sum of x over ranks (a new tensor; x itself with one process)."""
    if world > 1:
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x)
    return x


def first_error(error: Optional[str], world: int) -> tuple[int, Optional[str]]:
    """(rank, error) of the first rank that has an error, else (0, None): every rank learns what stops them all."""
    return next(((r, e) for r, e in enumerate(gather_objects(error, world)) if e), (0, None))


def gather_objects(obj, world: int) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------------------
# Checkpoints and exact resume
# ---------------------------------------------------------------------------------------------------------
EXACT_RESUME_MODULES = ("gymnasium.envs.classic_control",)  # envs whose state is all in plain attributes


def env_state(envs) -> Optional[list]:
    """Snapshot of each sub-environment of a SyncVectorEnv: the plain attributes (numbers, arrays) of the env and
    of every wrapper (physics state, TimeLimit's step counter, ...) and its random generator. Enough to continue
    classic-control episodes exactly. None for AsyncVectorEnv, whose envs live in other processes, and for envs whose
    state lives elsewhere (Box2D's world, the Atari emulator): restoring part of it would continue a different game."""
    if not hasattr(envs, "envs") or not envs.envs[0].unwrapped.__module__.startswith(EXACT_RESUME_MODULES):
        return None
    snapshot = []
    for env in envs.envs:
        layers = []
        while True:
            plain = {}
            for k, v in vars(env).items():
                if isinstance(v, (bool, int, float, str)) or v is None:
                    plain[k] = v
                elif isinstance(v, (np.ndarray, np.generic)) and v.dtype.kind in "biuf":
                    plain[k] = torch.from_numpy(np.array(v, copy=True))
            layers.append(plain)
            if not hasattr(env, "env"):
                break
            env = env.env
        snapshot.append({"layers": layers, "np_random": env.np_random.bit_generator.state})
    return snapshot


def load_env_state(envs, snapshot: list) -> None:
    for env, saved in zip(envs.envs, snapshot):
        for plain in saved["layers"]:
            for k, v in plain.items():
                setattr(env, k, v.numpy().copy() if isinstance(v, torch.Tensor) else v)
            env = getattr(env, "env", env)
        env.np_random.bit_generator.state = saved["np_random"]


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, device: torch.device) -> None:
    """optimizer.load_state_dict for Adam's moments and step counters, keeping this run's settings: torch restores the
    saved ones (capturable, fused, foreach, betas; lr as a tensor on the CPU after map_location), so a checkpoint of a
    CUDA-graph run would not resume on the CPU, nor a CPU one stay free of host syncs on CUDA. The step counters go
    where this run's settings want them; moments that do not fit their parameters are refused (ValueError)."""
    own = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for g, settings in zip(optimizer.param_groups, own):
        g.update(settings)
        g["lr"] = torch.tensor(float(g["lr"]), device=device)
        for p in g["params"]:
            st = optimizer.state.get(p, {})
            if st and not all(torch.is_tensor(st.get(k)) and st[k].shape == p.shape for k in ("exp_avg", "exp_avg_sq")):
                raise ValueError(f"Adam's moments do not fit a parameter of shape {tuple(p.shape)}")
            if torch.is_tensor(st.get("step")):
                on_param = g.get("capturable") or g.get("fused")
                st["step"] = st["step"].to(p.device if on_param else torch.device("cpu"), torch.float32, copy=True)
            elif st:
                raise ValueError("Adam's step counter is missing")


def rng_state() -> dict:
    """The script's randomness: torch's CPU generator, and the CUDA one of this process's GPU when it is in use
    (sampling and shuffles on --cuda draw from it)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(path: str, agent: Agent, optimizer, args: Args, global_step: int, iteration: int,
                    rollout: Optional[dict] = None, other_ranks: list = (), kl_coef: Optional[float] = None) -> None:
    """Atomic write (temporary file, then rename): a kill during the save keeps the previous checkpoint, and a write
    that fails (disk full) removes its partial file and raises WriteError with the reason.
    kl_coef: the adapted coefficient of the KL-penalty variant (None with the clipped objective).
    `rollout` holds what an exact resume needs besides the networks: env states, next obs, episode counters.
    Under torchrun `other_ranks` holds the RNG state and rollout of ranks 1, 2, ... (the networks are the same)."""
    state = {
        "script": SCRIPT,
        "env_id": args.env_id,
        "model": agent.state_dict(),
        "optimizer": optimizer.state_dict(),
        "global_step": global_step,
        "iteration": iteration,
        "rng": rng_state(),
        "args": dataclasses.asdict(args),
        "rollout": rollout,
        "world_size": 1 + len(other_ranks),
        "other_ranks": list(other_ranks),
        "kl_coef": kl_coef,
    }
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:  # a Python file: torch's error for a failed write then carries the OSError
            torch.save(state, f)
        os.replace(tmp, path)
    except Exception as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        reason = os_error(e)
        if reason is None:
            raise
        raise WriteError(f"cannot write {path}: {reason}") from None


CHECKPOINT_KEYS = {"env_id": str, "model": dict, "optimizer": dict, "global_step": int, "iteration": int, "rng": dict,
                   "args": dict, "rollout": dict, "world_size": int, "other_ranks": list}
ROLLOUT_KEYS = ("envs", "next_obs", "next_done", "ep_return", "ep_length")
_read_checkpoints: dict = {}  # parse_args reads a checkpoint for its flags and keeps it here for main's states


def checkpoint_key(path: str) -> tuple:
    """Which version of the file: path, modification time, size."""
    try:
        st = os.stat(path)
    except OSError as e:
        die(f"cannot read checkpoint {path}: {e.strerror}")
    return os.path.abspath(path), st.st_mtime_ns, st.st_size


def fitted(x, shape: tuple) -> torch.Tensor:
    """A saved tensor of the shape this run needs (ValueError otherwise)."""
    if not torch.is_tensor(x) or tuple(x.shape) != tuple(shape):
        raise ValueError(f"a saved rollout state of shape {tuple(getattr(x, 'shape', ()))}, expected {tuple(shape)}")
    return x


def load_checkpoint(path: str, env_id: Optional[str] = None, keep: bool = False) -> dict:
    """Read and check a checkpoint; whatever is wrong with it is one line, exit 2. keep: hold it for the next call
    (parse_args for main), which takes it over: the optimizer's state shares its tensors and training changes them."""
    key = checkpoint_key(path)
    ckpt = _read_checkpoints.pop(key, None) or read_checkpoint(path)
    _read_checkpoints.clear()
    if keep:
        _read_checkpoints[key] = ckpt
    if env_id is not None and ckpt["env_id"] != env_id:
        die(f"{path} was trained on {ckpt['env_id']}, not {env_id} (pass --env-id {ckpt['env_id']})")
    return ckpt


def read_checkpoint(path: str) -> dict:
    try:
        with zipfile.ZipFile(path) as z:  # torch.load does not check the records' CRCs: a flipped bit would load
            bad = z.testzip()
        ckpt = None if bad else torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        die(f"cannot read checkpoint {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if bad:
        die(f"checkpoint {path} is damaged: its record {bad} fails its CRC check")
    if not isinstance(ckpt, dict) or ckpt.get("script") != SCRIPT:
        die(f"{path} is not a {SCRIPT} checkpoint (script={ckpt.get('script') if isinstance(ckpt, dict) else None})")
    damaged = lambda what: die(f"checkpoint {path} is damaged or was edited: {what}")  # noqa: E731
    for key, kind in CHECKPOINT_KEYS.items():
        if not isinstance(ckpt.get(key), kind) or isinstance(ckpt.get(key), bool):
            damaged(f"{key} is {type(ckpt[key]).__name__}, not {kind.__name__}" if key in ckpt else f"no {key}")
    if not (ckpt.get("kl_coef") is None or fits(ckpt["kl_coef"], float) and 0 < ckpt["kl_coef"] < math.inf):
        damaged(f"kl_coef is {ckpt['kl_coef']!r}, not a positive number")
    for key in ("iteration", "global_step"):
        if ckpt[key] < 0:
            damaged(f"{key} is {ckpt[key]}")
    hints = typing.get_type_hints(Args, include_extras=True)
    for name, value in ckpt["args"].items():
        if name in hints and not fits(value, hints[name]):
            damaged(f"args.{name} is {value!r}, not {hint_text(hints[name])}")
    ranks = [ckpt, *ckpt["other_ranks"]]
    if ckpt["world_size"] != len(ranks):
        damaged(f"world_size {ckpt['world_size']} with states of {len(ranks)} process(es)")
    for r, state in enumerate(ranks):
        rng, rollout = (state.get("rng"), state.get("rollout")) if isinstance(state, dict) else (None, None)
        if not (isinstance(rng, dict) and torch.is_tensor(rng.get("torch"))
                and rng["torch"].shape == torch.get_rng_state().shape):
            damaged(f"the RNG state of rank {r} is missing or of the wrong size")
        if not (isinstance(rollout, dict) and all(k in rollout for k in ROLLOUT_KEYS)):
            damaged(f"the rollout state of rank {r} lacks one of {', '.join(ROLLOUT_KEYS)}")
    return ckpt


def fits(value, hint) -> bool:
    """Whether a value read from a checkpoint has the type of its Args field (int, float, bool, str, Optional,
    Literal choices)."""
    origin, parts = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return fits(value, parts[0])
    if origin is typing.Union:
        return any(fits(value, p) for p in parts)
    if origin is Literal:
        return value in parts
    if hint is type(None):
        return value is None
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def hint_text(hint) -> str:
    origin, parts = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return hint_text(parts[0])
    if origin is Literal:
        return "one of " + ", ".join(map(repr, parts))
    if origin is typing.Union:
        return " or ".join(hint_text(p) for p in parts)
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def launcher(world: int) -> str:
    """The command that runs this script with `world` processes (in the messages that say how to go on)."""
    return f"{f'torchrun --nproc-per-node {world}' if world > 1 else 'python'} {SCRIPT}"


def adapted_kl_coef(args: Args, ckpt: dict) -> Optional[float]:
    """The checkpoint's adapted KL-penalty coefficient, which a resumed adaptive run goes on from (else None)."""
    return ckpt.get("kl_coef") if args.kl_penalty_target is not None else None


def check_resume(ckpt: dict, args: Args, world: int) -> None:
    """The iteration count and lr schedule hold for the checkpoint's processes and rollout size."""
    if ckpt["world_size"] != world:  # iterations, seeds and envs are per process
        n = ckpt["world_size"]
        die(f"{args.resume} was written by {n} process(es); resume it with as many: "
            f"{launcher(n)} --resume {args.resume}")
    saved = ckpt["args"]
    if (saved.get("num_envs"), saved.get("num_steps")) != (args.num_envs, args.num_steps):
        die(f"{args.resume} was written with --num-envs {saved.get('num_envs')} --num-steps {saved.get('num_steps')}; "
            "its iteration count and learning-rate schedule hold for that rollout: resume with the same")


# ---------------------------------------------------------------------------------------------------------
# Evaluation and load_policy
# ---------------------------------------------------------------------------------------------------------
def evaluate(agent: Agent, args: Args, device: torch.device, episodes: int, video_dir: str = "",
             rank: int = 0, stop=lambda: False) -> list[float]:
    """Run `episodes` full episodes with actions sampled from the policy (or its most likely ones with
    --eval-deterministic); return their undiscounted returns (fewer once stop() says so).
    Under torchrun each rank plays with its own seed, and rank 0 alone records videos."""
    env = make_env(args.env_id, 0, args.capture_video and rank == 0, video_dir)()
    returns = []
    obs, _ = env.reset(seed=args.seed + 10_000 + rank)
    ep_ret = 0.0
    while len(returns) < episodes and not stop():
        with torch.inference_mode():
            action = agent.act(obs_tensor(obs[None], device), args.eval_deterministic)
        obs, r, term, trunc, _ = env.step(int(action))
        ep_ret += float(r)
        if term or trunc:
            returns.append(ep_ret)
            ep_ret = 0.0
            if len(returns) < episodes:
                obs, _ = env.reset()
    env.close()
    return returns


def load_policy(path: str, deterministic: bool = False, device: str = "cpu"):
    """A trained policy for your own code: `policy = load_policy("runs/<run>/checkpoint.pt")`, then
    `action = policy(obs)` for one observation of the checkpoint's env, or `policy(batch)` for one action per row."""
    import gymnasium as gym

    err = io.StringIO()
    try:  # a library call: a bad file raises instead of exiting the caller's program
        with contextlib.redirect_stderr(err):
            ckpt = load_checkpoint(path)
    except SystemExit:
        raise ValueError(err.getvalue().strip().removeprefix("error: ")) from None
    probe = gym.make(ckpt["env_id"])
    shape, n_actions = probe.observation_space.shape, int(probe.action_space.n)
    probe.close()
    obs_dim = int(np.prod(shape))
    agent = Agent(obs_dim, n_actions).to(device)
    agent.load_state_dict(ckpt["model"])

    @torch.inference_mode()
    def policy(obs):
        obs = np.asarray(obs)
        if obs.shape in (shape, (obs_dim,)):
            batch = False
        elif obs.shape[1:] in (shape, (obs_dim,)):
            batch = True
        else:
            raise ValueError(f"an observation of shape {obs.shape}: expected {shape} or a batch of them")
        actions = agent.act(obs_tensor(obs if batch else obs[None], device), deterministic).cpu().numpy()
        return actions if batch else actions[0]

    return policy


# ---------------------------------------------------------------------------------------------------------
# Compile and CUDA-graph helpers
# ---------------------------------------------------------------------------------------------------------
def compile_hot_functions(policy, update, agent: Agent, args: Args):
    """The rollout's action sampling and the minibatch update, as they run: eager; torch.compile'd (--compile; mode
    reduce-overhead adds CUDA graphs with --cudagraphs); or recorded by dynamo's cudagraphs backend (--cudagraphs
    alone). The gradients are allocated here, outside any graph's memory pool; the update zeroes them in place."""
    for p in agent.parameters():
        p.grad = torch.zeros_like(p)
        if args.cudagraphs:  # a fixed address, so that the graph of clip + optimizer step may update them in place
            torch._dynamo.mark_static_address(p.grad)
    if args.compile:
        if args.torch_deterministic:  # compiled code draws the same random numbers as eager code
            import torch._inductor.config as inductor_config

            inductor_config.fallback_random = True
        mode = "reduce-overhead" if args.cudagraphs else None
        return torch.compile(policy, mode=mode), torch.compile(update, mode=mode)
    if args.cudagraphs:  # CUDA graphs without inductor: dynamo's cudagraphs backend records and replays
        return torch.compile(policy, backend="cudagraphs"), torch.compile(update, backend="cudagraphs")
    return policy, update


def cudagraph_skips() -> int:
    """How many compiled graphs torch decided to run without CUDA graphs (dynamo's and inductor's count; a graph that
    mutates an input whose address is not fixed is one), so that --cudagraphs never falls back silently."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------
def die(msg: str, every_rank: bool = False) -> None:
    """Bad input: one line on stderr, exit code 2, no traceback. Under torchrun every rank finds the same bad input
    and rank 0 alone says it, unless only this rank can see the problem (every_rank)."""
    if every_rank or int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_count(text: str) -> int:
    """A count written as 500000, 5e5, 1e7 or 1_000_000; anything that is not a whole number is an error."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not value.is_integer():
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


Count = Annotated[
    int,
    tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="INT",
        instance_from_str=lambda a: parse_count(a[0]),
        is_instance=lambda x: isinstance(x, int) and not isinstance(x, bool),
        str_from_instance=lambda x: [str(x)],
    ),
]
BOOL_WORDS = {"true": "", "yes": "", "1": "", "false": "no-", "no": "no-", "0": "no-"}


def bool_values(argv: list[str]) -> list[str]:
    """On/off flags given a value, as CleanRL's argparse scripts took them (`--track True`, `--anneal-lr=false`),
    become tyro's `--track` / `--no-anneal-lr`; any other value is left for tyro to refuse."""
    flags = {f.name.replace("_", "-") for f in dataclasses.fields(Args) if f.type in (bool, "bool")}
    out, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        flag = name[2:].replace("_", "-")
        if name.startswith("--") and flag in flags:
            if not eq and i + 1 < len(argv) and argv[i + 1].lower() in BOOL_WORDS:
                eq, value = "=", argv[i + 1]
                i += 1
            if eq and value.lower() in BOOL_WORDS:
                out.append(f"--{BOOL_WORDS[value.lower()]}{flag}")
                i += 1
                continue
        out.append(argv[i])
        i += 1
    return out


def parse_args(argv: Optional[list[str]] = None) -> Args:
    """tyro.cli, with its error boxes condensed to one line (exit code 2)."""
    argv = bool_values(sys.argv[1:] if argv is None else argv)
    default = None
    resume = resume_path(argv)
    if resume is not None:  # the checkpoint's arguments become the defaults; flags given now override them
        if not os.path.isfile(resume):
            die(f"--resume: no such file {resume}")
        saved = load_checkpoint(resume, keep=True)["args"]
        default = Args(**{f.name: saved[f.name] for f in dataclasses.fields(Args) if f.name in saved})
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = tyro.cli(Args, args=argv, default=default)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        # tyro prints a box on a terminal and dashed rules elsewhere: a title, then the message up to a rule line
        lines = [ln.strip().strip("│╭╮╰╯").strip() for ln in err.getvalue().splitlines()][1:]
        is_rule = lambda ln: bool(ln) and set(ln) <= set("─-")  # noqa: E731
        while lines and (not lines[0] or is_rule(lines[0])):
            lines.pop(0)
        message = []
        for ln in lines:
            if not ln or is_rule(ln):
                break
            message.append(ln)
        die(" ".join(message) or "invalid arguments (see --help)")
    validate(args)
    return args


def resume_path(argv: list[str]) -> Optional[str]:
    for i, a in enumerate(argv):
        if a == "--resume" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--resume="):
            return a.split("=", 1)[1]
    return None


def validate(args: Args) -> None:
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs", "torch_threads"):
        if getattr(args, name) <= 0 and not (name == "total_timesteps" and getattr(args, name) == 0):
            die(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("eval_episodes", "checkpoint_every", "stop_after"):
        if getattr(args, name) < 0:
            die(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    batch = args.num_envs * args.num_steps
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun: one rollout of every process
    if 0 < args.total_timesteps < batch * world:
        die(f"--total-timesteps {args.total_timesteps} is less than one rollout (num_envs*num_steps = {batch}"
            + (f", times {world} processes)" if world > 1 else ")"))
    if batch % args.num_minibatches:
        die(f"num_envs*num_steps = {batch} is not divisible by --num-minibatches {args.num_minibatches}")
    if args.norm_adv and args.norm_adv_scope == "minibatch" and batch // args.num_minibatches < 2:
        die(f"minibatches of {batch // args.num_minibatches} sample: --norm-adv needs at least 2 (their std)")
    if not 0 <= args.seed < 2**31:
        die(f"--seed must lie in [0, 2**31), got {args.seed}")
    if not (0 <= args.gamma <= 1 and 0 <= args.gae_lambda <= 1):
        die("--gamma and --gae-lambda must lie in [0, 1]")
    for f in dataclasses.fields(Args):  # nan / inf pass the range checks below unnoticed
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            die(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
    if args.learning_rate <= 0 or args.clip_coef <= 0 or args.max_grad_norm <= 0:
        die("--learning-rate, --clip-coef and --max-grad-norm must be positive")
    if args.ent_coef < 0 or args.vf_coef < 0:
        die("--ent-coef and --vf-coef must be >= 0")
    if args.target_kl is not None and args.target_kl <= 0:
        die(f"--target-kl must be positive, got {args.target_kl}")
    if args.kl_penalty_coef is not None and args.kl_penalty_coef < 0:
        die(f"--kl-penalty-coef must be >= 0, got {args.kl_penalty_coef}")
    if args.kl_penalty_target is not None and args.kl_penalty_target <= 0:
        die(f"--kl-penalty-target must be positive, got {args.kl_penalty_target}")
    if args.eval_deterministic and not args.eval_episodes and int(os.environ.get("RANK", "0")) == 0:
        print("note: --eval-deterministic applies to --eval-episodes; none asked")
    if args.cudagraphs and not args.cuda:
        die("--cudagraphs needs --cuda (CUDA graphs exist only on a GPU)")
    if args.cudagraphs and world > 1:
        die("--cudagraphs is not supported under torchrun (DDP's gradient all-reduce runs outside the graph)")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun: processes on this machine, one GPU each
    if args.cuda and torch.cuda.is_available() and torch.cuda.device_count() < local:
        die(f"--cuda with {local} processes on this machine but {torch.cuda.device_count()} GPU(s)")
    if args.cuda and not torch.cuda.is_available():
        die("--cuda given (or taken from the checkpoint: --no-cuda resumes on the CPU) but torch finds no CUDA "
            "device")


def check_env(args: Args) -> None:
    """Bad env ids and spaces ppo.py cannot drive are one-line errors, found before anything is written."""
    import gymnasium as gym

    try:
        probe = gym.make(args.env_id)
    except gym.error.Error as e:
        die(f"unknown or unusable env id {args.env_id!r}: {e}")
    except Exception as e:  # a missing optional dependency of the env, for instance
        die(f"cannot make {args.env_id!r}: {type(e).__name__}: {e}")
    if not isinstance(probe.action_space, gym.spaces.Discrete):
        die(f"{args.env_id} has a {type(probe.action_space).__name__} action space; ppo.py needs Discrete "
            "(use ppo_continuous.py for continuous actions)")
    start, n = int(probe.action_space.start), int(probe.action_space.n)
    if start != 0:  # the agent's actions are indices 0..n-1
        die(f"{args.env_id} has actions {start}..{start + n - 1}; ppo.py needs Discrete actions that start at 0")
    if not isinstance(probe.observation_space, gym.spaces.Box):
        die(f"{args.env_id} has a {type(probe.observation_space).__name__} observation space; ppo.py needs a Box")
    space = probe.observation_space
    if space.dtype == np.uint8 and len(space.shape) >= 2 and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: {args.env_id} observes {space.shape} uint8 images; ppo.py's MLP takes them flat and unscaled "
              "(0..255): for Atari use ppo_atari_envpool.py (CNN, inputs scaled by 1/255)")
    probe.close()
    if args.capture_video and not args.eval_episodes and int(os.environ.get("RANK", "0")) == 0:
        print("note: --capture-video records the --eval-episodes only; none asked")
    if args.capture_video:  # fail now, not after training, if this machine cannot render
        try:
            env = gym.make(args.env_id, render_mode="rgb_array")
            env.reset(seed=0)
            env.render()
            env.close()
        except Exception as e:
            die(f"--capture-video: {args.env_id} cannot render here ({type(e).__name__}: {e})")


if __name__ == "__main__":
    args = parse_args()
    for sig in STOP_SIGNALS:  # main() restores this at its end: a late signal then cannot break a clean exit
        signal.signal(sig, signal.SIG_IGN)  # (SIG_IGN: the interpreter's teardown resets Python-level handlers)
    main(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Everything is written and the process group destroyed. Skip the interpreter's teardown, where gloo's
        # threads now and then abort a finished run ("terminate called without an active exception", exit -6).
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
