"""PPO for discrete-action gymnasium environments (CartPole-v1 by default), in one file.

    python ppo.py                                  # CartPole-v1, 500k steps, CleanRL's settings
    python ppo.py --env-id Acrobot-v1 --total-timesteps 1e6 --compile
    python ppo.py --resume runs/<run>/checkpoint.pt --eval-episodes 10
    torchrun --nproc-per-node 2 ppo.py             # data parallel: each process steps its own --num-envs envs

Read from the top: Args, environments, Agent, the PPO math, then main(), whose loop is the note's five steps
(docs/reading_guide.md). PPO ends at the banner below main(); the flat helpers under it change nothing it computes.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import math
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
import tyro


@dataclass
class Args:  # Count: an int that also reads 1e7 (defined with the command line, below the banner)
    # The note's hyperparameters
    num_steps: Count = 128  # T: steps per environment in each rollout
    update_epochs: Count = 4  # E: epochs over each rollout
    num_minibatches: Count = 4  # minibatches per epoch (each of M = num_envs * T / num_minibatches samples)
    clip_coef: float = 0.2  # epsilon: clip range of the probability ratio (and of the value clip)
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

    # Environment
    env_id: str = "CartPole-v1"  # id of a gymnasium environment with a discrete action space
    total_timesteps: Count = 500_000  # total environment steps of the run
    num_envs: Count = 4  # number of parallel environments
    vector_mode: Literal["sync", "async"] = "sync"  # gymnasium SyncVectorEnv, or AsyncVectorEnv (a process per env)

    # Run: seeds, devices, logging, checkpoints, evaluation
    exp_name: str = "ppo"  # name of this experiment (part of the run name)
    seed: Count = 1  # seed of the experiment (python, numpy, torch and the environments)
    torch_deterministic: bool = True  # deterministic torch algorithms (warn-only), cuDNN and cuBLAS workspace
    cuda: bool = False  # run the networks on CUDA (these small MLPs train faster on the CPU)
    compile: bool = False  # torch.compile the action sampling and the update step
    cudagraphs: bool = False  # capture the action sampling and the update step each in one CUDA graph
    torch_threads: Count = 1  # torch CPU threads (1 is fastest for small networks)
    track: bool = False  # log to Weights & Biases (WANDB_MODE=offline works without network)
    wandb_project_name: str = "ppo-reference"  # wandb project name
    wandb_entity: Optional[str] = None  # wandb entity (team)
    capture_video: bool = False  # record videos of the evaluation episodes under runs/<run>/videos
    save_model: bool = False  # write runs/<run>/checkpoint.pt at the end (as --eval-episodes and a resumed run do)
    checkpoint_every: Count = 0  # also write the checkpoint every N iterations (0: only at the end)
    resume: Optional[str] = None  # continue this checkpoint.pt (its run directory); flags not given take its values
    stop_after: Count = 0  # stop this process after N iterations with a checkpoint (0: run to the end; not saved)
    eval_episodes: Count = 0  # evaluate N episodes after training (at once for a finished --resume checkpoint)
    eval_deterministic: bool = False  # evaluate with the most likely action instead of a sampled one
    runs_dir: str = "runs"  # directory that holds the runs


# --- Environments -----------------------------------------------------------------------------------------
def make_env(env_id: str, video_dir: Optional[str] = None):  # with video_dir: every episode recorded there
    owner = os.getpid()

    def thunk():
        import gymnasium as gym
        if os.getpid() != owner:  # an async worker: a terminal's Ctrl-C / SIGTERM is the main process's to handle
            signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if video_dir is None:
            return gym.make(env_id)
        return gym.wrappers.RecordVideo(gym.make(env_id, render_mode="rgb_array"), video_dir,
                                        episode_trigger=lambda ep: True, disable_logger=True)
    return thunk


def make_vector_env(args: Args):  # SAME_STEP autoreset: the last obs is in info["final_obs"], no reset transitions
    import gymnasium as gym
    cls = gym.vector.SyncVectorEnv if args.vector_mode == "sync" else gym.vector.AsyncVectorEnv
    return cls([make_env(args.env_id)] * args.num_envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def obs_tensor(obs, device: torch.device) -> torch.Tensor:  # a batch of observations, float32, each one flattened
    x = torch.as_tensor(np.asarray(obs), dtype=torch.float32, device=device)
    return x.reshape(x.shape[0], -1)


def env_state(envs) -> Optional[list]:
    """Each sub-env's plain attributes (numbers, arrays) on every wrapper layer, and its generator: enough for the
    classic-control envs. None for AsyncVectorEnv and envs whose state lives elsewhere (Box2D, an emulator)."""
    if not hasattr(envs, "envs") or not envs.envs[0].unwrapped.__module__.startswith("gymnasium.envs.classic_control"):
        return None
    def numeric(v) -> bool:  # an array of numbers, or a tuple of numbers (MountainCar's state)
        return (isinstance(v, (np.ndarray, np.generic)) and v.dtype.kind in "biuf" or isinstance(v, tuple) and
                all(isinstance(x, (int, float, np.number)) for x in v))

    def plain(d: dict) -> dict:  # numbers and strings; numeric ones as tensors (a weights_only load reads them)
        return {k: torch.from_numpy(np.array(v)) if numeric(v) else v for k, v in d.items()
                if numeric(v) or isinstance(v, (bool, int, float, str, type(None)))}
    return [{"np_random": env.np_random.bit_generator.state, "layers": [plain(vars(e)) for e in wrapper_layers(env)]}
            for env in envs.envs]


def wrapper_layers(env) -> list:  # the wrappers of an env, outermost first, then the env itself
    return [env, *wrapper_layers(env.env)] if hasattr(env, "env") else [env]


def episodes_state(envs, next_obs, next_done, ep_return, ep_length) -> dict:  # the episodes in flight
    return dict(envs=env_state(envs), next_obs=next_obs.cpu(), next_done=next_done.cpu(),
                ep_return=torch.from_numpy(ep_return), ep_length=torch.from_numpy(ep_length))


def restore_episodes(envs, saved: dict, next_obs, next_done, ep_return, ep_length) -> bool:
    """The checkpoint's episodes go on (in place); False where env_state saves none: the envs start new ones."""
    if saved["envs"] is None or env_state(envs) is None:
        return False
    for env, state in zip(envs.envs, saved["envs"], strict=True):
        for layer, plain in zip(wrapper_layers(env), state["layers"], strict=True):
            vars(layer).update({k: v.numpy().copy() if isinstance(v, torch.Tensor) else v for k, v in plain.items()})
        env.np_random.bit_generator.state = state["np_random"]
    next_obs.copy_(saved["next_obs"]), next_done.copy_(saved["next_done"])
    ep_return[:], ep_length[:] = saved["ep_return"].numpy(), saved["ep_length"].numpy()
    return True


# --- Agent: separate actor and critic MLPs (64x64 tanh), orthogonal init ----------------------------------
def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)  # detail: orthogonal init with scaled gains
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)),
                                    nn.Tanh(), layer_init(nn.Linear(64, 1), std=1.0))
        self.actor = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)),
                                   nn.Tanh(), layer_init(nn.Linear(64, n_actions), std=0.01))  # detail: gain 0.01

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def get_action_and_value(self, x: torch.Tensor, action: Optional[torch.Tensor] = None):
        return self(x, action)[:4]  # action, log pi(a|s), entropy, V(s)

    def forward(self, x: torch.Tensor, action: Optional[torch.Tensor] = None):
        """get_action_and_value, plus log pi(.|s) of every action (the KL-penalty variant's exact KL)."""
        logits = self.actor(x)
        logp_all = torch.log_softmax(logits, dim=-1)
        if action is None:  # Gumbel-max sampling: one draw from Categorical(logits), cheap and compilable
            u = torch.rand_like(logits).clamp_(min=1e-20)
            action = torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)
        logprob = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return action, logprob, entropy, self.get_value(x), logp_all

    def act(self, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        return self.actor(x).argmax(-1) if deterministic else self.get_action_and_value(x)[0]


# --- The PPO math: pure functions (the tests check each against a plain loop) -----------------------------
def compute_gae(rewards, values, dones, next_value, next_done, gamma: float, lam: float):
    """GAE by the note's backward recursion. (T, N) inputs; dones[t] = 1 if obs[t] starts a new episode; a truncated
    episode already carries gamma * V(final_obs) in its last reward. Returns advantages and R_t = A_t + V(s_t)."""
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


def bootstrap_truncated(reward: np.ndarray, terminations, truncations, infos, agent: Agent, gamma: float,
                        device: torch.device) -> None:
    """Truncation is not termination: a time-limit step's reward gets + gamma * V(final obs), in place."""
    idx = np.nonzero(np.logical_and(truncations, np.logical_not(terminations)))[0]
    if len(idx):
        with torch.inference_mode():
            final_value = agent.get_value(obs_tensor(np.stack(infos["final_obs"][idx]), device))
        reward[idx] += gamma * final_value.cpu().numpy()


def normalize_advantages(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / (std + eps), with the unbiased std as in CleanRL and the OpenAI baselines."""
    return (adv - adv.mean()) / (adv.std() + eps)


def normalize_advantages_rollout(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The note's form, over the whole rollout: (A - mean) / sqrt(population variance + eps)."""
    return (adv - adv.mean()) / torch.sqrt(adv.var(unbiased=False) + eps)


def ppo_loss(newlogprob, oldlogprob, advantages, newvalue, oldvalue, returns, entropy, clip_coef: float,
             clip_vloss: bool, ent_coef: float, vf_coef: float, norm_adv: bool, kl_coef=None, kl=None):
    """Clipped policy loss + c_v * value loss - c_H * entropy, and statistics (tensors, no host sync). With kl_coef,
    the KL-penalty policy loss -r*A + kl_coef * kl instead (kl: categorical_kl of each sample's state)."""
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
    """Exact KL(pi_old(.|s) || pi(.|s)) of each state: sum over actions of p_old * (log p_old - log p)."""
    return (old_logp.exp() * (old_logp - new_logp)).sum(-1)


def adapt_kl_coef(coef: float, kl: float, target: float) -> float:
    """The PPO paper's rule: halve below target/1.5, double above 1.5*target; within [1e-6, 1e6]."""
    coef = coef / 2 if kl < target / 1.5 else coef * 2 if kl > target * 1.5 else coef
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
    def rollout_kl(self, actor: nn.Module, b_obs, b_old_logp_all, minibatch_size: int) -> torch.Tensor:
        """KL(pi_old || pi_theta) averaged over the rollout's states after the update: the d of the rule."""
        return sum(categorical_kl(old, torch.log_softmax(actor(obs), -1)).sum() for obs, old in
                   zip(b_obs.split(minibatch_size), b_old_logp_all.split(minibatch_size))) / len(b_obs)

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
    run_dir = make_run_dir(args, rank, world)
    ckpt_path = os.path.abspath(args.resume) if args.resume else None  # the last checkpoint written
    batch_size = args.num_envs * args.num_steps  # per process; under torchrun the global batch is world times it
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // (batch_size * world)

    # Seeding (each rank its own stream)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    set_torch_determinism(args.torch_deterministic)
    torch.set_num_threads(args.torch_threads)

    # Environments, reset with a seed per env (after a resume that cannot restore its episodes: new seeds)
    envs = make_vector_env(args)
    obs_dim, n_actions = int(np.prod(envs.single_observation_space.shape)), int(envs.single_action_space.n)
    seed = args.seed + rank * args.num_envs + (ckpt["global_step"] if ckpt else 0)
    next_obs, _ = envs.reset(seed=[seed + i for i in range(args.num_envs)])
    next_obs, next_done = obs_tensor(next_obs, device), torch.zeros(args.num_envs, device=device)
    ep_return, ep_length = np.zeros(args.num_envs), np.zeros(args.num_envs, dtype=np.int64)  # episodes in flight

    agent = Agent(obs_dim, n_actions).to(device)
    # lr in a tensor, so that annealing it recompiles nothing; capturable on CUDA: the step stays in the CUDA graph
    optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(args.learning_rate, device=device), eps=1e-5,
                                 fused=True, capturable=args.cuda)
    kl_penalty = KLPenalty(args, device) if (args.kl_penalty_coef, args.kl_penalty_target) != (None, None) else None
    first_iteration, global_step = 1, 0
    if ckpt is not None:  # exact resume: networks, Adam, this rank's RNG, the KL coefficient, the episodes in flight
        with checkpoint_fits(args.resume):
            check_resume(ckpt, args, world)
            agent.load_state_dict(ckpt["model"])
            load_optimizer_state(optimizer, ckpt["optimizer"], device)
            set_rng_state(ckpt["rng"][rank], device)
            if kl_penalty and args.kl_penalty_target is not None and ckpt["kl_coef"] is not None:
                kl_penalty.set(ckpt["kl_coef"])  # the adapted coefficient goes on
            restored = restore_episodes(envs, ckpt["episodes"][rank], next_obs, next_done, ep_return, ep_length)
            first_iteration, global_step = ckpt["iteration"] + 1, ckpt["global_step"]
        if rank == 0:
            print(f"resumed {args.resume} at iteration {ckpt['iteration']}, global step {global_step}"
                  + ("" if restored else " (the environments start new episodes)"))
    writer = open_logs(args, run_dir, rank, resumed=ckpt is not None)  # TensorBoard; wandb with --track
    train_agent = agent  # the update calls it: under torchrun DDP averages the gradients (each rank its own envs)
    if world > 1:
        train_agent = torch.nn.parallel.DistributedDataParallel(agent, device_ids=[device.index] if args.cuda else None)
    norm_per_minibatch = args.norm_adv and args.norm_adv_scope == "minibatch"

    def policy(obs):  # the rollout's action sampling
        action, logprob, _, value, logp_all = agent(obs)
        return action, logprob, value, logp_all

    def update(mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values, mb_old_logp_all):
        optimizer.zero_grad(set_to_none=False)  # one gradient step on one minibatch
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
    logprobs, rewards, dones, values = (torch.zeros((args.num_steps, args.num_envs), device=device) for _ in range(4))
    old_logp_all = torch.zeros((args.num_steps, args.num_envs, n_actions), device=device)
    recent_returns, stats, eval_returns, clock = [], {}, None, dict(start=time.time(), steps=global_step, printed=0)
    final_save = args.save_model or args.checkpoint_every or args.stop_after or args.eval_episodes or args.resume

    with StopSignals() as signals:  # SIGTERM / Ctrl-C are honoured at the end of an iteration
        for iteration in range(first_iteration, num_iterations + 1):
            frac = 1.0 - (iteration - 1.0) / num_iterations if args.anneal_lr else 1.0  # detail: lr annealed to 0
            lr_now = frac * args.learning_rate
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
                ep_return, ep_length = ep_return + reward, ep_length + 1
                log_episodes(writer, recent_returns, ep_return, ep_length, done, global_step)  # then zeroes them
                bootstrap_truncated(reward, terminations, truncations, infos, agent, args.gamma, device)
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
                    mb_stats = update(b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb], b_returns[mb],
                                      b_values[mb], b_old_logp_all[mb])
                    update_stats.append({k: v.clone() for k, v in mb_stats.items()})  # a CUDA graph reuses outputs
                if args.target_kl is not None and all_ranks_mean(mb_stats["approx_kl"], world) > args.target_kl:
                    break  # detail: early stop of the epochs

            # 5. Update reference policy: theta_old <- theta, implicitly (the next rollout samples from theta). The
            # KL-penalty variant measures KL(pi_old || pi_theta) over the rollout and adapts its coefficient to it.
            kl = kl_penalty.rollout_kl(agent.actor, b_obs, b_old_logp_all, minibatch_size) if kl_penalty else None
            stats = iteration_stats(update_stats, world, signals, kl)  # the one host sync: all ranks' means, signals
            check_finite(stats, iteration, ckpt_path)
            stats["explained_variance"] = explained_variance(b_values.cpu().numpy(), b_returns.cpu().numpy())
            log_iteration(writer, args, stats, lr_now, kl_penalty, iteration, num_iterations, global_step,
                          recent_returns, clock, rank, world)
            if kl_penalty:
                kl_penalty.adapt(stats["kl"])  # the coefficient of the next update
            stop = stats["signals"] > 0 or 0 < args.stop_after <= iteration - first_iteration + 1
            if stop or (args.checkpoint_every and iteration % args.checkpoint_every == 0) or (
                    iteration == num_iterations and final_save):
                ckpt_path = save_state(run_dir, args, agent, optimizer, kl_penalty, iteration, global_step,
                                       episodes_state(envs, next_obs, next_done, ep_return, ep_length), rank, world)
            if stop and iteration < num_iterations:
                if rank == 0:
                    why = signal.Signals(signals.received[0]).name if signals.received else (
                        "a signal to another rank" if stats["signals"] > 0 else f"--stop-after {args.stop_after}")
                    print(f"stopped at iteration {iteration} ({why}); continue with: {launcher(world)} --resume "
                          f"{ckpt_path}", flush=True)
                break
        else:  # the trained model is on disk before the evaluation starts; a signal stops the evaluation cleanly
            if args.eval_episodes and rank == 0:
                eval_returns = evaluate(agent, args, device, args.eval_episodes, os.path.join(run_dir, "videos"),
                                        stop=lambda: bool(signals.received))
                eval_returns = log_evaluation(writer, args, eval_returns, global_step, signals.received, ckpt_path)
    close_run([envs], writer, args, world)
    return {"global_step": global_step, "run_dir": run_dir, "stats": stats, "returns": recent_returns,
            **({"eval_returns": eval_returns} if eval_returns is not None else {})}


# =========================================================================================================
# Plumbing: nothing below this line changes what PPO computes (torchrun, the run directory, logging, checkpoints,
# evaluation and load_policy, compile helpers, the command line and its one error boundary).
SCRIPT = "ppo.py"


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


def log_episodes(writer, recent: list, ep_return: np.ndarray, ep_length: np.ndarray, done: np.ndarray, step: int):
    for i in np.nonzero(done)[0]:  # the episodes that ended in this step: logged, then their counters zeroed
        recent.append(float(ep_return[i]))
        if writer is not None:
            writer.add_scalar("charts/episodic_return", ep_return[i], step)
            writer.add_scalar("charts/episodic_length", ep_length[i], step)
    ep_return[done], ep_length[done] = 0.0, 0


def iteration_stats(update_stats: list[dict], world: int, signals: StopSignals, kl=None) -> dict:
    # The one host sync: the update's statistics (and the rollout's KL), means over minibatches and ranks; signals
    stats = {k: torch.stack([s[k] for s in update_stats]).mean() for k in update_stats[0]} | (
        {} if kl is None else {"kl": kl})
    stats["signals"] = torch.full_like(stats["approx_kl"], float(bool(signals.received)))
    stats = dict(zip(stats, all_ranks_mean(torch.stack([v.float() for v in stats.values()]), world).tolist()))
    return {**stats, "signals": round(stats["signals"] * world)}


def log_iteration(writer, args: Args, stats: dict, lr: float, kl_penalty, iteration: int, num_iterations: int,
                  global_step: int, recent: list, clock: dict, rank: int, world: int) -> None:
    # TensorBoard's scalars of the iteration (kl_coef: the one this update used); the progress line every 5 s
    now = time.time()
    rate = (global_step - clock["steps"]) / max(now - clock["start"], 1e-9)  # steps/s, all processes
    scalars = {"charts/learning_rate": lr, "charts/SPS": int(rate), **{f"losses/{k}": v for k, v in stats.items()
               if k not in ("signals", "grad_norm")}, **({"charts/kl_coef": kl_penalty.beta} if kl_penalty else {})}
    for tag, value in scalars.items() if writer is not None else ():
        writer.add_scalar(tag, value, global_step)
    if rank == 0 and (now - clock["printed"] >= 5.0 or iteration == num_iterations):
        left = (num_iterations - iteration) * args.num_envs * args.num_steps * world
        clock["printed"], eta = now, left / rate if rate > 0 else math.inf
        kl = f"  kl={stats['kl']:.4f} kl_coef={kl_penalty.beta:.3g}" if kl_penalty else ""
        print(f"iter {iteration}/{num_iterations}  global_step={global_step}  SPS={int(rate)}  return(last 20)="
              f"{np.mean(recent[-20:]) if recent else float('nan'):.1f}  approx_kl={stats['approx_kl']:.4f}{kl}  "
              f"eta={eta_text(eta)}", flush=True)


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


def save_state(run_dir: str, args: Args, agent: Agent, optimizer, kl_penalty, iteration: int, global_step: int,
               episodes: dict, rank: int, world: int) -> str:  # every rank's RNG and episodes; rank 0 writes
    rng, eps, path = gather_objects(rng_state(), world), gather_objects(episodes, world), f"{run_dir}/checkpoint.pt"
    if rank == 0:
        save_checkpoint(path, dict(
            script=SCRIPT, env_id=args.env_id, args={**dataclasses.asdict(args), "stop_after": 0},
            model=agent.state_dict(), optimizer=optimizer.state_dict(), iteration=iteration, global_step=global_step,
            kl_coef=kl_penalty.beta if kl_penalty else None, world_size=world, rng=rng, episodes=eps))
    return path


def check_resume(ckpt: dict, args: Args, world: int) -> None:  # its env, processes and rollout size are this run's
    if ckpt["world_size"] != world:
        raise Failure(f"{args.resume} was written by {ckpt['world_size']} process(es); resume it with as many: "
                      f"{launcher(ckpt['world_size'])} --resume {args.resume}")
    for name in ("env_id", "num_envs", "num_steps"):  # (the iteration count and lr schedule hold for that rollout)
        if ckpt["args"][name] != getattr(args, name):
            raise Failure(f"{args.resume} was written with --{name.replace('_', '-')} {ckpt['args'][name]}, which "
                          "cannot change on --resume")


def evaluate(agent: Agent, args: Args, device: torch.device, episodes: int, video_dir: str = "",
             stop=lambda: False) -> list[float]:  # the returns of `episodes` episodes (fewer once stop() says so)
    env, returns, ep_ret = make_env(args.env_id, video_dir if args.capture_video else None)(), [], 0.0
    obs, _ = env.reset(seed=args.seed + 10_000)
    with torch.inference_mode():
        while len(returns) < episodes and not stop():
            obs, r, term, trunc, _ = env.step(int(agent.act(obs_tensor(obs[None], device), args.eval_deterministic)))
            ep_ret += float(r)
            if term or trunc:
                returns, ep_ret = returns + [ep_ret], 0.0
                obs, _ = env.reset() if len(returns) < episodes else (obs, None)
    env.close()
    return returns


def log_evaluation(writer, args: Args, returns: list, global_step: int, signals: list, ckpt_path: str):
    if signals:  # the evaluation's returns, or None after a stop signal, which the line says
        return print(f"stopped during the evaluation ({signal.Signals(signals[0]).name}); the trained model is in "
                     f"{ckpt_path}", flush=True)
    writer.add_scalar("eval/episodic_return", np.mean(returns), global_step)
    print(f"eval: {len(returns)} episodes{' (deterministic)' * args.eval_deterministic}, return "
          f"{np.mean(returns):.2f} ± {np.std(returns):.2f}")
    return returns


def load_policy(path: str, deterministic: bool = False, device: str = "cpu"):
    """`policy = load_policy("runs/<run>/checkpoint.pt")`: `policy(obs)` is the trained agent's action for one
    observation of the checkpoint's env, or one per row of a batch (Failure: not a checkpoint)."""
    ckpt = load_checkpoint(path)
    with make_env(ckpt["env_id"])() as probe:
        shape, n_actions = probe.observation_space.shape, int(probe.action_space.n)
    agent = Agent(int(np.prod(shape)), n_actions).to(device)
    agent.load_state_dict(ckpt["model"])

    @torch.inference_mode()
    def policy(obs):
        obs = np.asarray(obs)
        if obs.shape != shape and obs.shape[1:] != shape:
            raise ValueError(f"an observation of shape {obs.shape}: expected {shape} or a batch of them")
        actions = agent.act(obs_tensor(obs if obs.shape != shape else obs[None], device), deterministic).cpu().numpy()
        return actions if obs.shape != shape else actions[0]
    return policy


def validate(args: Args) -> None:  # bad input: one line, exit 2, before anything is written
    import gymnasium as gym

    batch, world = args.num_envs * args.num_steps, int(os.environ.get("WORLD_SIZE", "1"))
    flags = {f"--{k.replace('_', '-')}": v for k, v in vars(args).items() if v is not None}
    checks = [(not low <= flags[k] < math.inf, f"{k} must be >= {low}, got {flags[k]}") for low, names in (
        (1, "--num-envs --num-steps --num-minibatches --update-epochs --torch-threads"),
        (0, "--total-timesteps --eval-episodes --checkpoint-every --stop-after --seed --ent-coef --vf-coef "
            "--kl-penalty-coef")) for k in names.split() if k in flags]
    checks += [(not 0 < flags[k] < math.inf, f"{k} must be positive, got {flags[k]}") for k in ("--learning-rate",
               "--clip-coef", "--max-grad-norm", "--target-kl", "--kl-penalty-target") if k in flags]  # (nor nan, inf)
    for bad, message in checks + [
        (0 < args.total_timesteps < batch * world, f"--total-timesteps {args.total_timesteps} is less than one rollout "
                                                   f"of every process ({world} x num_envs*num_steps = {batch})"),
        (batch % max(args.num_minibatches, 1), f"num_envs*num_steps = {batch} is not divisible by --num-minibatches"),
        (args.norm_adv and args.norm_adv_scope == "minibatch" and batch < 2 * args.num_minibatches,
         "--norm-adv needs minibatches of at least 2 samples (their std)"),
        (args.seed >= 2**31, f"--seed must be < 2**31, got {args.seed}"),
        (not (0 <= args.gamma <= 1 and 0 <= args.gae_lambda <= 1), "--gamma and --gae-lambda must lie in [0, 1]"),
        (args.cuda and not torch.cuda.is_available(), "--cuda given (or taken from the checkpoint: --no-cuda resumes "
                                                      "on the CPU) but torch finds no CUDA device"),
        (args.cuda and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
         "--cuda with fewer GPUs than processes on this machine"),
        (args.cudagraphs and not args.cuda, "--cudagraphs needs --cuda (CUDA graphs exist only on a GPU)")]:
        if bad:
            raise Failure(message)
    try:
        probe = gym.make(args.env_id)
    except Exception as e:  # an unknown id, a missing optional dependency of the env
        raise Failure(f"unknown or unusable env id {args.env_id!r}: {type(e).__name__}: {first_line(e)}") from None
    if not (isinstance(probe.action_space, gym.spaces.Discrete) and probe.action_space.start == 0
            and isinstance(probe.observation_space, gym.spaces.Box)):
        raise Failure(f"{args.env_id} has the spaces {probe.observation_space} and {probe.action_space}; ppo.py needs "
                      "Discrete actions from 0 and Box observations (ppo_continuous.py takes continuous actions)")


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
