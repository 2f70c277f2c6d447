"""PPO for discrete-action gymnasium environments (CartPole-v1 by default).

    python ppo.py                                  # CartPole-v1, 500k steps, CleanRL settings
    python ppo.py --env-id Acrobot-v1 --total-timesteps 1e6 --compile
    python ppo.py --resume runs/<run>/checkpoint.pt --eval-episodes 10
    torchrun --nproc-per-node 2 ppo.py             # data parallel: each process steps its own --num-envs envs

The loop follows the note (shared/seeds/ppo_note.md) step by step; each step is a section comment below:
Collect rollout -> Compute advantages and returns (GAE) -> Advantage normalisation ->
Optimise policy & value for E epochs (clipped policy loss + value loss + entropy bonus) -> Update reference policy.
The note's adaptive-KL-penalty variant replaces the clipped loss with --kl-penalty-coef / --kl-penalty-target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
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


def die(msg: str) -> None:
    """Bad input: one line on stderr, exit code 2, no traceback."""
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


@dataclass
class Args:
    # Experiment
    exp_name: str = "ppo"
    """name of this experiment (part of the run name)"""
    seed: Count = 1
    """seed of the experiment (python, numpy, torch and the environments)"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms"""
    cuda: bool = False
    """run the networks on CUDA (tiny MLPs are usually faster on CPU)"""
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
    """continue from this checkpoint.pt: same run directory, step count and lr schedule; flags not given on the
    command line take the checkpoint's values"""
    stop_after: Count = 0
    """stop this process after N iterations with a checkpoint (0: run to the end); --resume continues"""
    eval_episodes: Count = 0
    """after training (or right away for a finished --resume checkpoint) evaluate N episodes"""
    eval_deterministic: bool = False
    """evaluate with the most likely action (argmax of the logits) instead of a sampled one"""
    runs_dir: str = "runs"
    """directory that holds the runs"""

    # Algorithm
    env_id: str = "CartPole-v1"
    """id of a gymnasium environment with a discrete action space"""
    total_timesteps: Count = 500_000
    """total environment steps of the run"""
    learning_rate: float = 2.5e-4
    """Adam learning rate"""
    num_envs: Count = 4
    """number of parallel environments"""
    vector_mode: Literal["sync", "async"] = "sync"
    """gymnasium SyncVectorEnv (one process) or AsyncVectorEnv (one process per env)"""
    num_steps: Count = 128
    """steps per environment per rollout (T)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalized advantage estimation"""
    num_minibatches: Count = 4
    """number of minibatches per epoch"""
    update_epochs: Count = 4
    """epochs E over each rollout"""
    norm_adv: bool = True
    """standardise the advantages (where: --norm-adv-scope)"""
    norm_adv_scope: Literal["minibatch", "rollout"] = "minibatch"
    """minibatch: in each minibatch, (A-mean)/(std+eps) (CleanRL); rollout: once, (A-mean)/sqrt(var+eps) (the note)"""
    clip_coef: float = 0.2
    """clip range epsilon of the policy ratio"""
    clip_vloss: bool = True
    """clip the value loss as in the original PPO code"""
    ent_coef: float = 0.01
    """entropy bonus coefficient c_H"""
    vf_coef: float = 0.5
    """value loss coefficient c_v"""
    max_grad_norm: float = 0.5
    """global gradient norm clip"""
    target_kl: Optional[float] = None
    """stop the epochs of an update early once approx_kl exceeds this"""
    kl_penalty_coef: Optional[float] = None
    """KL-penalty variant (PPO paper, sec. 4): policy loss -r*A + coef*KL(pi_old||pi), no ratio clip; None: clip"""
    kl_penalty_target: Optional[float] = None
    """adaptive KL penalty: the coef (default 1) halves after an update with KL < target/1.5, doubles if > 1.5*target"""


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
        saved = load_checkpoint(resume)["args"]
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
    if args.cudagraphs and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        die("--cudagraphs is not supported under torchrun (DDP's gradient all-reduce runs outside the graph)")
    if args.cuda and not torch.cuda.is_available():
        die("--cuda given (or taken from the checkpoint: --no-cuda resumes on the CPU) but torch finds no CUDA "
            "device")
    if args.resume is not None and not os.path.isfile(args.resume):
        die(f"--resume: no such file {args.resume}")


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


def make_vector_env(args: Args):
    """Vector env in SAME_STEP autoreset mode: a finished episode is reset inside the same step() call and its last
    observation comes back in info["final_obs"], so every stored transition is a real one (no reset transitions)."""
    import gymnasium as gym

    fns = [make_env(args.env_id, i) for i in range(args.num_envs)]
    cls = gym.vector.SyncVectorEnv if args.vector_mode == "sync" else gym.vector.AsyncVectorEnv
    if args.vector_mode == "async":
        fns = [leave_signals_to_main(fn) for fn in fns]
    return cls(fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def leave_signals_to_main(make):
    """An async worker ignores SIGINT and SIGTERM: a Ctrl-C reaches the whole process group, and a worker that died
    of it would break the main process's last step and close instead of its checkpoint and clean exit."""
    def thunk():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return make()

    return thunk


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
# Pure functions (imported by the tests)
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


def categorical_kl(old_logp: torch.Tensor, new_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_old(.|s) || pi(.|s)) of each state, exact: the sum over actions of p_old * (log p_old - log p).
    (..., A) -> (...)."""
    return (old_logp.exp() * (old_logp - new_logp)).sum(-1)


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


def adapt_kl_coef(coef: float, kl: float, target: float) -> float:
    """The PPO paper's rule for the KL-penalty variant: halve the coefficient when the update moved the policy by
    less than target/1.5, double it above 1.5*target; kept within [1e-6, 1e6] so that it can always come back."""
    if kl < target / 1.5:
        coef /= 2
    elif kl > target * 1.5:
        coef *= 2
    return min(max(coef, 1e-6), 1e6)


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
# Checkpoints
# ---------------------------------------------------------------------------------------------------------
SCRIPT = "ppo.py"


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
                setattr(env, k, v.numpy() if isinstance(v, torch.Tensor) else v)
            env = getattr(env, "env", env)
        env.np_random.bit_generator.state = saved["np_random"]


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, device: torch.device) -> None:
    """optimizer.load_state_dict, keeping this run's settings: torch restores the saved ones (capturable, fused,
    foreach, and lr as a tensor on the CPU after map_location), so a checkpoint of a CUDA-graph run would not
    resume on the CPU, nor a CPU one stay free of host syncs on CUDA. Adam's step counters go where this run's
    settings want them."""
    own = [{k: g[k] for k in ("capturable", "fused", "foreach", "differentiable") if k in g}
           for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for g, settings in zip(optimizer.param_groups, own):
        g.update(settings)
        g["lr"] = torch.tensor(float(g["lr"]), device=device)
        for p in g["params"]:
            st = optimizer.state.get(p, {})
            if torch.is_tensor(st.get("step")):
                on_param = g.get("capturable") or g.get("fused")
                st["step"] = st["step"].to(p.device if on_param else torch.device("cpu"), torch.float32)


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
    """Atomic write (temporary file, then rename): a kill during the save keeps the previous checkpoint.
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
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, env_id: Optional[str] = None) -> dict:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        die(f"cannot read checkpoint {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if not isinstance(ckpt, dict) or ckpt.get("script") != SCRIPT:
        die(f"{path} is not a {SCRIPT} checkpoint (script={ckpt.get('script') if isinstance(ckpt, dict) else None})")
    if env_id is not None and ckpt["env_id"] != env_id:
        die(f"{path} was trained on {ckpt['env_id']}, not {env_id} (pass --env-id {ckpt['env_id']})")
    return ckpt


# ---------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------
def evaluate(agent: Agent, args: Args, device: torch.device, episodes: int, video_dir: str = "",
             rank: int = 0) -> list[float]:
    """Run `episodes` full episodes with actions sampled from the policy (or its most likely ones with
    --eval-deterministic); return their undiscounted returns.
    Under torchrun each rank plays with its own seed, and rank 0 alone records videos."""
    env = make_env(args.env_id, 0, args.capture_video and rank == 0, video_dir)()
    returns = []
    obs, _ = env.reset(seed=args.seed + 10_000 + rank)
    ep_ret = 0.0
    while len(returns) < episodes:
        with torch.inference_mode():
            x = torch.as_tensor(obs, dtype=torch.float32, device=device).reshape(1, -1)  # flat, as in training
            action = agent.act(x, args.eval_deterministic)
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
        x = torch.as_tensor(np.asarray(obs), dtype=torch.float32, device=device)
        if tuple(x.shape) in (shape, (obs_dim,)):
            batch = False
        elif tuple(x.shape[1:]) in (shape, (obs_dim,)):
            batch = True
        else:
            raise ValueError(f"an observation of shape {tuple(x.shape)}: expected {shape} or a batch of them")
        actions = agent.act(x.reshape(-1, obs_dim), deterministic).cpu().numpy()  # flat, as in training
        return actions if batch else actions[0]

    return policy


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
        if local_rank >= torch.cuda.device_count():
            die(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible)")
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


class Silent:
    """Stands in for the tensorboard writer on ranks other than 0: only rank 0 logs."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def gather_objects(obj, world: int) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------
def cudagraph_skips() -> int:
    """How many compiled graphs torch decided to run without CUDA graphs (dynamo's and inductor's count; a graph that
    mutates an input whose address is not fixed is one), so that --cudagraphs never falls back silently."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def main(args: Args) -> dict:
    rank, world, device = setup_distributed(args)
    batch_size = args.num_envs * args.num_steps  # per rank; the global batch is world * batch_size
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // (batch_size * world)

    ckpt = load_checkpoint(args.resume, args.env_id) if args.resume else None
    if ckpt is not None and ckpt.get("world_size", 1) != world:  # iterations, seeds and envs are per process
        n = ckpt.get("world_size", 1)
        die(f"{args.resume} was written by {n} process(es); resume it with as many: "
            f"{'python' if n == 1 else f'torchrun --nproc-per-node {n}'} {SCRIPT} --resume {args.resume}")
    if ckpt is not None and (ckpt["args"]["num_envs"], ckpt["args"]["num_steps"]) != (args.num_envs, args.num_steps):
        die(f"{args.resume} was written with --num-envs {ckpt['args']['num_envs']} --num-steps "
            f"{ckpt['args']['num_steps']}; its iteration count and learning-rate schedule hold for that rollout: "
            "resume with the same")
    check_env(args)
    if ckpt is not None:
        run_dir = os.path.dirname(os.path.abspath(args.resume))
        run_name = os.path.basename(run_dir)
    else:
        run_name = gather_objects(f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}", world)[0]
        run_dir = os.path.join(args.runs_dir, run_name)
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        die(f"cannot create run directory {run_dir}: {e.strerror}")
    if not os.access(run_dir, os.W_OK):
        die(f"run directory {run_dir} is not writable")

    # Seeding
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.torch_threads)

    envs = make_vector_env(args)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    n_actions = int(envs.single_action_space.n)
    agent = Agent(obs_dim, n_actions).to(device)
    # lr lives in a tensor so that annealing does not recompile the compiled/captured optimizer step
    optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(args.learning_rate, device=device), eps=1e-5,
                                 fused=True)  # fused: one kernel per step, works with tensor lr and CUDA graphs
    start_iteration, global_step = 1, 0
    # KL-penalty variant: beta on the host (the adaptive rule) and in a tensor that the (compiled) update reads
    penalty = args.kl_penalty_coef is not None or args.kl_penalty_target is not None
    beta = 1.0 if args.kl_penalty_coef is None else args.kl_penalty_coef
    if ckpt is not None and args.kl_penalty_target is not None and ckpt.get("kl_coef") is not None:
        beta = ckpt["kl_coef"]  # the adapted value goes on
    kl_coef = torch.tensor(beta, device=device)
    if ckpt is not None:
        try:
            agent.load_state_dict(ckpt["model"])
            load_optimizer_state(optimizer, ckpt["optimizer"], device)
        except (RuntimeError, ValueError, KeyError) as e:
            die(f"checkpoint {args.resume} does not fit this network: {str(e).splitlines()[0]}")
        start_iteration, global_step = ckpt["iteration"] + 1, ckpt["global_step"]
        if rank > 0:  # this rank's RNG and envs
            ckpt = ckpt["other_ranks"][rank - 1]
        set_rng_state(ckpt["rng"], device)
        if rank == 0:
            print(f"resumed {args.resume} at iteration {start_iteration - 1}, global step {global_step}")
            saved_total = ckpt["args"].get("total_timesteps", args.total_timesteps)
            if args.anneal_lr and saved_total != args.total_timesteps:  # not silent: the lr jumps
                print(f"note: --total-timesteps {args.total_timesteps} differs from the checkpoint's {saved_total}: "
                      "the learning rate now anneals to 0 at the new total")
            if args.kl_penalty_target is not None and ckpt.get("kl_coef") is not None:
                print(f"note: the adaptive KL-penalty coefficient goes on from the checkpoint's {beta:.3g} "
                      "(--kl-penalty-coef sets the start of a new run only)")
    for p in agent.parameters():  # gradients allocated here, outside any CUDA graph's memory pool; the update
        p.grad = torch.zeros_like(p)  # zeroes them in place (zero_grad(set_to_none=False))
        if args.cudagraphs:  # a fixed address, so that the graph of clip + optimizer step may update them in place
            torch._dynamo.mark_static_address(p.grad)
    train_agent = agent  # what the update calls: the agent itself, or DDP around it under torchrun
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        train_agent = DistributedDataParallel(agent, device_ids=[device.index] if args.cuda else None)

    from torch.utils.tensorboard import SummaryWriter

    if args.track and rank == 0:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, dir=run_dir, resume="allow", id=run_name)
    writer = SummaryWriter(run_dir) if rank == 0 else Silent()  # rank 0 alone logs
    if ckpt is None:
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" +
                        "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))

    # The two hot functions: action sampling during the rollout and one minibatch update.
    norm_per_minibatch = args.norm_adv and args.norm_adv_scope == "minibatch"
    def policy(obs):
        action, logprob, _, value, logp_all = agent(obs)
        return action, logprob, value, logp_all

    def update(mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values, mb_old_logp_all=None):
        optimizer.zero_grad(set_to_none=False)
        _, newlogprob, entropy, newvalue, logp_all = train_agent(mb_obs, mb_actions)
        loss, stats = ppo_loss(newlogprob, mb_logprobs, mb_advantages, newvalue, mb_values, mb_returns, entropy,
                               args.clip_coef, args.clip_vloss, args.ent_coef, args.vf_coef, norm_per_minibatch,
                               kl_coef if penalty else None,
                               categorical_kl(mb_old_logp_all, logp_all) if penalty else None)
        loss.backward()
        stats["grad_norm"] = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return stats

    if args.compile:
        if args.torch_deterministic:  # compiled code draws the same random numbers as eager code
            import torch._inductor.config as inductor_config

            inductor_config.fallback_random = True
        policy = torch.compile(policy, mode="reduce-overhead" if args.cudagraphs else None)
        update = torch.compile(update, mode="reduce-overhead" if args.cudagraphs else None)
    elif args.cudagraphs:  # CUDA graphs without inductor: dynamo's cudagraphs backend records and replays
        policy = torch.compile(policy, backend="cudagraphs")
        update = torch.compile(update, backend="cudagraphs")

    # Rollout storage (T, N, ...)
    obs = torch.zeros((args.num_steps, args.num_envs, obs_dim), device=device)
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long, device=device)
    logprobs = torch.zeros((args.num_steps, args.num_envs), device=device)
    rewards = torch.zeros((args.num_steps, args.num_envs), device=device)
    dones = torch.zeros((args.num_steps, args.num_envs), device=device)
    values = torch.zeros((args.num_steps, args.num_envs), device=device)
    # the KL-penalty variant's exact KL needs log pi_old(.|s) of every action in every state
    old_logp_all = torch.zeros((args.num_steps, args.num_envs, n_actions), device=device) if penalty else None

    next_obs_np, _ = envs.reset(seed=[args.seed + global_step + rank * args.num_envs + i
                                      for i in range(args.num_envs)])
    next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32, device=device).reshape(args.num_envs, -1)
    next_done = torch.zeros(args.num_envs, device=device)
    ep_return = np.zeros(args.num_envs)
    ep_length = np.zeros(args.num_envs, dtype=np.int64)
    saved = ckpt.get("rollout") if ckpt is not None else None
    if saved is not None and saved["envs"] is not None and args.vector_mode == "sync":
        # exact resume: the episodes in flight continue where they stopped
        load_env_state(envs, saved["envs"])
        next_obs, next_done = saved["next_obs"].to(device), saved["next_done"].to(device)
        ep_return, ep_length = saved["ep_return"].numpy().copy(), saved["ep_length"].numpy().copy()
    elif ckpt is not None and rank == 0:
        print("note: environments start new episodes (exact resume needs --vector-mode sync, then and now, and an "
              "env whose whole state the script saves)")

    def checkpoint(path: str, iteration: int) -> None:
        """Called by every rank at the same iteration; rank 0 writes the states of all ranks."""
        rollout = dict(envs=env_state(envs), next_obs=next_obs.cpu(), next_done=next_done.cpu(),
                       ep_return=torch.from_numpy(ep_return), ep_length=torch.from_numpy(ep_length))
        ranks = gather_objects({"rng": rng_state(), "rollout": rollout}, world)
        if rank == 0:
            save_checkpoint(path, agent, optimizer, args, global_step, iteration, rollout, ranks[1:],
                            beta if penalty else None)
    recent_returns: list[float] = []
    last_stats: dict = {}
    start_time, last_print = time.time(), 0.0
    steps_at_start = global_step
    finished, failed = True, False  # failed: an update went non-finite
    # SIGTERM / SIGINT: finish the current iteration, write a checkpoint, say how to resume, exit cleanly.
    stop_signal: list[int] = []
    previous_handlers = {sig: signal.signal(sig, lambda signum, frame: stop_signal.append(signum))
                         for sig in (signal.SIGTERM, signal.SIGINT)}

    for iteration in range(start_iteration, num_iterations + 1):
        lr_now = args.learning_rate
        if args.anneal_lr:  # detail: linear annealing to 0 over the whole run
            lr_now = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
        optimizer.param_groups[0]["lr"].fill_(lr_now)

        # Collect rollout
        for step in range(args.num_steps):
            global_step += args.num_envs * world  # environment steps of all ranks
            obs[step] = next_obs
            dones[step] = next_done
            with torch.inference_mode():
                action, logprob, value, logp_all = policy(next_obs)
            values[step] = value
            actions[step] = action
            logprobs[step] = logprob
            if penalty:
                old_logp_all[step] = logp_all

            next_obs_np, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            reward = np.asarray(reward, dtype=np.float32)
            done = np.logical_or(terminations, truncations)
            ep_return += reward
            ep_length += 1
            # Truncation is not termination: bootstrap r + gamma * V(final obs) for episodes cut by a time limit.
            trunc_only = np.logical_and(truncations, np.logical_not(terminations))
            if trunc_only.any():
                idx = np.nonzero(trunc_only)[0]
                final = torch.as_tensor(np.stack(infos["final_obs"][idx]), dtype=torch.float32, device=device)
                with torch.inference_mode():
                    reward[idx] += args.gamma * agent.get_value(final.reshape(len(idx), -1)).cpu().numpy()
            for i in np.nonzero(done)[0]:
                recent_returns.append(float(ep_return[i]))
                writer.add_scalar("charts/episodic_return", ep_return[i], global_step)
                writer.add_scalar("charts/episodic_length", ep_length[i], global_step)
            ep_return[done] = 0.0
            ep_length[done] = 0
            rewards[step] = torch.as_tensor(reward, device=device)
            next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32, device=device).reshape(args.num_envs, -1)
            next_done = torch.as_tensor(done, dtype=torch.float32, device=device)

        # Compute advantages and returns (GAE)
        with torch.no_grad():
            next_value = agent.get_value(next_obs)
            advantages, returns = compute_gae(rewards, values, dones, next_value, next_done,
                                              args.gamma, args.gae_lambda)

        b_obs = obs.reshape(batch_size, obs_dim)
        b_logprobs, b_actions = logprobs.reshape(-1), actions.reshape(-1)
        b_advantages, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)
        b_old_logp_all = old_logp_all.reshape(batch_size, n_actions) if penalty else None
        if args.norm_adv and not norm_per_minibatch:  # the note's form (the default is per minibatch, in ppo_loss)
            b_advantages = normalize_advantages_rollout(b_advantages)

        # Optimise policy & value for E epochs
        stats_sum, n_updates = None, 0
        for epoch in range(args.update_epochs):
            b_inds = torch.randperm(batch_size, device=device)
            for start in range(0, batch_size, minibatch_size):
                mb = b_inds[start:start + minibatch_size]
                stats = update(b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb], b_returns[mb],
                               b_values[mb], b_old_logp_all[mb] if penalty else None)
                stats = {k: v.clone() for k, v in stats.items()}
                stats_sum = stats if stats_sum is None else {k: stats_sum[k] + v for k, v in stats.items()}
                n_updates += 1
            if args.target_kl is not None and float(all_ranks_sum(stats["approx_kl"], world)) / world > args.target_kl:
                break
        # Update reference policy: theta_old <- theta happens implicitly, the next rollout samples from theta.
        # KL(pi_old || pi_theta) of the whole rollout after the update: the d of the adaptive KL-penalty rule
        if penalty:
            with torch.no_grad():
                kl_sum = torch.zeros((), device=device)
                for start in range(0, batch_size, minibatch_size):
                    mb = slice(start, start + minibatch_size)
                    kl_sum += categorical_kl(b_old_logp_all[mb], torch.log_softmax(agent.actor(b_obs[mb]), -1)).sum()
            stats_sum["kl"] = kl_sum / batch_size * n_updates  # one value: the mean over updates below gives it back

        # one host sync: the statistics averaged over updates (and ranks), and whether any rank got a stop signal
        signal_count = torch.tensor(float(len(stop_signal)), device=device)
        *means, signals = all_ranks_sum(torch.stack([*stats_sum.values(), signal_count]), world).tolist()
        last_stats = {k: v / (n_updates * world) for k, v in zip(stats_sum, means)}
        if not all(np.isfinite(v) for v in last_stats.values()):
            bad = [k for k, v in last_stats.items() if not np.isfinite(v)]
            if rank == 0:  # (every rank sees the same all-reduced statistics)
                print(f"error: non-finite {', '.join(bad)} at iteration {iteration}; stopping (last checkpoint kept)",
                      file=sys.stderr)
            finished, failed = False, True  # no final checkpoint and no evaluation; exit 1 after the clean-up
            break
        last_stats["explained_variance"] = explained_variance(b_values.cpu().numpy(), b_returns.cpu().numpy())
        rate = (global_step - steps_at_start) / (time.time() - start_time)  # steps/s of this process
        sps = int(rate)
        writer.add_scalar("charts/learning_rate", lr_now, global_step)
        for k in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac",
                  "explained_variance"):
            writer.add_scalar(f"losses/{k}", last_stats[k], global_step)
        writer.add_scalar("charts/SPS", sps, global_step)
        if penalty:
            writer.add_scalar("losses/kl", last_stats["kl"], global_step)
            writer.add_scalar("charts/kl_coef", beta, global_step)  # the coefficient this update used

        now = time.time()
        if rank == 0 and (now - last_print >= 5.0 or iteration == num_iterations):
            last_print = now
            recent = np.mean(recent_returns[-20:]) if recent_returns else float("nan")
            steps_left = (num_iterations - iteration) * batch_size * world
            print(f"iter {iteration}/{num_iterations}  global_step={global_step}  SPS={sps}  "
                  f"return(last 20)={recent:.1f}  approx_kl={last_stats['approx_kl']:.4f}"
                  + (f"  kl={last_stats['kl']:.4f} kl_coef={beta:.3g}" if penalty else "")
                  + f"  eta={eta_text(steps_left / rate if rate > 0 else math.inf)}", flush=True)
        if args.cudagraphs and iteration == start_iteration and rank == 0 and cudagraph_skips():
            print(f"note: {cudagraph_skips()} compiled graph(s) run without CUDA graphs (TORCH_LOGS=cudagraphs says "
                  "why)", flush=True)
        if args.kl_penalty_target is not None:  # the coefficient of the next update
            beta = adapt_kl_coef(beta, last_stats["kl"], args.kl_penalty_target)
            kl_coef.fill_(beta)

        ckpt_path = os.path.join(run_dir, "checkpoint.pt")
        stop_now = args.stop_after and iteration - start_iteration + 1 >= args.stop_after
        if (stop_now or signals) and iteration < num_iterations:  # signals: summed over ranks, so all stop together
            checkpoint(ckpt_path, iteration)
            why = (signal.Signals(stop_signal[0]).name if stop_signal else "a signal to another rank" if signals
                   else f"--stop-after {args.stop_after}")
            if rank == 0:
                launcher = f"torchrun --nproc-per-node {world}" if world > 1 else "python"
                print(f"stopped at iteration {iteration} ({why}); continue with: {launcher} {SCRIPT} --resume "
                      f"{ckpt_path}" + (f" (which stops again after {args.stop_after} iterations, the checkpoint's "
                       "--stop-after; add --stop-after 0 to run to the end)" if args.stop_after else ""), flush=True)
            finished = False
            break
        if args.checkpoint_every and iteration % args.checkpoint_every == 0:
            checkpoint(ckpt_path, iteration)
    checkpointed = ckpt is not None or args.checkpoint_every or args.stop_after  # a checkpoint.pt along the way
    if finished and (args.save_model or (checkpointed and start_iteration <= num_iterations)):
        # brought up to the end of the run, so that a --resume of the finished run evaluates instead of training
        path = os.path.join(run_dir, "checkpoint.pt")
        checkpoint(path, max(num_iterations, start_iteration - 1))
        if rank == 0:
            print(f"checkpoint written to {path}")
    for sig, handler in previous_handlers.items():
        signal.signal(sig, handler)
    envs.close()

    result = {"global_step": global_step, "run_dir": run_dir, "stats": last_stats, "returns": recent_returns}
    if args.eval_episodes and finished:  # under torchrun every rank plays its share; rank 0 logs them all
        share = args.eval_episodes // world + int(rank < args.eval_episodes % world)
        mine = evaluate(agent, args, device, share, os.path.join(run_dir, "videos"), rank) if share else []
        eval_returns = [r for part in gather_objects(mine, world) for r in part]
        mean, std = float(np.mean(eval_returns)), float(np.std(eval_returns))
        writer.add_scalar("eval/episodic_return", mean, global_step)
        if rank == 0:
            print(f"eval: {args.eval_episodes} episodes{' (deterministic)' if args.eval_deterministic else ''}, "
                  f"return {mean:.2f} ± {std:.2f}")
        result["eval_returns"] = eval_returns
    writer.close()
    if args.track and rank == 0:
        import wandb

        wandb.finish(exit_code=int(failed))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # no rank leaves while another still works (rank 0 may still be writing)
        dist.destroy_process_group()
    if failed:
        if world > 1:  # as at the end of __main__: skip the teardown where gloo's threads can abort
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(1)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main(parse_args())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Everything is written and the process group destroyed. Skip the interpreter's teardown, where gloo's
        # threads now and then abort a finished run ("terminate called without an active exception", exit -6).
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
