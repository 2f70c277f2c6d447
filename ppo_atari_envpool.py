"""PPO for Atari through envpool (Breakout-v5 by default), with CleanRL's Atari settings, in one file.

    python ppo_atari_envpool.py --total-timesteps 1e7              # Breakout-v5, 10M steps; on the GPU if any
    python ppo_atari_envpool.py --env-id Pong-v5 --compile --cudagraphs
    python ppo_atari_envpool.py --stop-after 500                   # a piece of a run; then:
    python ppo_atari_envpool.py --resume runs/<run>/checkpoint.pt  # the next 500, same steps and lr schedule
    torchrun --nproc-per-node 2 ppo_atari_envpool.py               # data parallel: --num-envs envs per process

Read from the top: Args -> environments (envpool does all the Atari preprocessing) -> Agent (Nature CNN) -> the PPO
math (compute_gae, the truncation bootstrap, advantage normalisation and ppo_loss over the real transitions, the
adaptive-KL-penalty variant) -> main(), whose loop is the PPO note's steps (docs/reading_guide.md):
1. Collect rollout, 2. Compute advantages and returns (GAE), 3. Advantage normalisation,
4. Optimise policy & value for E epochs, 5. Update reference policy.
PPO ends at the banner below main(). What follows it (run context: torchrun, logging, signals; checkpoints and
resume; evaluation and load_policy; compile helpers; the command line) changes nothing that PPO computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import difflib
import fcntl
import io
import math
import os
import random
import signal
import sys
import threading
import time
import typing
import zipfile
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

# Before torch loads OpenMP: spinning OpenMP threads collapse on a shared CPU (measured 35 vs 154 SPS on 2 busy
# cores); on free cores it should cost little (not measured: these cores were never free). A user's value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import tyro  # noqa: E402


@dataclass
class Args:  # Count: an int that also reads 1e7 (defined with the command line, below the banner)
    # The note's hyperparameters
    num_steps: Count = 128
    """T: steps per environment in each rollout"""
    update_epochs: Count = 4
    """E: epochs over each rollout"""
    num_minibatches: Count = 4
    """number of minibatches per epoch (each of M = num_envs * T / num_minibatches samples)"""
    clip_coef: float = 0.1
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

    # Environment (envpool)
    env_id: str = "Breakout-v5"
    """id of an envpool Atari task (Breakout-v5, Pong-v5, BeamRider-v5, ...)"""
    total_timesteps: Count = 10_000_000
    """total environment steps of the run"""
    num_envs: Count = 8
    """number of parallel environments (per process under torchrun)"""
    num_threads: Count = 0
    """envpool worker threads (0: envpool's default); per process under torchrun"""
    sticky_actions: bool = False
    """repeat the previous action with probability 0.25 (Machado et al. 2018); off: 0"""
    max_episode_steps: Count = 27_000
    """truncate a game after this many agent steps (27000 = 108000 frames)"""

    # Run: seeds, devices, logging, checkpoints, evaluation
    exp_name: str = "ppo_atari_envpool"
    """name of this experiment (part of the run name)"""
    seed: Count = 1
    """seed of the experiment (python, numpy, torch and the environments)"""
    torch_deterministic: bool = True
    """deterministic torch algorithms (torch.use_deterministic_algorithms, warn-only; cuDNN; cuBLAS workspace)"""
    cuda: bool = dataclasses.field(default_factory=lambda: gpu_for_each_process())
    """run the networks on CUDA: the default where torch sees a GPU for each local process (as in CleanRL)"""
    compile: bool = False
    """torch.compile the action sampling and the update step"""
    cudagraphs: bool = False
    """capture the action sampling and the update step in CUDA graphs (needs --cuda)"""
    torch_threads: Count = 0
    """torch CPU threads (0: one per core, shared by this node's torchrun processes; the CNN is what costs on CPU)"""
    track: bool = False
    """log to Weights & Biases (WANDB_MODE=offline works without network)"""
    wandb_project_name: str = "ppo-reference"
    """wandb project name"""
    wandb_entity: Optional[str] = None
    """wandb entity (team)"""
    capture_video: bool = False
    """record videos of the evaluation games under runs/<run>/videos"""
    save_model: bool = False
    """write runs/<run>/checkpoint.pt at the end of training"""
    checkpoint_every: Count = 0
    """also write the checkpoint every N iterations (0: only at the end with --save-model)"""
    resume: Optional[str] = None
    """continue from this checkpoint.pt (run dir, steps, lr schedule; games restart); flags not given take its values"""
    stop_after: Count = 0
    """stop this process after N iterations with a checkpoint (0: run to the end); --resume continues"""
    eval_episodes: Count = 0
    """after training (or right away for a finished --resume checkpoint) evaluate N whole games"""
    eval_deterministic: bool = False
    """evaluate with the most likely action (a greedy agent can stall a game until --max-episode-steps)"""
    runs_dir: str = "runs"
    """directory that holds the runs"""


# ---------------------------------------------------------------------------------------------------------
# Environments: envpool's Atari (all the preprocessing), observations as tensors
# ---------------------------------------------------------------------------------------------------------
def make_envs(args: Args, num_envs: int, seed: int, **extra):
    """envpool's vectorised Atari env with the preprocessing of the 37 details, all done by envpool (env i is seeded
    with seed + i). What this script relies on, checked with envpool 1.2.5, env_type="gymnasium":
    - autoreset is "next step": the step() after a done returns the reset observation, reward 0, and ignores the
      action. With episodic_life a life loss is such a done too (the reset step then continues the same game;
      info["elapsed_step"] does not advance). Those reset steps carry no real transition: they are stored (static
      shapes for compile / CUDA graphs) but masked out of the loss.
    - the returned `terminated` is True on a life loss (episodic life: GAE treats it as terminal); info["terminated"]
      is True only when the game is over; `truncated` (max_episode_steps, 27000 agent steps = 108000 frames) ends
      the game as well. info["reward"] is the unclipped reward, from which the whole-game return is summed."""
    import envpool

    return envpool.make(
        args.env_id, env_type="gymnasium", num_envs=num_envs, seed=seed, num_threads=args.num_threads,
        noop_max=30,  # detail: up to 30 no-ops at reset
        frame_skip=4,  # detail: repeat each action 4 frames, max-pool over the last two
        episodic_life=True,  # detail: a life loss ends the training episode (not the game)
        use_fire_reset=True,  # detail: press FIRE on reset where the game needs it
        reward_clip=True,  # detail: sign of the reward for training; info["reward"] keeps the raw one
        img_height=84, img_width=84, gray_scale=True,  # detail: 84x84 grayscale
        stack_num=4,  # detail: stack the last 4 frames
        repeat_action_probability=0.25 if args.sticky_actions else 0.0,
        max_episode_steps=args.max_episode_steps,
        **extra,
    )


def obs_tensor(obs, device: torch.device, staging: Optional[tuple] = None) -> torch.Tensor:
    """A batch of observations as the Agent takes them: envpool's stacked frames, (N, 4, 84, 84) uint8, on `device`
    (the Agent scales them). The rollout on CUDA passes staging = (pinned host buffer, device buffer): one
    non-blocking copy into the same device memory at every step, nothing allocated."""
    if staging is None:
        return torch.as_tensor(np.asarray(obs), device=device)
    host, out = staging
    host.numpy()[:] = obs  # the previous copy out of `host` has finished: action.cpu() synchronised since
    return out.copy_(host, non_blocking=True)


# ---------------------------------------------------------------------------------------------------------
# Agent: Nature CNN shared by actor and critic, orthogonal init
# ---------------------------------------------------------------------------------------------------------
def layer_init(layer: nn.Module, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    torch.nn.init.orthogonal_(layer.weight, std)  # detail: orthogonal init with scaled gains
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, n_actions: int):
        super().__init__()
        self.network = nn.Sequential(  # detail: Nature CNN
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_actions), std=0.01)  # detail: near-uniform initial policy
        self.critic = layer_init(nn.Linear(512, 1), std=1.0)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(torch.div(x, 255.0))  # detail: uint8 observations scaled to [0, 1] (one kernel)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.hidden(x)).squeeze(-1)

    def get_action_and_value(self, x: torch.Tensor, action: Optional[torch.Tensor] = None):
        """Sample (or score) an action. Returns action, log pi(a|s), entropy, V(s)."""
        return self(x, action)[:4]

    def forward(self, x: torch.Tensor, action: Optional[torch.Tensor] = None):
        """get_action_and_value, plus log pi(.|s) of every action (the KL-penalty variant's exact KL compares the old
        and the new ones). The update calls the agent itself, so that DDP can average the gradients."""
        h = self.hidden(x)
        logits = self.actor(h)
        logp_all = torch.log_softmax(logits, dim=-1)
        if action is None:  # Gumbel-max sampling: one draw from Categorical(logits), cheap and compilable
            u = torch.rand_like(logits).clamp_(min=1e-20)
            action = torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)
        logprob = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return action, logprob, entropy, self.critic(h).squeeze(-1), logp_all

    def act(self, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """The action to play (evaluation, load_policy): sampled, or the most likely one."""
        return self.actor(self.hidden(x)).argmax(-1) if deterministic else self.get_action_and_value(x)[0]


# ---------------------------------------------------------------------------------------------------------
# The PPO math: pure functions (the tests check each against a plain loop)
# ---------------------------------------------------------------------------------------------------------
def compute_gae(rewards, values, dones, next_value, next_done, gamma: float, lam: float):
    """Generalized advantage estimation by the backward recursion of the note.

    rewards, values, dones: (T, N); dones[t] = 1 if obs[t] came with a done (the transition at t-1 ended an
    episode or a life). next_value, next_done: (N,) for the observation after the last step. Truncated episodes
    must already carry gamma * V(final obs) in their last reward (see bootstrap_truncated), so a done here always
    means "no bootstrap". Returns advantages and returns R_t = A_t + V(s_t), both (T, N).
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


def bootstrap_truncated(rewards, values, next_value, truncated, gamma: float):
    """Truncation is not termination: r_t += gamma * V(s_{t+1}) where the step t was cut by the time limit.

    In next-step autoreset the final observation of a truncated game is the next stored observation, so its value
    is values[t + 1] (or next_value after the last step): no extra forward pass. truncated: (T, N), 1 only where
    truncated and not terminated.
    """
    next_values = torch.cat([values[1:], next_value.unsqueeze(0)], dim=0)
    return rewards + gamma * next_values * truncated


def to_bootstrap(terminations: np.ndarray, truncations: np.ndarray, lives_before: np.ndarray,
                 lives_after: np.ndarray, game_over: np.ndarray) -> np.ndarray:
    """The steps whose next value is bootstrapped: cut by the time limit and not terminal. envpool reports a life
    lost (or the game over) on the time limit's last step as truncated and not terminated: the drop in lives tells,
    and info["terminated"] (game_over) in games without lives (Pong's lives stay 0)."""
    return truncations & ~terminations & (game_over == 0) & (lives_after >= lives_before)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def normalize_advantages(adv: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / (std + eps) over the entries with mask 1, unbiased std as in CleanRL / OpenAI baselines."""
    n = mask.sum()
    mean = (adv * mask).sum() / n.clamp(min=1.0)
    var = (((adv - mean) ** 2) * mask).sum() / (n - 1).clamp(min=1.0)
    return (adv - mean) / (var.sqrt() + eps)


def normalize_advantages_rollout(adv: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The note's advantage normalisation over the whole rollout, of the entries with mask 1: (A - mean) /
    sqrt(population variance + eps)."""
    n = mask.sum().clamp(min=1.0)
    mean = (adv * mask).sum() / n
    return (adv - mean) / torch.sqrt((((adv - mean) ** 2) * mask).sum() / n + eps)


def ppo_loss(newlogprob, oldlogprob, advantages, newvalue, oldvalue, returns, entropy, mask,
             clip_coef: float, clip_vloss: bool, ent_coef: float, vf_coef: float, norm_adv: bool, kl_coef=None,
             kl=None):
    """Clipped policy loss + c_v * value loss - c_H * entropy, with statistics (all tensors, no host sync).
    kl_coef (a number or 0-d tensor) selects the KL-penalty policy loss instead: -r*A + kl_coef * kl, with kl the
    exact KL(pi_old(.|s) || pi(.|s)) of each sample's state (categorical_kl), as in the PPO paper.

    mask (float, 1 = real transition, 0 = envpool reset step) weights every mean, so that the shapes stay static
    for torch.compile / CUDA graphs; with an all-ones mask this is the plain CleanRL loss.
    """
    if kl_coef is not None and kl is None:
        raise ValueError("ppo_loss: kl_coef needs kl, the KL(pi_old(.|s) || pi(.|s)) of each sample")
    logratio = newlogprob - oldlogprob
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = masked_mean(-logratio, mask)
        approx_kl = masked_mean((ratio - 1) - logratio, mask)  # k3 estimator, unbiased and low variance
        clipfrac = masked_mean(((ratio - 1.0).abs() > clip_coef).float(), mask)
    if norm_adv:
        advantages = normalize_advantages(advantages, mask)
    pg_loss1 = -advantages * ratio
    if kl_coef is None:
        pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
        pg_loss = masked_mean(torch.max(pg_loss1, pg_loss2), mask)
    else:
        pg_loss = masked_mean(pg_loss1 + kl_coef * kl, mask)
    if clip_vloss:  # detail: value clipping around the old prediction
        v_unclipped = (newvalue - returns) ** 2
        v_clipped = oldvalue + torch.clamp(newvalue - oldvalue, -clip_coef, clip_coef)
        v_loss = 0.5 * masked_mean(torch.max(v_unclipped, (v_clipped - returns) ** 2), mask)
    else:
        v_loss = 0.5 * masked_mean((newvalue - returns) ** 2, mask)
    entropy_loss = masked_mean(entropy, mask)
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
    KL over its real transitions (rollout_kl) halves or doubles beta with --kl-penalty-target (adapt)."""

    def __init__(self, args: Args, device: torch.device):
        self.target = args.kl_penalty_target
        self.beta = 1.0 if args.kl_penalty_coef is None else args.kl_penalty_coef  # on the host, for the rule
        self.coef = torch.tensor(self.beta, device=device)  # in a tensor, which the (compiled) update reads

    def loss_terms(self, old_logp_all: torch.Tensor, logp_all: torch.Tensor) -> dict:
        """ppo_loss's keyword arguments kl_coef and kl for one minibatch."""
        return dict(kl_coef=self.coef, kl=categorical_kl(old_logp_all, logp_all))

    @torch.no_grad()
    def rollout_kl(self, agent: Agent, b_obs, b_old_logp_all, b_mask, minibatch_size: int) -> torch.Tensor:
        """KL(pi_old || pi_theta) averaged over the rollout's real transitions after the update: the d of the rule."""
        total = torch.zeros((), device=b_obs.device)
        for start in range(0, len(b_obs), minibatch_size):
            mb = slice(start, start + minibatch_size)
            logp_all = torch.log_softmax(agent.actor(agent.hidden(b_obs[mb])), -1)
            total += (categorical_kl(b_old_logp_all[mb], logp_all) * b_mask[mb]).sum()
        return total / b_mask.sum().clamp(min=1)

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

        # envpool seeds env i with seed + i: each process's envs get seeds of their own, a resumed run fresh ones
        envs = make_envs(args, args.num_envs, args.seed + run.steps_at_start + run.rank * args.num_envs)
        obs_shape, n_actions = envs.single_observation_space.shape, int(envs.single_action_space.n)  # (4, 84, 84)
        agent = Agent(n_actions).to(device)
        if not args.cuda:  # oneDNN's convolutions (backward above all) run ~20% faster on NHWC weights on CPU
            agent = agent.to(memory_format=torch.channels_last)
        # lr in a tensor, so that annealing it recompiles nothing; on CPU the fused Adam saves the elementwise passes
        # over the 1.7M parameters; on CUDA `capturable` keeps the step counters on the GPU and reads the lr there
        optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(args.learning_rate, device=device), eps=1e-5,
                                     capturable=args.cuda, fused=True if not args.cuda else None)
        penalised = args.kl_penalty_coef is not None or args.kl_penalty_target is not None
        kl_penalty = KLPenalty(args, device) if penalised else None
        # a fresh start, or the state a checkpoint stopped in: networks, optimizer, RNG (envpool's games start anew)
        first_iteration, global_step = run.start(envs, agent, optimizer, kl_penalty, num_iterations)
        train_agent = run.data_parallel(agent)  # the update calls it: under torchrun DDP averages the gradients
        norm_per_minibatch = args.norm_adv and args.norm_adv_scope == "minibatch"

        def policy(obs):  # the rollout's action sampling
            action, logprob, _, value, logp_all = agent(obs)
            return action, logprob, value, logp_all

        def update(mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values, mb_mask, mb_old_logp_all):
            """One gradient step on one minibatch. Under torchrun each process's loss is the mean over its own real
            transitions and DDP averages the gradients: processes weigh equally (as in CleanRL's multi-GPU PPO),
            not by their counts of real transitions."""
            optimizer.zero_grad(set_to_none=False)
            _, newlogprob, entropy, newvalue, logp_all = train_agent(mb_obs, mb_actions)
            penalty = kl_penalty.loss_terms(mb_old_logp_all, logp_all) if kl_penalty else {}
            loss, stats = ppo_loss(newlogprob, mb_logprobs, mb_advantages, newvalue, mb_values, mb_returns, entropy,
                                   mb_mask, args.clip_coef, args.clip_vloss, args.ent_coef, args.vf_coef,
                                   norm_per_minibatch, **penalty)
            loss.backward()
            stats["grad_norm"] = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
            return stats

        policy, update = compile_hot_functions(policy, update, agent, args)  # --compile, --cudagraphs

        # Rollout storage (T, N, ...): observations stay uint8 (4x less memory; the network scales them); rewards,
        # dones and the steps to bootstrap come from the host: kept there (pinned on CUDA), copied once per rollout.
        # old_logp_all: log pi_old(.|s) of every action (the KL-penalty variant's KL)
        obs = torch.zeros((args.num_steps, args.num_envs) + obs_shape, dtype=torch.uint8, device=device)
        actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long, device=device)
        logprobs, values = (torch.zeros((args.num_steps, args.num_envs), device=device) for _ in range(2))
        old_logp_all = torch.zeros((args.num_steps, args.num_envs, n_actions), device=device)
        rewards_h, dones_h, truncs_h = (torch.zeros((args.num_steps, args.num_envs), pin_memory=args.cuda)
                                        for _ in range(3))
        # on CUDA the observations of each step go through one pinned host buffer into one device buffer (obs_tensor)
        staging = (torch.zeros((args.num_envs,) + obs_shape, dtype=torch.uint8, pin_memory=True),
                   torch.zeros((args.num_envs,) + obs_shape, dtype=torch.uint8, device=device)) if args.cuda else None
        next_obs_np, info = envs.reset()
        next_obs, lives = obs_tensor(next_obs_np, device, staging), info["lives"]
        next_done = np.zeros(args.num_envs, dtype=bool)

        for iteration in range(first_iteration, num_iterations + 1):
            lr_now = args.learning_rate
            if args.anneal_lr:  # detail: linear annealing to 0 over the whole run
                lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
            optimizer.param_groups[0]["lr"].fill_(lr_now)

            # 1. Collect rollout
            for step in range(args.num_steps):
                global_step += args.num_envs * world  # environment steps of all processes
                obs[step], dones_h[step] = next_obs, torch.from_numpy(next_done)
                with torch.inference_mode():
                    action, logprob, value, logp_all = policy(obs[step])
                actions[step], logprobs[step], values[step], old_logp_all[step] = action, logprob, value, logp_all

                next_obs_np, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                rewards_h[step] = torch.from_numpy(reward)  # clipped to its sign by envpool (reward_clip)
                # Truncation is not termination: the steps cut by the time limit, bootstrapped in step 2
                truncs_h[step] = torch.from_numpy(to_bootstrap(terminations, truncations, lives, infos["lives"],
                                                               infos["terminated"]))
                lives = infos["lives"]
                next_done = np.logical_or(terminations, truncations)  # detail: a life loss is terminal for GAE
                run.count_games(infos["reward"], terminations, truncations, infos["terminated"], global_step)
                next_obs = obs_tensor(next_obs_np, device, staging)

            # 2. Compute advantages and returns (GAE)
            rewards, dones, truncs = (x.to(device, non_blocking=True) for x in (rewards_h, dones_h, truncs_h))
            with torch.no_grad():
                next_value = agent.get_value(next_obs)
                rewards = bootstrap_truncated(rewards, values, next_value, truncs, args.gamma)
                advantages, returns = compute_gae(rewards, values, dones, next_value,
                                                  torch.as_tensor(next_done, dtype=torch.float32, device=device),
                                                  args.gamma, args.gae_lambda)
            # obs[t] that came with a done is the last frame of a life/game; its step was envpool's reset step (action
            # ignored, no transition): mask it out of the loss instead of training on it (CleanRL trains on it).
            mask = 1.0 - dones
            b_obs, b_old_logp_all = obs.reshape((batch_size,) + obs_shape), old_logp_all.reshape(batch_size, n_actions)
            b_actions, b_logprobs, b_advantages, b_returns, b_values, b_mask = (
                x.reshape(-1) for x in (actions, logprobs, advantages, returns, values, mask))

            # 3. Advantage normalisation: by default per minibatch inside ppo_loss (CleanRL's); the note's form,
            # once over the whole rollout, with --norm-adv-scope rollout (both over the real transitions only)
            if args.norm_adv and not norm_per_minibatch:
                b_advantages = normalize_advantages_rollout(b_advantages, b_mask)

            # 4. Optimise policy & value for E epochs
            update_stats = []
            for epoch in range(args.update_epochs):
                b_inds = torch.randperm(batch_size, device=device)  # shuffle, then split into minibatches
                for start in range(0, batch_size, minibatch_size):
                    mb = b_inds[start:start + minibatch_size]
                    stats = update(b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb], b_returns[mb],
                                   b_values[mb], b_mask[mb], b_old_logp_all[mb])
                    update_stats.append({k: v.clone() for k, v in stats.items()})  # a CUDA graph reuses its outputs
                if args.target_kl is not None and run.mean_over_ranks(stats["approx_kl"]) > args.target_kl:
                    break  # detail: early stop of the epochs

            # 5. Update reference policy: theta_old <- theta, implicitly (the next rollout samples from theta). The
            # KL-penalty variant measures KL(pi_old || pi_theta) over the rollout and adapts its coefficient to it.
            rollout_kl = (kl_penalty.rollout_kl(agent, b_obs, b_old_logp_all, b_mask, minibatch_size) if kl_penalty
                          else None)
            stats = run.log_iteration(iteration, global_step, lr_now, update_stats, rollout_kl, b_values, b_returns,
                                      b_mask)
            if stats is None:  # a non-finite update: the run stops with the last good checkpoint
                break
            if kl_penalty:
                kl_penalty.adapt(stats["kl"])  # the coefficient of the next update
            if run.end_of_iteration(iteration, global_step):  # checkpoints; --stop-after, signals
                break
        run.finish(global_step)  # the final checkpoint, then --eval-episodes
    return run.result


# =========================================================================================================
# Plumbing: nothing below this line changes what PPO computes. Run context (torchrun, seeds, run directory,
# logging, signals), checkpoints and resume, evaluation and load_policy, compile helpers, command line.
# =========================================================================================================
SCRIPT = "ppo_atari_envpool.py"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class WriteError(Exception):
    """A file of the run could not be written (disk full, quota, read-only file system): one line, exit 1."""


class Run:
    """What one run owns around the algorithm, from the first line of main() to the last: SIGTERM / SIGINT (honoured
    at the end of an iteration, after the final checkpoint and during the evaluation), the torchrun process group,
    seeds, the run directory and its lock, TensorBoard / wandb and the progress line, checkpoints and resume, and
    the one-line errors of a write that failed."""

    def __init__(self, args: Args):
        self.args = args
        self.signals: list[int] = []
        self.stop_requested = False  # a signal reached this or another process (all-reduced each iteration)
        self.finished, self.failed = True, False  # failed: a non-finite update (exit 1)
        self.rank, self.world, self.device = 0, 1, torch.device("cpu")  # until setup() knows them
        self.ckpt, self.writer, self.wandb, self.envs, self.lock_fd = None, None, False, None, None
        self.checkpoint_path, self.final_saved = None, False  # final_saved: the trained state is in a checkpoint
        self.write_error: Optional[str] = None  # a failed write of rank 0, which every rank stops on together
        self.first_iteration, self.steps_at_start = 1, 0  # where this process starts (a checkpoint's, if resumed)
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
            self.first_iteration, self.steps_at_start = self.ckpt["iteration"] + 1, self.ckpt["global_step"]
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
        # --torch-threads 0: the cores of this node, shared among its processes (torchrun's LOCAL_WORLD_SIZE)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.world > 1 else 1
        torch.set_num_threads(args.torch_threads or max(1, (os.cpu_count() or 1) // local_world))

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
                self.envs.close()
            if self.writer is not None:
                self.writer_call("close")
            if exc_type is WriteError:
                self.write_error = str(exc)
            if self.world > 1 and torch.distributed.is_initialized():
                import torch.distributed as dist

                if clean:  # no rank leaves while another still works; a failed write of rank 0 stops them all
                    self.write_error = first_error(self.write_error, self.world)[1]
                dist.destroy_process_group()
            if self.write_error:  # (said by rank 0 for all ranks)
                if self.rank == 0:
                    print(f"error: {self.write_error} ({self.kept()})", file=sys.stderr)
                self.failed = True
            if self.wandb:
                import wandb

                wandb.finish(exit_code=int(self.failed or not clean))
        finally:  # whatever failed above, the process gets back its lock, handlers and torch settings
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
        """Networks, optimizer, RNG and the KL coefficient from the checkpoint (if any; a state that does not fit is
        one line, exit 2, before anything is logged), then the logs. Returns
        (first iteration, global step). envpool's emulator state cannot be saved: a resumed run plays new games, so
        a stopped and resumed run is not identical to an uninterrupted one (the updates that follow see other
        games); everything else continues where it stopped."""
        args, ckpt, rank = self.args, self.ckpt, self.rank
        self.envs, self.agent, self.optimizer, self.kl_penalty = envs, agent, optimizer, kl_penalty
        self.num_iterations = num_iterations
        if ckpt is not None:
            error = None
            try:  # whatever torch raises on a checkpoint that does not fit is one line
                agent.load_state_dict(ckpt["model"])
                load_optimizer_state(optimizer, ckpt["optimizer"], self.device)
                set_rng_state((ckpt if rank == 0 else ckpt["other_ranks"][rank - 1])["rng"], self.device)  # this rank's
            except Exception as e:
                error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            # under torchrun each rank restores its own RNG: a state that only one rank finds unfit stops them all
            r, error = first_error(error, self.world)
            if error:
                die(f"checkpoint {args.resume} does not fit this run{f' (the state of rank {r})' if r else ''}: {error}")
            if adapted_kl_coef(args, ckpt) is not None:
                kl_penalty.set(ckpt["kl_coef"])  # the adapted value goes on
        self.open_logs()
        self.games = EpisodeStats(args.num_envs)
        if ckpt is not None and rank == 0:
            print(f"resumed {args.resume} at iteration {ckpt['iteration']}, global step {self.steps_at_start}")
            saved_total = ckpt["args"].get("total_timesteps", args.total_timesteps)
            if args.anneal_lr and saved_total != args.total_timesteps:  # not silent: the lr jumps
                print(f"note: --total-timesteps {args.total_timesteps} differs from the checkpoint's {saved_total}: "
                      "the learning rate now anneals to 0 at the new total")
            if adapted_kl_coef(args, ckpt) is not None:
                print(f"note: the adaptive KL-penalty coefficient goes on from the checkpoint's {ckpt['kl_coef']:.3g} "
                      "(--kl-penalty-coef sets the start of a new run only)")
        self.final_saved = ckpt is not None and self.first_iteration > num_iterations  # a finished run's checkpoint
        self.start_time, self.last_print = time.time(), 0.0
        return self.first_iteration, self.steps_at_start

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

    def count_games(self, reward_raw, terminated, truncated, game_over, global_step: int) -> None:
        """Logs the whole games (all lives, unclipped score) that ended at this step (see EpisodeStats)."""
        for _, ret, length in self.games.update(reward_raw, terminated, truncated, game_over):
            self.recent_returns.append(ret)
            self.log("charts/episodic_return", ret, global_step)
            self.log("charts/episodic_length", length, global_step)

    def mean_over_ranks(self, x: torch.Tensor) -> float:
        return float(all_ranks_sum(x, self.world)) / self.world

    def log_iteration(self, iteration: int, global_step: int, lr: float, update_stats: list[dict],
                      rollout_kl: Optional[torch.Tensor], b_values, b_returns, b_mask) -> Optional[dict]:
        """One host sync per iteration: the update's statistics averaged over minibatches and processes, whether the
        parameters went non-finite, whether a process got a stop signal and whether rank 0 failed to write its logs
        (WriteError on every rank). Logs them and prints the progress line. None after a non-finite update (exit 1)."""
        args, world, kl_penalty = self.args, self.world, self.kl_penalty
        names = list(update_stats[0])
        sums = [torch.stack([s[k] for s in update_stats]).sum() for k in names]
        extra = [] if rollout_kl is None else [rollout_kl]
        params_bad = ~torch.stack([torch.isfinite(p).all() for p in self.agent.parameters()]).all()
        flags = torch.tensor([float(len(self.signals)), float(self.write_error is not None)], device=self.device)
        *values, bad_params, signals, write_failed = all_ranks_sum(
            torch.cat([torch.stack([*sums, *extra, params_bad.float()]), flags]), world).tolist()
        if write_failed:  # rank 0 could not write its logs: every rank stops here
            raise WriteError(self.write_error or "rank 0 could not write its logs")
        stats = {k: v / (len(update_stats) * world) for k, v in zip(names, values)}
        if extra:
            stats["kl"] = values[-1] / world
        if bad_params:
            stats["parameters"] = float("nan")
        self.stop_requested = signals > 0
        bad = [k for k, v in stats.items() if not math.isfinite(v)]
        if bad:  # stop before a checkpoint of this update
            if self.rank == 0:  # (every rank sees the same all-reduced statistics)
                print(f"error: non-finite {', '.join(bad)} at iteration {iteration}; stopping ({self.kept()})",
                      file=sys.stderr)
            self.finished, self.failed = False, True  # no final checkpoint and no evaluation; exit 1 at the end
            return None
        mask, values_np, returns_np = torch.stack([b_mask, b_values, b_returns]).cpu().numpy()
        valid = mask > 0  # envpool's reset steps are no transitions: left out, as from the losses
        stats["explained_variance"] = explained_variance(values_np[valid], returns_np[valid])
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
    def checkpoint(self, iteration: int, global_step: int) -> None:
        """Called by every rank at the same iteration; rank 0 writes the states of all ranks."""
        ranks = gather_objects({"rng": rng_state()}, self.world)
        path, error = os.path.join(self.run_dir, "checkpoint.pt"), None
        if self.rank == 0:
            try:
                save_checkpoint(path, self.agent, self.optimizer, self.args, global_step, iteration, ranks[1:],
                                self.kl_penalty.beta if self.kl_penalty else None)
            except WriteError as e:
                error = str(e)
        error = first_error(error, self.world)[1]
        if error:  # every rank stops on a failed save of rank 0
            raise WriteError(error)
        self.checkpoint_path = path

    def end_of_iteration(self, iteration: int, global_step: int) -> bool:
        """A checkpoint every --checkpoint-every iterations; True (stop, with a checkpoint) after --stop-after
        iterations of this process or a signal to any process."""
        args = self.args
        stop_now = args.stop_after and iteration - self.first_iteration + 1 >= args.stop_after
        if (stop_now or self.stop_requested) and iteration < self.num_iterations:
            self.checkpoint(iteration, global_step)
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
            self.checkpoint(iteration, global_step)
        return False

    def finish(self, global_step: int) -> None:
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

        def save_final() -> None:
            set_rng_state(rng, self.device)
            self.checkpoint(max(self.num_iterations, self.first_iteration - 1), global_step)
            self.final_saved = True
            if rank == 0:
                print(f"checkpoint written to {self.checkpoint_path}")

        checkpointed = self.ckpt is not None or args.checkpoint_every or args.stop_after
        if args.save_model or (checkpointed and not self.final_saved):
            save_final()
        # under torchrun every rank plays its share of the evaluation games; rank 0 logs them all
        share = args.eval_episodes // world + int(rank < args.eval_episodes % world)
        mine, error = [], None
        try:
            if share:
                mine = evaluate(self.agent, args, self.device, share, os.path.join(self.run_dir, "videos"), rank,
                                world, stop=lambda: bool(self.signals))
        except Exception as e:  # (a full disk under the videos)
            if os_error(e) is None:
                raise
            error = f"cannot write the evaluation videos in {os.path.join(self.run_dir, 'videos')}: {os_error(e)}"
        parts = gather_objects((mine, [signal.Signals(s).name for s in self.signals], error), world)
        names, error = [n for _, sigs, _ in parts for n in sigs], next((e for _, _, e in parts if e), None)
        if names or error:  # the trained state first
            if not self.final_saved:
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
                print(f"eval: {args.eval_episodes} games{' (deterministic)' if args.eval_deterministic else ''}, "
                      f"return {mean:.2f} ± {std:.2f}")
            self.result["eval_returns"] = eval_returns


class EpisodeStats:
    """Whole-game episodic return (unclipped) and length across lives, for N envs in envpool's next-step autoreset.

    update() takes one step's info["reward"] (unclipped), the returned terminated/truncated (a life loss counts as
    terminated) and info["terminated"] (game over). The step right after any done is envpool's reset step: its
    action is ignored and it is no agent step, so it adds neither reward nor length. A game ends on game_over or
    truncated. Returns (env index, return, length in agent steps) for every game that ended at this step.
    """

    def __init__(self, num_envs: int):
        self.returns = np.zeros(num_envs, dtype=np.float64)
        self.lengths = np.zeros(num_envs, dtype=np.int64)
        self.after_done = np.zeros(num_envs, dtype=bool)

    def update(self, reward_raw, terminated, truncated, game_over) -> list[tuple[int, float, int]]:
        real = ~self.after_done
        self.returns += np.where(real, np.asarray(reward_raw, dtype=np.float64), 0.0)
        self.lengths += real
        ended = np.logical_or(np.asarray(game_over, dtype=bool), truncated)
        finished = [(int(i), float(self.returns[i]), int(self.lengths[i])) for i in np.nonzero(ended)[0]]
        self.returns[ended] = 0.0
        self.lengths[ended] = 0
        self.after_done = np.logical_or(terminated, truncated)
        return finished


def quiet_event_writer_thread(previous):
    """threading.excepthook during a run: TensorBoard's writer thread re-raises a failed write (disk full), which the
    main thread's next call of the writer reports in one line (Run.writer_call); other threads go to `previous`."""
    return lambda hook_args: None if type(hook_args.thread).__name__ == "_AsyncWriterThread" else previous(hook_args)


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


LOCK_FDS: set = set()  # the run-directory locks this process holds; a forked child drops them (envpool forks none)


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
def gpu_for_each_process() -> bool:
    """--cuda's default: whether torch sees a GPU for each process on this machine (torchrun's LOCAL_WORLD_SIZE; one
    without torchrun). With fewer GPUs than processes the default is the CPU."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def setup_distributed(args: Args) -> tuple[int, int, torch.device]:
    """Rank, world size and device. Without torchrun (or with one process) no process group is created. Under
    torchrun every process steps its own --num-envs envs (envpool seeds offset by rank * num_envs, so no two ranks
    play the same games) and DistributedDataParallel averages the gradients; rank 0 alone logs and writes the
    checkpoint, which holds the torch RNG of every rank."""
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
    # checkpoint, and for the longest share of the evaluation games
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
# Checkpoints and resume: network, optimizer, torch RNG of every rank, iteration and step count (so the lr
# schedule), the KL-penalty coefficient and the args; not envpool's games (their emulator state cannot be saved)
# ---------------------------------------------------------------------------------------------------------
def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, device: torch.device) -> None:
    """optimizer.load_state_dict for Adam's moments and step counters, keeping this run's settings: torch restores the
    saved ones (capturable, fused, foreach, betas; lr as a tensor on the CPU after map_location), so a checkpoint of a
    CUDA-graph run would not resume on the CPU, nor a CPU one stay free of host syncs on CUDA. The step counters go
    where this run's settings want them, as copies (the checkpoint read stays as it was read); moments that do not
    fit their parameters are refused (ValueError: the fused CPU Adam would write past a moment of the wrong size)."""
    own = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for g, settings in zip(optimizer.param_groups, own):
        g.update(settings)
        g["lr"] = torch.tensor(float(g["lr"]), device=device)
        for p in g["params"]:
            st = optimizer.state.get(p, {})
            if st and not all(torch.is_tensor(st.get(k)) and st[k].shape == p.shape for k in ("exp_avg", "exp_avg_sq")):
                raise ValueError(f"Adam's moments do not fit a parameter of shape {tuple(p.shape)}")
            for k, v in st.items():  # moments in the parameter's memory layout (channels_last on the CPU, not on
                if torch.is_tensor(v) and v.shape == p.shape:  # CUDA): the fused kernel pairs them by raw memory
                    st[k] = torch.empty_like(p).copy_(v)
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
                    other_ranks: list = (), kl_coef: Optional[float] = None) -> None:
    """Atomic write (temporary file, then rename): a kill during the save keeps the previous checkpoint, and a write
    that fails (disk full) removes its partial file and raises WriteError with the reason.
    Under torchrun `other_ranks` holds the RNG state of ranks 1, 2, ... (the networks are the same).
    kl_coef: the adapted coefficient of the KL-penalty variant (None with the clipped objective)."""
    state = {
        "script": SCRIPT,
        "env_id": args.env_id,
        "model": agent.state_dict(),
        "optimizer": optimizer.state_dict(),
        "global_step": global_step,
        "iteration": iteration,
        "rng": rng_state(),
        "args": dataclasses.asdict(args),
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
                   "args": dict, "world_size": int, "other_ranks": list}
_read_checkpoints: dict = {}  # parse_args reads a checkpoint for its flags and keeps it here for main's states


def checkpoint_key(path: str) -> tuple:
    """Which version of the file: path, modification time, size."""
    try:
        st = os.stat(path)
    except OSError as e:
        die(f"cannot read checkpoint {path}: {e.strerror}")
    return os.path.abspath(path), st.st_mtime_ns, st.st_size


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
        rng = state.get("rng") if isinstance(state, dict) else None
        if not (isinstance(rng, dict) and torch.is_tensor(rng.get("torch"))
                and rng["torch"].shape == torch.get_rng_state().shape):
            damaged(f"the RNG state of rank {r} is missing or of the wrong size")
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
             rank: int = 0, world: int = 1, stop=lambda: False) -> list[float]:
    """Play `episodes` whole games (all lives) with actions sampled from the policy (its most likely ones with
    --eval-deterministic); return their unclipped scores (fewer once stop() says so). With --capture-video each
    game's RGB frames are written to video_dir/game-<k>.mp4. Under torchrun each rank plays its share of the games
    with its own seed, and rank 0 alone records videos of its share and prints its progress."""
    video = args.capture_video and rank == 0
    env = make_envs(args, 1, args.seed + 10_000 + rank, **({"render_mode": "rgb_array"} if video else {}))
    stats = EpisodeStats(1)
    returns, frames = [], []
    obs, _ = env.reset()
    while len(returns) < episodes and not stop():
        with torch.inference_mode():
            action = agent.act(obs_tensor(obs, device), args.eval_deterministic)
        obs, _, term, trunc, info = env.step(action.cpu().numpy())
        if video:
            frames.append(env.render()[0])
        for _, ret, length in stats.update(info["reward"], term, trunc, info["terminated"]):
            returns.append(ret)
            if rank == 0:  # games are long
                share = f" of rank 0's share ({world} ranks)" if world > 1 else ""
                print(f"eval game {len(returns)}/{episodes}{share}: score {ret:.0f}, {length} steps", flush=True)
            if video:
                from moviepy import ImageSequenceClip

                os.makedirs(video_dir, exist_ok=True)
                ImageSequenceClip(frames, fps=30).write_videofile(
                    os.path.join(video_dir, f"game-{len(returns)}.mp4"), logger=None)
                frames = []
    env.close()
    return returns


def load_policy(path: str, deterministic: bool = False, device: str = "cpu"):
    """A trained policy for your own code: `policy = load_policy("runs/<run>/checkpoint.pt")`, then
    `action = policy(obs)` for one stacked observation (4, 84, 84) uint8, or `policy(batch)` for one action per
    observation, from envs made as in training: `make_envs(Args(env_id=..., sticky_actions=...), n, seed)`."""
    err = io.StringIO()
    try:  # a library call: a bad file raises instead of exiting the caller's program
        with contextlib.redirect_stderr(err):
            ckpt = load_checkpoint(path)
    except SystemExit:
        raise ValueError(err.getvalue().strip().removeprefix("error: ")) from None
    agent = Agent(int(ckpt["model"]["actor.weight"].shape[0])).to(device)
    if torch.device(device).type == "cpu":  # as in training: oneDNN's convolutions are faster on NHWC weights
        agent = agent.to(memory_format=torch.channels_last)
    agent.load_state_dict(ckpt["model"])

    @torch.inference_mode()
    def policy(obs):
        x = obs_tensor(obs, torch.device(device))
        if x.dtype != torch.uint8 or tuple(x.shape[-3:]) != (4, 84, 84) or x.dim() not in (3, 4):
            raise ValueError(f"observations of shape {tuple(x.shape)} and dtype {x.dtype}: expected envpool's stacked "
                             "frames, (4, 84, 84) uint8, or a batch of them")
        batch = x.dim() == 4
        actions = agent.act(x if batch else x[None], deterministic).cpu().numpy()
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
    default, gpu_gone = None, False
    resume = resume_path(argv)
    if resume is not None:  # the checkpoint's arguments become the defaults; flags given now override them
        if not os.path.isfile(resume):
            die(f"--resume: no such file {resume}")
        saved = load_checkpoint(resume, keep=True)["args"]
        default = Args(**{f.name: saved[f.name] for f in dataclasses.fields(Args) if f.name in saved})
        if default.cuda and not gpu_for_each_process():  # written on a GPU, resumed where there is none (enough)
            default.cuda, default.cudagraphs, gpu_gone = False, False, True  # (--cuda by name is refused below)
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
    if gpu_gone and not args.cuda and int(os.environ.get("RANK", "0")) == 0:
        found = (f"{torch.cuda.device_count()} GPU(s) for {os.environ.get('LOCAL_WORLD_SIZE', '1')} processes"
                 if torch.cuda.is_available() else "none")
        print(f"note: {resume} was written on a GPU and torch finds {found} here: the run resumes on the CPU")
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
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs",
                 "max_episode_steps"):
        if getattr(args, name) <= 0 and not (name == "total_timesteps" and getattr(args, name) == 0):
            die(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("eval_episodes", "checkpoint_every", "stop_after", "torch_threads", "num_threads"):
        if getattr(args, name) < 0:
            die(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    batch = args.num_envs * args.num_steps
    if batch % args.num_minibatches:
        die(f"num_envs*num_steps = {batch} is not divisible by --num-minibatches {args.num_minibatches}")
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
    for flag, asked in (("--eval-deterministic", args.eval_deterministic), ("--capture-video", args.capture_video)):
        if asked and not args.eval_episodes and int(os.environ.get("RANK", "0")) == 0:
            print(f"note: {flag} applies to the --eval-episodes games; none asked")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun: one rollout of every process
    if args.seed < 0 or args.seed + args.total_timesteps + world * args.num_envs >= 2**31:
        die(f"--seed {args.seed}: envpool seeds (seed + global step + env index) must lie in [0, 2**31)")
    for name in ("max_episode_steps", "num_threads", "num_envs"):
        if getattr(args, name) >= 2**31:
            die(f"--{name.replace('_', '-')} must be below 2**31, got {getattr(args, name)}")
    if 0 < args.total_timesteps < batch * world:
        die(f"--total-timesteps {args.total_timesteps} is less than one rollout (num_envs*num_steps = {batch}"
            + (f", times {world} processes)" if world > 1 else ")"))
    if args.cudagraphs and not args.cuda:
        die("--cudagraphs needs --cuda (CUDA graphs exist only on a GPU)")
    if args.cudagraphs and world > 1:
        die("--cudagraphs is not supported under torchrun (DDP's gradient all-reduce runs outside the graph)")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun: processes on this machine, one GPU each
    if args.cuda and torch.cuda.is_available() and torch.cuda.device_count() < local:
        die(f"--cuda with {local} processes on this machine but {torch.cuda.device_count()} GPU(s)")
    if args.cuda and not torch.cuda.is_available():
        die("--cuda given but torch finds no CUDA device (without the flag the script uses the GPU if there is one)")
    check_env_id(args.env_id)


def atari_env_ids() -> list[str]:
    """envpool's Atari task ids (those whose spec is AtariEnvSpec)."""
    import envpool
    from envpool.registration import registry

    return sorted(e for e in envpool.list_all_envs() if registry.specs[e][1] == "AtariEnvSpec")


def check_env_id(env_id: str) -> None:
    ids = atari_env_ids()
    if env_id not in ids:
        close = difflib.get_close_matches(env_id, ids, n=5, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"e.g. {', '.join(ids[:5])}, ... ({len(ids)} in all)"
        die(f"unknown envpool Atari task {env_id!r}; {hint}")


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
