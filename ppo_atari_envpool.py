"""PPO for Atari through envpool (Breakout-v5 by default), with CleanRL's Atari settings, in one file.

    python ppo_atari_envpool.py --total-timesteps 1e7              # Breakout-v5, 10M steps; on a GPU if any, there
                                                                   # compiled and each hot function in a CUDA graph
    python ppo_atari_envpool.py --env-id Pong-v5 --no-compile --no-cudagraphs    # eager, also on a GPU
    python ppo_atari_envpool.py --stop-after 500                   # a piece of a run; then:
    python ppo_atari_envpool.py --resume runs/<run>/checkpoint.pt  # the next 500, same steps and lr schedule
    torchrun --nproc-per-node 2 ppo_atari_envpool.py               # data parallel: --num-envs envs per process

Read from the top: Args, environments (envpool does all the Atari preprocessing), Agent (Nature CNN), the PPO math,
then main(), whose loop is the note's five steps (docs/reading_guide.md). PPO ends at the banner below main(); the
flat helpers under it change nothing it computes.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import difflib
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

# Run as a script, before torch loads OpenMP: spinning OpenMP threads collapse on a shared CPU (Breakout at the
# default settings on 2 loaded cores: 75 vs 12-15 SPS; no change without load). A user's value wins.
if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import tyro  # noqa: E402


@dataclass
class Args:  # Count: an int that also reads 1e7; OnWithCuda: a flag on with --cuda (both below the banner)
    # The note's hyperparameters
    num_steps: Count = 128  # T: steps per environment in each rollout
    update_epochs: Count = 4  # E: epochs over each rollout
    num_minibatches: Count = 4  # minibatches per epoch (each of M = num_envs * T / num_minibatches samples)
    clip_coef: float = 0.1  # epsilon: clip range of the probability ratio (and of the value clip)
    learning_rate: float = 2.5e-4  # alpha: Adam learning rate
    gamma: float = 0.99  # gamma: discount factor
    gae_lambda: float = 0.95  # lambda: GAE parameter
    vf_coef: float = 0.5  # c_v: value loss coefficient
    ent_coef: float = 0.01  # c_H: entropy bonus coefficient

    # Implementation details (CleanRL's) and the note's adaptive-KL-penalty variant
    anneal_lr: bool = True  # anneal the learning rate linearly to 0
    norm_adv: bool = True  # standardise the advantages (where: --norm-adv-scope)
    norm_adv_scope: Literal["minibatch", "rollout"] = "minibatch"  # per minibatch (CleanRL) or once per rollout (note)
    clip_vloss: bool = True  # clip the value loss as in the original PPO code
    max_grad_norm: float = 0.5  # global gradient norm clip
    target_kl: Optional[float] = None  # stop the epochs of an update early once approx_kl exceeds this
    kl_penalty_coef: Optional[float] = None  # KL-penalty variant: -r*A + coef*KL(pi_old||pi), no ratio clip
    kl_penalty_target: Optional[float] = None  # adapt the coef (else 1): halve if KL < target/1.5, double if > 1.5x

    # Environment (envpool)
    env_id: str = "Breakout-v5"  # id of an envpool Atari task (Breakout-v5, Pong-v5, BeamRider-v5, ...)
    total_timesteps: Count = 10_000_000  # total environment steps of the run
    num_envs: Count = 8  # number of parallel environments (per process under torchrun)
    num_threads: Count = 0  # envpool worker threads (0: envpool's default); per process under torchrun
    overlap_envs: bool = False  # two envpools of half the envs: one steps while the other's actions are computed
    sticky_actions: bool = False  # repeat the previous action with probability 0.25 (Machado et al. 2018); off: 0
    max_episode_steps: Count = 27_000  # truncate a game after this many agent steps (27000 = 108000 frames)

    # Run: seeds, devices, logging, checkpoints, evaluation
    exp_name: str = "ppo_atari_envpool"  # name of this experiment (part of the run name)
    seed: Count = 1  # seed of the experiment (python, numpy, torch and the environments)
    torch_deterministic: bool = True  # deterministic torch algorithms (warn-only), cuDNN and cuBLAS workspace
    cuda: bool = field(default_factory=lambda: gpu_for_each_process())  # on CUDA (the default where torch sees a GPU)
    compile: OnWithCuda = None  # torch.compile the action sampling and the update step
    cudagraphs: OnWithCuda = None  # capture the action sampling and the update step each in one CUDA graph
    torch_threads: Count = 0  # torch CPU threads (0: one per core, shared by this node's torchrun processes)
    track: bool = False  # log to Weights & Biases (WANDB_MODE=offline works without network)
    wandb_project_name: str = "ppo-reference"  # wandb project name
    wandb_entity: Optional[str] = None  # wandb entity (team)
    capture_video: bool = False  # record videos of the evaluation games under runs/<run>/videos
    save_model: bool = False  # write runs/<run>/checkpoint.pt at the end of training
    checkpoint_every: Count = 0  # also write the checkpoint every N iterations (0: only at the end with --save-model)
    resume: Optional[str] = None  # continue this checkpoint.pt (games restart); flags not given take its values
    stop_after: Count = 0  # stop this process after N iterations with a checkpoint (0: run to the end)
    eval_episodes: Count = 0  # after training (or right away for a finished --resume checkpoint) evaluate N whole games
    eval_deterministic: bool = False  # evaluate with the most likely action (greedy play can stall a game)
    runs_dir: str = "runs"  # directory that holds the runs


# --- Environments: envpool's Atari (all the preprocessing), observations as tensors -----------------------
def make_envs(args: Args, num_envs: int, seed: int, **extra):
    """envpool's Atari, env i seeded with seed + i. Relied on (envpool 1.2.5): next-step autoreset (the step after a
    done returns the reset observation and reward 0 and ignores the action: stored, then masked out of the loss; a
    life loss is such a done too); `terminated` is True on a life loss, info["terminated"] only when the game is
    over; `truncated` (the time limit) ends the game too; info["reward"] is the unclipped reward."""
    import envpool

    return envpool.make(
        args.env_id, env_type="gymnasium", num_envs=num_envs, seed=seed, num_threads=args.num_threads,
        noop_max=30,  # detail: up to 30 no-ops at reset
        frame_skip=4,  # detail: repeat each action 4 frames, max-pool over the last two
        episodic_life=True,  # detail: a life loss ends the training episode (not the game)
        use_fire_reset=True,  # detail: press FIRE on reset where the game needs it
        reward_clip=True,  # detail: sign of the reward for training; info["reward"] keeps the raw one
        img_height=84, img_width=84, gray_scale=True, stack_num=4,  # detail: 84x84 grayscale, the last 4 frames
        repeat_action_probability=0.25 if args.sticky_actions else 0.0, max_episode_steps=args.max_episode_steps,
        **extra)


def obs_tensor(obs, device: torch.device) -> torch.Tensor:  # (N, 4, 84, 84) uint8 on `device` (the Agent scales it)
    return torch.as_tensor(np.asarray(obs)).to(device)  # plain copy (pinning the frames took 0.3 ms a step on a GPU)


class EpisodeStats:
    """Whole-game return (unclipped) and length in agent steps, across lives, in envpool's next-step autoreset: the
    step after a done adds nothing (its action is ignored). update() returns (env, return, length) of each game that
    ended at this step (game over or truncated)."""

    def __init__(self, num_envs: int):
        self.returns, self.lengths = np.zeros(num_envs, dtype=np.float64), np.zeros(num_envs, dtype=np.int64)
        self.after_done = np.zeros(num_envs, dtype=bool)

    def update(self, reward_raw, terminated, truncated, game_over) -> list[tuple[int, float, int]]:
        real = ~self.after_done
        self.returns += np.where(real, reward_raw, 0.0)
        self.lengths += real
        ended = np.logical_or(game_over, truncated)
        self.after_done = np.logical_or(terminated, truncated)
        if not ended.any():  # (most steps)
            return []
        finished = [(int(i), float(self.returns[i]), int(self.lengths[i])) for i in np.flatnonzero(ended)]
        self.returns[ended], self.lengths[ended] = 0.0, 0
        return finished


# --- Agent: Nature CNN shared by actor and critic, orthogonal init ----------------------------------------
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
        return self(x, action)[:4]  # action, log pi(a|s), entropy, V(s)

    def forward(self, x: torch.Tensor, action: Optional[torch.Tensor] = None):
        """get_action_and_value, plus log pi(.|s) of every action (the KL-penalty variant's exact KL); the update
        calls the agent itself, so that DDP averages the gradients."""
        h = self.hidden(x)
        logits = self.actor(h)
        logp_all = torch.log_softmax(logits, dim=-1)
        if action is None:  # Gumbel-max sampling: one draw from Categorical(logits), cheap and compilable
            u = torch.rand_like(logits).clamp_(min=1e-20)
            action = torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)
        logprob = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return action, logprob, entropy, self.critic(h).squeeze(-1), logp_all

    def act(self, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:  # evaluation, load_policy
        return self.actor(self.hidden(x)).argmax(-1) if deterministic else self.get_action_and_value(x)[0]


# --- The PPO math: pure functions (the tests check each against a plain loop) -----------------------------
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


def bootstrap_truncated(rewards, values, next_value, truncated, gamma: float):
    """Truncation is not termination: r_t += gamma * V(s_{t+1}) where the time limit cut step t (truncated: (T, N),
    1 there). In next-step autoreset the final observation is the next stored one: values[t + 1], or next_value."""
    next_values = np.concatenate([values[1:], next_value[None]], axis=0)
    return rewards + gamma * next_values * truncated


def to_bootstrap(terminations: np.ndarray, truncations: np.ndarray, lives_before: np.ndarray,
                 lives_after: np.ndarray, game_over: np.ndarray) -> np.ndarray:
    """The steps cut by the time limit and not terminal. envpool reports a life lost (or the game over) on the time
    limit's step as truncated only: the drop in lives tells, or game_over in games without lives (Pong's stay 0)."""
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
    """The note's form, over the rollout's entries with mask 1: (A - mean) / sqrt(population variance + eps)."""
    n = mask.sum().clamp(min=1.0)
    mean = (adv * mask).sum() / n
    return (adv - mean) / torch.sqrt((((adv - mean) ** 2) * mask).sum() / n + eps)


def ppo_loss(newlogprob, oldlogprob, advantages, newvalue, oldvalue, returns, entropy, mask,
             clip_coef: float, clip_vloss: bool, ent_coef: float, vf_coef: float, norm_adv: bool, kl_coef=None,
             kl=None):
    """Clipped policy loss + c_v * value loss - c_H * entropy, and statistics (tensors, no host sync). With kl_coef,
    the KL-penalty policy loss -r*A + kl_coef * kl instead (kl: categorical_kl of each sample's state). Every mean
    is over mask 1 (real transitions; 0: envpool's reset steps), so that the shapes stay static for compilation."""
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
    """Exact KL(pi_old(.|s) || pi(.|s)) of each state: sum over actions of p_old * (log p_old - log p)."""
    return (old_logp.exp() * (old_logp - new_logp)).sum(-1)


def adapt_kl_coef(coef: float, kl: float, target: float) -> float:
    """The PPO paper's rule: halve below target/1.5, double above 1.5*target; within [1e-6, 1e6]."""
    if kl < target / 1.5:
        coef /= 2
    elif kl > target * 1.5:
        coef *= 2
    return min(max(coef, 1e-6), 1e6)


class KLPenalty:
    """The adaptive-KL-penalty variant (PPO paper, sec. 4): the policy loss -r*A + beta * KL(pi_old || pi)
    (loss_terms); after each update the rollout's KL (rollout_kl) halves or doubles beta (adapt)."""

    def __init__(self, args: Args, device: torch.device):
        self.target = args.kl_penalty_target
        self.beta = 1.0 if args.kl_penalty_coef is None else args.kl_penalty_coef  # on the host, for the rule
        self.coef = torch.tensor(self.beta, device=device)  # in a tensor, which the (compiled) update reads

    def loss_terms(self, old_logp_all: torch.Tensor, logp_all: torch.Tensor) -> dict:
        return dict(kl_coef=self.coef, kl=categorical_kl(old_logp_all, logp_all))  # ppo_loss's keyword arguments

    @torch.no_grad()
    def rollout_kl(self, agent: Agent, b_obs, b_old_logp_all, b_mask, minibatch_size: int) -> torch.Tensor:
        """KL(pi_old || pi_theta) over the rollout's real transitions after the update: the d of the rule."""
        total = torch.zeros((), device=b_obs.device)
        for start in range(0, len(b_obs), minibatch_size):
            mb = slice(start, start + minibatch_size)
            logp_all = torch.log_softmax(agent.actor(agent.hidden(b_obs[mb])), -1)
            total += (categorical_kl(b_old_logp_all[mb], logp_all) * b_mask[mb]).sum()
        return total / b_mask.sum().clamp(min=1)

    def adapt(self, kl: float) -> None:
        if self.target is not None:
            self.set(adapt_kl_coef(self.beta, kl, self.target))

    def set(self, beta: float) -> None:  # the coefficient of the next update (adapt; a resumed run's value)
        self.beta = beta
        self.coef.fill_(beta)


# --- Training loop ----------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    rank, world, device = setup_distributed(args.cuda)  # torchrun: one process per rank (gloo, or NCCL per GPU)
    ckpt = load_checkpoint(args.resume) if args.resume else None
    check_resume(ckpt, args, world)  # the same env, rollout size and processes (the iterations hold for them)
    run_dir = make_run_dir(args, rank, world)

    random.seed(args.seed + rank)  # seeding: each rank its own stream
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    set_torch_determinism(args.torch_deterministic)
    torch.set_num_threads(args.torch_threads or os.cpu_count() // int(os.getenv("LOCAL_WORLD_SIZE", "1")) or 1)

    batch_size = args.num_envs * args.num_steps  # per process; under torchrun the global batch is world times it
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // (batch_size * world)
    first_iteration, global_step = (ckpt["iteration"] + 1, ckpt["global_step"]) if ckpt else (1, 0)
    # env i gets seed + i (each process its own, a resumed run fresh ones), in one pool or two (--overlap-envs)
    seed, n = args.seed + global_step + rank * args.num_envs, args.num_envs // (2 if args.overlap_envs else 1)
    pools, parts = zip(*[(make_envs(args, n, seed + i), slice(i, i + n)) for i in range(0, args.num_envs, n)])
    resets = [pool.reset() for pool in pools]
    next_obs_np, lives = np.concatenate([o for o, _ in resets]), np.concatenate([i["lives"] for _, i in resets])
    obs_shape, n_actions = pools[0].single_observation_space.shape, int(pools[0].single_action_space.n)

    agent = Agent(n_actions).to(device)
    if not args.cuda:  # oneDNN's convolutions run faster on NHWC weights on the CPU (measured: +30% SPS)
        agent = agent.to(memory_format=torch.channels_last)
    # lr in a tensor (annealing recompiles nothing); capturable on CUDA (CUDA graphs), fused on the CPU (+12% SPS)
    optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(args.learning_rate, device=device), eps=1e-5,
                                 capturable=args.cuda, fused=not args.cuda or None)
    kl_penalty = KLPenalty(args, device) if (args.kl_penalty_coef, args.kl_penalty_target) != (None, None) else None
    if ckpt is not None:  # exact resume of the learner: networks, Adam, RNG of every rank, the KL coefficient
        with checkpoint_fits(args.resume):
            agent.load_state_dict(ckpt["model"])
            load_optimizer_state(optimizer, ckpt["optimizer"], device)
            set_rng_state(ckpt["rng"][rank], device)
            if kl_penalty and args.kl_penalty_target is not None and ckpt["kl_coef"] is not None:
                kl_penalty.set(ckpt["kl_coef"])  # the adapted coefficient goes on
    writer = open_logs(args, run_dir, rank, resumed=ckpt is not None)  # TensorBoard; wandb with --track
    # under torchrun DDP averages the gradients of the update (each rank its own envs; ranks weigh equally)
    train_agent = agent if world == 1 else nn.parallel.DistributedDataParallel(
        agent, device_ids=[device.index] if args.cuda else None)
    norm_per_minibatch = args.norm_adv and args.norm_adv_scope == "minibatch"

    def update(mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values, mb_mask, mb_old_logp_all):
        optimizer.zero_grad(set_to_none=False)  # one gradient step on one minibatch
        _, newlogprob, entropy, newvalue, logp_all = train_agent(mb_obs, mb_actions)
        penalty = kl_penalty.loss_terms(mb_old_logp_all, logp_all) if kl_penalty else {}
        loss, stats = ppo_loss(newlogprob, mb_logprobs, mb_advantages, newvalue, mb_values, mb_returns, entropy,
                               mb_mask, args.clip_coef, args.clip_vloss, args.ent_coef, args.vf_coef,
                               norm_per_minibatch, **penalty)
        loss.backward()
        stats["grad_norm"] = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return stats

    policy, update = compile_hot_functions(agent, update, agent, args)  # --compile, --cudagraphs

    # Rollout storage (T, N, ...): uint8 observations (the network scales them); on the host for the GAE: rewards,
    # dones and the steps to bootstrap. old_logp_all: log pi_old(.|s) of every action (the KL-penalty variant)
    obs = torch.zeros((args.num_steps, args.num_envs) + obs_shape, dtype=torch.uint8, device=device)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long, device=device)
    logprobs, values = (torch.zeros((args.num_steps, args.num_envs), device=device) for _ in range(2))
    old_logp_all = torch.zeros((args.num_steps, args.num_envs, n_actions), device=device)
    rewards, dones, truncs = (np.zeros((args.num_steps, args.num_envs), dtype=np.float32) for _ in range(3))
    next_obs, next_done = obs_tensor(next_obs_np, device), np.zeros(args.num_envs, dtype=bool)
    games, recent_returns, stats, result = [EpisodeStats(n) for _ in pools], [], {}, {}  # result: + eval_returns
    start_time, start_step, last_print = time.time(), global_step, 0.0
    last_checkpoint = os.path.abspath(args.resume) if args.resume else None
    final_save = args.save_model or args.checkpoint_every or args.stop_after or args.eval_episodes or args.resume

    def receive(p: int, part: slice, step: int) -> None:  # pool p's results of `step`, before its next actions
        next_obs_np, rewards[step, part], term, trunc, infos = pools[p].recv()
        # Truncation is not termination: the steps cut by the time limit, bootstrapped in step 2
        truncs[step, part] = to_bootstrap(term, trunc, lives[part], infos["lives"], infos["terminated"])
        lives[part], next_done[part] = infos["lives"], term | trunc  # detail: a life loss is terminal for GAE
        log_games(writer, games[p].update(infos["reward"], term, trunc, infos["terminated"]), recent_returns,
                  global_step)  # whole games: all lives, unclipped score
        next_obs[part] = torch.as_tensor(next_obs_np)  # the step's one copy of the frames to the device

    with StopSignals() as signals:  # SIGTERM / Ctrl-C are honoured at the end of an iteration
        for iteration in range(first_iteration, num_iterations + 1):
            frac = 1.0 - (iteration - 1.0) / num_iterations if args.anneal_lr else 1.0  # detail: lr annealed to 0
            lr_now = frac * args.learning_rate
            optimizer.param_groups[0]["lr"].fill_(lr_now)

            # 1. Collect rollout: each pool of envs steps while the next pool's actions are computed (receive: above)
            for step in range(args.num_steps):
                for p, (pool, part) in enumerate(zip(pools, parts)):
                    if step > 0:
                        receive(p, part, step - 1)
                    obs[step, part], dones[step, part] = next_obs[part], next_done[part]
                    with torch.inference_mode():
                        action, logprob, _, value, logp_all = policy(obs[step, part])  # the rollout's action sampling
                    pool.send(action.cpu().numpy())  # the step's one copy back (envpool's step is send, then recv)
                    actions[step, part], logprobs[step, part], values[step, part] = action, logprob, value
                    old_logp_all[step, part] = logp_all  # (the KL-penalty variant's)
                global_step += args.num_envs * world  # environment steps of all processes
            for p, part in enumerate(parts):
                receive(p, part, args.num_steps - 1)

            # 2. Compute advantages and returns (GAE), on the host: the values come over once per rollout
            with torch.no_grad():
                all_values = torch.cat([values, agent.get_value(next_obs)[None]]).cpu().numpy()
            values_h, next_value = all_values[:-1], all_values[-1]
            boot_rewards = bootstrap_truncated(rewards, values_h, next_value, truncs, args.gamma)
            advantages, returns = compute_gae(boot_rewards, values_h, dones, next_value, next_done.astype(np.float32),
                                              args.gamma, args.gae_lambda)
            # obs[t] that came with a done is the last frame of a life/game; its step was envpool's reset step (action
            # ignored, no transition): mask it out of the loss instead of training on it (CleanRL trains on it).
            mask = 1.0 - dones
            b_obs, b_old_logp_all = obs.reshape((batch_size,) + obs_shape), old_logp_all.reshape(batch_size, n_actions)
            b_actions, b_logprobs, b_values = actions.reshape(-1), logprobs.reshape(-1), values.reshape(-1)
            b_advantages, b_returns, b_mask = (torch.from_numpy(x.reshape(-1)).to(device)
                                               for x in (advantages, returns, mask))

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
                    mb_stats = update(b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb], b_returns[mb],
                                      b_values[mb], b_mask[mb], b_old_logp_all[mb])
                    update_stats.append({k: v.clone() for k, v in mb_stats.items()})  # CUDA graphs reuse outputs
                if args.target_kl is not None and all_ranks_mean(mb_stats["approx_kl"], world) > args.target_kl:
                    break  # detail: early stop of the epochs

            # 5. Update reference policy: theta_old <- theta, implicitly (the next rollout samples from theta). The
            # KL-penalty variant measures KL(pi_old || pi_theta) over the rollout and adapts its coefficient to it.
            rollout_kl = kl_penalty and kl_penalty.rollout_kl(agent, b_obs, b_old_logp_all, b_mask, minibatch_size)
            stats = iteration_stats(update_stats, world, signals, rollout_kl)  # the one host sync, all ranks' means
            check_finite(stats, iteration, last_checkpoint)  # a non-finite update stops the run (exit 1)
            stats["explained_variance"] = explained_variance(values_h[mask > 0], returns[mask > 0])  # real steps
            sps = int((global_step - start_step) / (time.time() - start_time))
            last_print = log_iteration(writer, args, stats, iteration, num_iterations, global_step, sps, lr_now,
                                       recent_returns, kl_penalty, last_print)
            if kl_penalty:
                kl_penalty.adapt(stats["kl"])  # the coefficient of the next update

            stop = stats["signals"] > 0 or 0 < args.stop_after <= iteration - first_iteration + 1  # (to any rank)
            if stop or (args.checkpoint_every and iteration % args.checkpoint_every == 0) or (
                    iteration == num_iterations and final_save):
                last_checkpoint = save_state(run_dir, args, agent, optimizer, kl_penalty, iteration, global_step,
                                             rank, world)
            if stop and iteration < num_iterations:
                if rank == 0:
                    say_stopped(iteration, signals, stats, args, world, last_checkpoint)  # and how to continue
                break
        else:  # the trained model is on disk before the evaluation starts; a signal stops the evaluation cleanly
            if args.eval_episodes and rank == 0:
                result["eval_returns"] = evaluate(agent, args, device, args.eval_episodes,
                                                  os.path.join(run_dir, "videos"), stop=lambda: bool(signals.received))
                log_evaluation(writer, args, result, signals, last_checkpoint, global_step)
    close_run(pools, writer, args, world)
    return {"global_step": global_step, "run_dir": run_dir, "stats": stats, "returns": recent_returns, **result}


# =========================================================================================================
# Plumbing: nothing below this line changes what PPO computes. torchrun, the run directory, logging,
# checkpoints, evaluation and load_policy, compile helpers, the command line and its one error boundary.
# =========================================================================================================
SCRIPT = "ppo_atari_envpool.py"


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


# --- this script's run helpers: resume checks, logging, checkpoint, evaluation, load_policy --------------
def check_resume(ckpt: Optional[dict], args: Args, world: int) -> None:  # its env, processes, rollout: this run's
    if ckpt is None:
        return
    n, saved = ckpt.get("world_size"), ckpt.get("args", {})
    for wrong, message in (
        (ckpt.get("env_id") != args.env_id, f"was trained on {ckpt.get('env_id')}, not {args.env_id}"),
        (n != world, f"was written by {n} process(es); resume it with as many: {launcher(n)} --resume {args.resume}"),
        ((saved.get("num_envs"), saved.get("num_steps")) != (args.num_envs, args.num_steps),
         f"was written with --num-envs {saved.get('num_envs')} --num-steps {saved.get('num_steps')}; its iterations "
         "and lr schedule hold for them: resume with the same")):
        if wrong:
            raise Failure(f"{args.resume} {message}")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"resumed {args.resume} at iteration {ckpt['iteration']}, global step {ckpt['global_step']} (note: "
              "envpool cannot save its games: they start anew)")


def log_games(writer, games: list, recent_returns: list, global_step: int) -> None:
    for _, ret, length in games:
        recent_returns.append(ret)
        if writer is not None:
            writer.add_scalar("charts/episodic_return", ret, global_step)
            writer.add_scalar("charts/episodic_length", length, global_step)


def iteration_stats(update_stats: list[dict], world: int, signals: StopSignals, kl=None) -> dict:
    # The one host sync: the update's statistics (and the rollout's KL), means over minibatches and ranks; signals
    stats = {k: torch.stack([s[k] for s in update_stats]).mean() for k in update_stats[0]} | (
        {} if kl is None else {"kl": kl})
    stats["signals"] = torch.full_like(stats["approx_kl"], float(bool(signals.received)))
    stats = dict(zip(stats, all_ranks_mean(torch.stack([v.float() for v in stats.values()]), world).tolist()))
    return {**stats, "signals": round(stats["signals"] * world)}


def log_iteration(writer, args: Args, stats: dict, iteration: int, num_iterations: int, global_step: int, sps: int,
                  lr: float, recent_returns: list, kl_penalty, last_print: float) -> float:  # when last printed
    if writer is None:  # TensorBoard and the progress line (every 5 s and at the end): rank 0
        return last_print
    scalars = {"charts/learning_rate": lr, "charts/SPS": sps, **{f"losses/{k}": stats[k] for k in (
        "value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "explained_variance")}}
    if kl_penalty is not None:  # (the coefficient this update used)
        scalars.update({"losses/kl": stats["kl"], "charts/kl_coef": kl_penalty.beta})
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, global_step)
    if time.time() - last_print < 5.0 and iteration < num_iterations:
        return last_print
    eta = (num_iterations - iteration) * global_step / max(iteration, 1) / sps if sps > 0 else math.inf
    kl = f"  kl={stats['kl']:.4f} kl_coef={kl_penalty.beta:.3g}" if kl_penalty else ""
    print(f"iter {iteration}/{num_iterations}  global_step={global_step}  SPS={sps}  return(last 20)="
          f"{np.mean(recent_returns[-20:]) if recent_returns else float('nan'):.1f}  approx_kl={stats['approx_kl']:.4f}"
          f"{kl}  eta={eta_text(eta)}", flush=True)
    return time.time()


def say_stopped(iteration: int, signals: StopSignals, stats: dict, args: Args, world: int, path: str) -> None:
    why = signal.Signals(signals.received[0]).name if signals.received else (
        "a signal to another rank" if stats["signals"] > 0 else f"--stop-after {args.stop_after}")
    print(f"stopped at iteration {iteration} ({why}); continue with: {launcher(world)} --resume {path}", flush=True)


def save_state(run_dir: str, args: Args, agent: Agent, optimizer, kl_penalty, iteration: int, global_step: int,
               rank: int, world: int) -> str:  # every rank calls it, rank 0 writes: the learner, every rank's RNG
    rngs, path = gather_objects(rng_state(), world), os.path.join(run_dir, "checkpoint.pt")
    if rank == 0:  # not kept: --stop-after (the printed command runs to the end), --cuda (this machine's default)
        kept = {k: 0 if k == "stop_after" else v for k, v in vars(args).items() if k != "cuda"}
        save_checkpoint(path, dict(script=SCRIPT, env_id=args.env_id, args=kept, model=agent.state_dict(),
                                   optimizer=optimizer.state_dict(), iteration=iteration, global_step=global_step,
                                   kl_coef=kl_penalty.beta if kl_penalty else None, world_size=world, rng=rngs))
    return path


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


def evaluate(agent: Agent, args: Args, device: torch.device, episodes: int, video_dir: str = "",
             stop=lambda: False) -> list[float]:  # whole games' unclipped scores (fewer once stop() says so)
    env = make_envs(args, 1, args.seed + 10_000, **({"render_mode": "rgb_array"} if args.capture_video else {}))
    stats, returns, frames = EpisodeStats(1), [], []
    obs, _ = env.reset()
    while len(returns) < episodes and not stop():
        with torch.inference_mode():
            action = agent.act(obs_tensor(obs, device), args.eval_deterministic)
        obs, _, term, trunc, info = env.step(action.cpu().numpy())
        frames += [env.render()[0]] if args.capture_video else []
        for _, ret, length in stats.update(info["reward"], term, trunc, info["terminated"]):
            returns.append(ret)
            print(f"eval game {len(returns)}/{episodes}: score {ret:.0f}, {length} steps", flush=True)  # games are long
            if args.capture_video:  # video_dir/game-<k>.mp4, in real time (a frame per 4 of the console's 60 a second)
                from moviepy import ImageSequenceClip
                try:
                    os.makedirs(video_dir, exist_ok=True)
                    ImageSequenceClip(frames, fps=15).write_videofile(f"{video_dir}/game-{len(returns)}.mp4",
                                                                      logger=None)
                except OSError as e:
                    raise Failure(f"cannot write the evaluation videos in {video_dir}: {e.strerror or e}", 1) from None
                frames = []
    env.close()
    return returns


def log_evaluation(writer, args: Args, result: dict, signals: StopSignals, path: str, global_step: int) -> None:
    if signals.received:  # (the trained model is on disk)
        result.pop("eval_returns")
        print(f"stopped during the evaluation ({signal.Signals(signals.received[0]).name}); the trained model is in "
              f"{path}; evaluate it with: {launcher(1)} --resume {path} --eval-episodes {args.eval_episodes}")
        return
    returns = result["eval_returns"]
    writer.add_scalar("eval/episodic_return", float(np.mean(returns)), global_step)
    print(f"eval: {len(returns)} games{' (deterministic)' if args.eval_deterministic else ''}, return "
          f"{np.mean(returns):.2f} ± {np.std(returns):.2f}")


def load_policy(path: str, deterministic: bool = False, device: str = "cpu"):
    """`policy = load_policy("runs/<run>/checkpoint.pt")`: `policy(obs)` plays one stacked observation (4, 84, 84)
    uint8 or a batch, from envs made as in training (make_envs) (Failure: not a checkpoint)."""
    ckpt, dev = load_checkpoint(path), torch.device(device)
    agent = Agent(int(ckpt["model"]["actor.weight"].shape[0])).to(dev, memory_format=torch.channels_last
                                                                      if dev.type == "cpu" else None)
    agent.load_state_dict(ckpt["model"])

    @torch.inference_mode()
    def policy(obs):
        x = obs_tensor(obs, dev)
        if x.dtype != torch.uint8 or tuple(x.shape[-3:]) != (4, 84, 84) or x.dim() not in (3, 4):
            raise ValueError(f"observations of shape {tuple(x.shape)} and dtype {x.dtype}: expected envpool's stacked "
                             "frames, (4, 84, 84) uint8, or a batch of them")
        actions = agent.act(x if x.dim() == 4 else x[None], deterministic).cpu().numpy()
        return actions if x.dim() == 4 else actions[0]

    return policy


# --- command line -----------------------------------------------------------------------------------------
def parse_count(text: str) -> int:  # [SHARED] 500000, 5e5, 1e7 or 1_000_000; a number that is not whole is an error
    if not float(text).is_integer():  # (ValueError: tyro says the flag wants an INT)
        raise ValueError(f"{text!r} is not a whole number")
    return int(float(text))


Count = Annotated[int, tyro.constructors.PrimitiveConstructorSpec(  # [SHARED]
    nargs=1, metavar="INT", instance_from_str=lambda a: parse_count(a[0]),
    is_instance=lambda x: isinstance(x, int) and not isinstance(x, bool), str_from_instance=lambda x: [str(x)])]
OnWithCuda = Annotated[Optional[bool], tyro.conf.DisallowNone,  # --flag / --no-flag; unset (None): on with --cuda
                       tyro.conf.arg(help_behavior_hint="(default: on with --cuda)")]


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


def validate(args: Args) -> None:  # bad values, an unknown game, --cuda without a GPU: one line, exit 2
    from envpool.registration import registry

    world, batch = int(os.environ.get("WORLD_SIZE", "1")), args.num_envs * args.num_steps
    ids = sorted(e for e, spec in registry.specs.items() if spec[1] == "AtariEnvSpec")  # envpool's Atari tasks
    close = difflib.get_close_matches(args.env_id, ids, n=5, cutoff=0.5)
    checks = [(not math.isfinite(v), f"--{k.replace('_', '-')} must be a finite number") for k, v in vars(args).items()
              if isinstance(v, float)]  # nan and inf pass the range checks unnoticed
    for wrong, message in checks + [
        (min(args.num_envs, args.num_steps, args.num_minibatches, args.update_epochs, args.max_episode_steps) <= 0,
         "--num-envs, --num-steps, --num-minibatches, --update-epochs and --max-episode-steps must be positive"),
        (min(args.total_timesteps, args.eval_episodes, args.checkpoint_every, args.stop_after, args.torch_threads,
             args.num_threads) < 0, "counts (--total-timesteps, --eval-episodes, ...) must be >= 0"),
        (batch % max(args.num_minibatches, 1), f"num_envs*num_steps = {batch} is not divisible by --num-minibatches "
                                               f"{args.num_minibatches}"),
        (args.overlap_envs and args.num_envs % 2, f"--overlap-envs splits the envs in two: --num-envs {args.num_envs} "
                                                  "is odd"),
        (not (0 <= args.gamma <= 1 and 0 <= args.gae_lambda <= 1), "--gamma and --gae-lambda must lie in [0, 1]"),
        (min(args.learning_rate, args.clip_coef, args.max_grad_norm) <= 0,
         "--learning-rate, --clip-coef and --max-grad-norm must be positive"),
        (min(args.ent_coef, args.vf_coef, args.kl_penalty_coef or 0) < 0,
         "--ent-coef, --vf-coef and --kl-penalty-coef must be >= 0"),
        (min([x for x in (args.target_kl, args.kl_penalty_target) if x is not None], default=1) <= 0,
         "--target-kl and --kl-penalty-target must be positive"),
        (not 0 <= args.seed < 2**31 - args.total_timesteps - world * args.num_envs,
         f"--seed {args.seed}: envpool seeds (seed + global step + env index) must lie in [0, 2**31)"),
        (0 < args.total_timesteps < batch * world,
         f"--total-timesteps {args.total_timesteps} is less than one rollout ({batch} steps x {world} processes)"),
        (args.cudagraphs and not args.cuda, "--cudagraphs needs --cuda (CUDA graphs exist only on a GPU)"),
        (args.cuda and not torch.cuda.is_available(), "--cuda given but torch finds no CUDA device (without the flag "
                                                      "the script uses the GPU if there is one)"),
        (args.cuda and not gpu_for_each_process(), f"--cuda with {os.environ.get('LOCAL_WORLD_SIZE', '1')} processes "
                                                   f"on this machine but {torch.cuda.device_count()} GPU(s)"),
        (args.env_id not in ids, f"unknown envpool Atari task {args.env_id!r}; " + (
            f"did you mean {', '.join(close)}?" if close else f"e.g. {', '.join(ids[:5])}, ... ({len(ids)} in all)"))]:
        if wrong:
            raise Failure(message)
    for flag, on in (("--eval-deterministic", args.eval_deterministic), ("--capture-video", args.capture_video)):
        if on and not args.eval_episodes and int(os.environ.get("RANK", "0")) == 0:
            print(f"note: {flag} applies to the --eval-episodes games; none asked")


def gpu_for_each_process() -> bool:  # --cuda's default: a GPU for each process of this machine (as CleanRL's)
    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


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
