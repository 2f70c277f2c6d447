"""PPO for continuous-action gymnasium environments (MuJoCo HalfCheetah-v5 by default).

    python ppo_continuous.py                                   # HalfCheetah-v5, 1M steps, CleanRL settings
    python ppo_continuous.py --env-id Hopper-v5 --num-envs 4 --vector-mode async
    python ppo_continuous.py --resume runs/<run>/checkpoint.pt --eval-episodes 10 --capture-video
    torchrun --nproc-per-node 2 ppo_continuous.py              # data parallel: each process steps --num-envs envs

The loop follows the note (shared/seeds/ppo_note.md) step by step; each step is a section comment below:
Collect rollout -> Compute advantages and returns (GAE) -> Advantage normalisation ->
Optimise policy & value for E epochs (clipped policy loss + value loss + entropy bonus) -> Update reference policy.
The note's adaptive-KL-penalty variant replaces the clipped loss with --kl-penalty-coef / --kl-penalty-target.
Continuous-control details: diagonal Gaussian policy with a state-independent log std, actions clipped for the env
only, observation normalisation and reward scaling done here in the main loop (their statistics are part of the
checkpoint and are frozen for evaluation), and truncated episodes bootstrapped from their normalised final observation.

Stopping and resuming: SIGTERM / SIGINT (like --stop-after) finish the current iteration, write the checkpoint and
print the --resume command. With sync envs (the default) --resume is exact: a stopped and resumed run equals an
uninterrupted one (same parameters, losses and returns; tested on CPU). The checkpoint holds, besides networks,
optimizer, torch RNG, step count and the normalisation statistics, the episodes in flight: every wrapper's plain
attributes (TimeLimit's step counter, ...), each env's np_random generator and, for MuJoCo envs, the simulator's
state, which lives in env.unwrapped.data: the integration state (mj_getState with mjSTATE_INTEGRATION: time, qpos,
qvel, act, ctrl, the constraint solver's warm start, ...) and MjData's derived arrays that the envs read between steps
(qpos and qvel alone, MujocoEnv.set_state, do not continue bit for bit: checked on Hopper, HalfCheetah and Ant), the
next observation, the episode counters and the reward scaler's running discounted return. With --vector-mode async the
envs live in other processes and are not saved: a resumed run starts new episodes (everything else is restored).

Under torchrun every rank normalises with running statistics of its own data during a rollout; at the end of each
rollout the statistics of all ranks are merged (merge_moments), so that every rank, and the checkpoint, hold those of
all ranks' data.
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
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro


def die(msg: str) -> None:
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_count(text: str) -> int:
    """A count written as 1000000, 1e6, 5e5 or 1_000_000; anything that is not a whole number is an error."""
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
    exp_name: str = "ppo_continuous"
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
    """record videos of the evaluation episodes under runs/<run>/videos (headless: MUJOCO_GL=egl or osmesa)"""
    save_model: bool = False
    """write runs/<run>/checkpoint.pt at the end of training"""
    checkpoint_every: Count = 0
    """also write the checkpoint every N iterations (0: only at the end with --save-model)"""
    resume: Optional[str] = None
    """continue from this checkpoint.pt: same run directory, step count, lr schedule and normalisation statistics;
    flags not given on the command line take the checkpoint's values"""
    stop_after: Count = 0
    """stop this process after N iterations with a checkpoint (0: run to the end); --resume continues"""
    eval_episodes: Count = 0
    """after training (or right away for a finished --resume checkpoint) evaluate N episodes"""
    eval_deterministic: bool = False
    """evaluate with the Gaussian's mean action instead of a sampled one"""
    runs_dir: str = "runs"
    """directory that holds the runs"""

    # Algorithm
    env_id: str = "HalfCheetah-v5"
    """id of a gymnasium environment with a continuous (Box) action space"""
    total_timesteps: Count = 1_000_000
    """total environment steps of the run"""
    learning_rate: float = 3e-4
    """Adam learning rate"""
    num_envs: Count = 1
    """number of parallel environments"""
    vector_mode: Literal["sync", "async"] = "sync"
    """gymnasium SyncVectorEnv (one process) or AsyncVectorEnv (one process per env)"""
    num_steps: Count = 2048
    """steps per environment per rollout (T)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0"""
    gamma: float = 0.99
    """discount factor (also the discount of the reward scaler's running return)"""
    gae_lambda: float = 0.95
    """lambda of generalized advantage estimation"""
    num_minibatches: Count = 32
    """number of minibatches per epoch"""
    update_epochs: Count = 10
    """epochs E over each rollout"""
    norm_adv: bool = True
    """standardise the advantages (where: --norm-adv-scope)"""
    norm_adv_scope: Literal["minibatch", "rollout"] = "minibatch"
    """minibatch: in each minibatch, (A-mean)/(std+eps) (CleanRL); rollout: once, (A-mean)/sqrt(var+eps) (the note)"""
    clip_coef: float = 0.2
    """clip range epsilon of the policy ratio"""
    clip_vloss: bool = True
    """clip the value loss as in the original PPO code"""
    ent_coef: float = 0.0
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
    norm_obs: bool = True
    """normalise observations by their running mean/std (updated in rollouts, frozen in evaluation)"""
    obs_clip: float = 10.0
    """clip normalised observations to [-obs_clip, obs_clip]"""
    norm_reward: bool = True
    """scale rewards by the running std of the discounted return"""
    reward_clip: float = 10.0
    """clip scaled rewards to [-reward_clip, reward_clip]"""


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
    if batch % args.num_minibatches:
        die(f"num_envs*num_steps = {batch} is not divisible by --num-minibatches {args.num_minibatches}")
    if args.norm_adv and args.norm_adv_scope == "minibatch" and batch // args.num_minibatches < 2:
        die(f"minibatches of {batch // args.num_minibatches} sample: --norm-adv needs at least 2 (their std)")
    if not 0 <= args.seed < 2**31:
        die(f"--seed must lie in [0, 2**31), got {args.seed}")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun: one rollout of every process
    if 0 < args.total_timesteps < batch * world:
        die(f"--total-timesteps {args.total_timesteps} is less than one rollout (num_envs*num_steps = {batch}"
            + (f", times {world} processes)" if world > 1 else ")"))
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
    if args.obs_clip <= 0 or args.reward_clip <= 0:
        die("--obs-clip and --reward-clip must be positive")
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


def check_env(env_id: str) -> None:
    """Die with one line unless env_id makes an env with flat Box action and observation spaces."""
    import gymnasium as gym

    try:
        probe = gym.make(env_id)
    except gym.error.Error as e:
        die(f"unknown or unusable env id {env_id!r}: {e}")
    except Exception as e:  # a missing optional dependency of the env, for instance
        die(f"cannot make {env_id!r}: {type(e).__name__}: {e}")
    if not isinstance(probe.action_space, gym.spaces.Box):
        die(f"{env_id} has a {type(probe.action_space).__name__} action space; ppo_continuous.py needs a Box "
            "(use ppo.py for discrete actions)")
    if len(probe.action_space.shape) != 1:  # actions are (N, act_dim), clipped to the bounds of a flat Box
        die(f"{env_id} has a {probe.action_space} action space; ppo_continuous.py needs a flat Box")
    if not isinstance(probe.observation_space, gym.spaces.Box) or len(probe.observation_space.shape) != 1:
        die(f"{env_id} has a {probe.observation_space} observation space; ppo_continuous.py needs a flat Box")
    probe.close()


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


def setup_rendering(env_id: str) -> str:
    """Find a GL backend that renders env_id offscreen and export it as MUJOCO_GL (read when the renderer is made).

    MuJoCo renders through GLFW (needs a display), EGL (libEGL: a GPU driver or Mesa) or OSMesa (libOSMesa, software).
    A headless machine needs MUJOCO_GL=egl or MUJOCO_GL=osmesa. The probe runs in a child process because a broken GL
    backend can abort the process that tries it."""
    code = ("import gymnasium as gym, moviepy\n"
            f"e = gym.make({env_id!r}, render_mode='rgb_array'); e.reset(seed=0); assert e.render().size > 0")
    if os.environ.get("MUJOCO_GL"):
        candidates = [os.environ["MUJOCO_GL"]]
    else:
        candidates = (["glfw"] if os.environ.get("DISPLAY") else []) + ["egl", "osmesa"]
    last = ""
    for gl in candidates:
        try:
            r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, MUJOCO_GL=gl),
                               capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            last = f"MUJOCO_GL={gl}: timed out"
            continue
        if r.returncode == 0:
            os.environ["MUJOCO_GL"] = gl
            return gl
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        last = f"MUJOCO_GL={gl}: {lines[-1].strip() if lines else f'exit code {r.returncode}'}"
    die(f"--capture-video: cannot render {env_id} offscreen (tried MUJOCO_GL={'/'.join(candidates)}; last: {last}); "
        "install EGL (libegl1) or OSMesa (libosmesa6) and set MUJOCO_GL=egl or MUJOCO_GL=osmesa")
    return ""


# ---------------------------------------------------------------------------------------------------------
# Normalisation: observations by running mean/var, rewards by the running std of the discounted return
# ---------------------------------------------------------------------------------------------------------
class RunningMeanStd:
    """Mean and (population) variance of a stream of vectors, merged batch by batch with Chan et al.'s parallel
    update, as in OpenAI baselines and gymnasium. count starts at epsilon (mean 0, var 1) as there."""

    def __init__(self, shape: tuple = (), epsilon: float = 1e-4):
        self.mean = np.zeros(shape, dtype=np.float64)
        self.var = np.ones(shape, dtype=np.float64)
        self.count = float(epsilon)
        self.added: Optional[RunningMeanStd] = None  # under torchrun: what this rank added since the last merge
        self.merged: Optional[tuple] = None  # under torchrun: (mean, var, count) at the last merge, alike on all ranks

    def update(self, x: np.ndarray) -> None:
        """x: a batch (B, *shape) of new samples."""
        x = np.asarray(x, dtype=np.float64)
        b_count = x.shape[0]
        b_mean = x.sum(axis=0) / b_count  # = x.mean(0), x.var(0) without numpy's slow wrappers (hot loop)
        b_var = np.square(x - b_mean).sum(axis=0) / b_count
        delta = b_mean - self.mean
        total = self.count + b_count
        self.mean = self.mean + delta * (b_count / total)
        m2 = self.var * self.count + b_var * b_count + delta**2 * (self.count * b_count / total)
        self.var = m2 / total
        self.count = total
        if self.added is not None:
            self.added.update(x)

    def track_additions(self) -> None:
        """Under torchrun: remember the current state (the same on every rank) and collect the samples added from
        now on in self.added, for merge_ranks."""
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


def merge_moments(parts: list) -> tuple[np.ndarray, np.ndarray, float]:
    """Mean, (population) variance and count of the union of disjoint sets of samples, from each set's
    (mean, var, count): the parallel variance formula (Chan et al.) for any number of sets,
        n = sum_i n_i,   mean = sum_i n_i mean_i / n,   var = sum_i n_i (var_i + (mean_i - mean)^2) / n.
    Sets of count 0 add nothing. Deterministic in the order of `parts`: ranks that merge the same list agree bit for
    bit."""
    count = sum(float(c) for _, _, c in parts)
    mean = sum(float(c) * np.asarray(m, dtype=np.float64) for m, _, c in parts) / count
    var = sum(float(c) * (np.asarray(v, dtype=np.float64) + np.square(np.asarray(m, dtype=np.float64) - mean))
              for m, v, c in parts) / count
    return mean, var, count


def normalize_obs(obs: np.ndarray, rms: RunningMeanStd, clip: float, eps: float = 1e-8) -> np.ndarray:
    """(obs - mean) / sqrt(var + eps), clipped to [-clip, clip]; uses the statistics as they are (no update)."""
    return np.clip((obs - rms.mean) / np.sqrt(rms.var + eps), -clip, clip)


class RewardScaler:
    """Divide rewards by the running std of the discounted return G <- gamma * G + r (no mean subtraction), as
    gymnasium's NormalizeReward; G restarts at 0 after every episode end, termination or truncation."""

    def __init__(self, num_envs: int, gamma: float, clip: float = 10.0, eps: float = 1e-8):
        self.rms = RunningMeanStd(())
        self.ret = np.zeros(num_envs, dtype=np.float64)
        self.gamma, self.clip, self.eps = gamma, clip, eps

    def __call__(self, reward: np.ndarray, done: np.ndarray) -> np.ndarray:
        self.ret = self.ret * self.gamma + reward
        self.rms.update(self.ret)
        scaled = np.clip(reward / np.sqrt(self.rms.var + self.eps), -self.clip, self.clip)
        self.ret[done] = 0.0
        return scaled


# ---------------------------------------------------------------------------------------------------------
# Agent: separate actor and critic MLPs (64x64 tanh), orthogonal init, diagonal Gaussian policy
# ---------------------------------------------------------------------------------------------------------
def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)  # detail: orthogonal init with scaled gains
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_logprob_entropy(mean: torch.Tensor, logstd: torch.Tensor, action: torch.Tensor):
    """log N(action; mean, exp(logstd)^2) and the entropy, summed over action dimensions (the diagonal Gaussian's
    dimensions are independent). Written out instead of torch.distributions: cheaper in the hot loop, compilable."""
    z = (action - mean) * torch.exp(-logstd)
    logprob = (-0.5 * z * z - logstd - LOG_SQRT_2PI).sum(-1)
    entropy = (0.5 + LOG_SQRT_2PI + logstd).sum(-1)
    return logprob, entropy


class Agent(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, act_dim), std=0.01),  # detail: small last-layer gain -> mean near 0 at start
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))  # detail: state-independent learnable log std

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def fused_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Actor and critic as one MLP with block-diagonal weights: the same function in half the matmuls. The rollout
        (one small batch per env step, bound by per-op overhead) uses it; take a fresh copy after each update."""
        a, c = self.actor_mean, self.critic
        with torch.no_grad():
            return [(torch.cat([a[0].weight, c[0].weight]), torch.cat([a[0].bias, c[0].bias])),
                    (torch.block_diag(a[2].weight, c[2].weight), torch.cat([a[2].bias, c[2].bias])),
                    (torch.block_diag(a[4].weight, c[4].weight), torch.cat([a[4].bias, c[4].bias]))]

    def get_action_and_value(self, x: torch.Tensor, action: Optional[torch.Tensor] = None, fused=None):
        """Sample (or score) an unclipped action. Returns action, log pi(a|s), entropy, V(s).
        fused: fused_weights() of this agent, for a faster forward pass without gradients."""
        return self(x, action, fused)[:4]

    def forward(self, x: torch.Tensor, action: Optional[torch.Tensor] = None, fused=None):
        """get_action_and_value, plus the Gaussian (mean, log std) of each state (the KL-penalty variant's exact KL
        compares the old and the new ones). The update calls the agent itself, so that DDP can average the gradients."""
        if fused is None:
            mean, value = self.actor_mean(x), self.get_value(x)
        else:
            (w1, b1), (w2, b2), (w3, b3) = fused
            out = F.linear(torch.tanh(F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2)), w3, b3)
            mean, value = out[..., :-1], out[..., -1]
        logstd = self.actor_logstd.expand_as(mean)
        if action is None:  # sampling: the log-prob follows from the noise, z = (a - mean) / std = noise
            noise = torch.randn_like(mean)
            action = mean + torch.exp(logstd) * noise
            logprob = (-0.5 * noise * noise - logstd - LOG_SQRT_2PI).sum(-1)
            entropy = (0.5 + LOG_SQRT_2PI + logstd).sum(-1)
        else:
            logprob, entropy = gaussian_logprob_entropy(mean, logstd, action)
        return action, logprob, entropy, value, (mean, logstd)

    def act(self, x: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """The action to play (evaluation, load_policy), unclipped: sampled, or the Gaussian's mean."""
        return self.actor_mean(x) if deterministic else self.get_action_and_value(x)[0]


# ---------------------------------------------------------------------------------------------------------
# Pure functions (imported by the tests)
# ---------------------------------------------------------------------------------------------------------
def compute_gae(rewards, values, dones, next_value, next_done, gamma: float, lam: float):
    """Generalized advantage estimation by the backward recursion of the note.

    rewards, values, dones: (T, N) numpy arrays; dones[t] = 1 if obs[t] is the first of a new episode (the transition
    at t-1 ended one). next_value, next_done: (N,) for the observation after the last step. Truncated episodes must
    already carry gamma * V(final_obs) in their last reward (see main), so a done here always means "no bootstrap".
    Returns advantages and returns R_t = A_t + V(s_t), both (T, N). On the host in numpy: the T-step loop over
    tiny arrays costs a fifth of what it costs in torch.
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


def normalize_advantages(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / (std + eps), with the unbiased std as in CleanRL and the OpenAI baselines."""
    return (adv - adv.mean()) / (adv.std() + eps)


def normalize_advantages_rollout(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The note's advantage normalisation over the whole rollout: (A - mean) / sqrt(population variance + eps)."""
    return (adv - adv.mean()) / torch.sqrt(adv.var(unbiased=False) + eps)


def gaussian_kl(old_mean, old_logstd, mean, logstd) -> torch.Tensor:
    """KL(N(old_mean, old_std^2) || N(mean, std^2)) of each state, exact, summed over the diagonal's dimensions:
    log(std/old_std) + (old_std^2 + (old_mean - mean)^2) / (2 std^2) - 1/2 per dimension; (..., A) -> (...)."""
    return (logstd - old_logstd + (torch.exp(2 * old_logstd) + (old_mean - mean) ** 2) * (0.5 * torch.exp(-2 * logstd))
            - 0.5).sum(-1)


def ppo_loss(newlogprob, oldlogprob, advantages, newvalue, oldvalue, returns, entropy,
             clip_coef: float, clip_vloss: bool, ent_coef: float, vf_coef: float, norm_adv: bool, kl_coef=None,
             kl=None):
    """Clipped policy loss + c_v * value loss - c_H * entropy, with statistics (all tensors, no host sync).
    kl_coef (a number or 0-d tensor) selects the KL-penalty policy loss instead: -r*A + kl_coef * kl, with kl the
    exact KL(pi_old(.|s) || pi(.|s)) of each sample's state (gaussian_kl), as in the PPO paper."""
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
SCRIPT = "ppo_continuous.py"


def mujoco_state(env) -> Optional[dict]:
    """The state of a MuJoCo env's simulator, which lives in env.unwrapped.data, not in plain attributes (None for
    other envs): the integration state (mj_getState with mjSTATE_INTEGRATION: time, qpos, qvel, act, ctrl,
    qacc_warmstart, mocap, ...) and every numeric array of MjData. The arrays matter too: between steps they hold the
    quantities derived at the start of the last step (body positions, contact forces, ...), which the envs read (Ant's
    reward uses the torso position before the step); mj_forward on the restored qpos would compute other values."""
    model, data = getattr(env, "model", None), getattr(env, "data", None)
    if model is None or data is None or type(data).__module__.split(".")[0] != "mujoco":
        return None
    import mujoco

    sig = mujoco.mjtState.mjSTATE_INTEGRATION
    state = np.empty(mujoco.mj_stateSize(model, sig), dtype=np.float64)
    mujoco.mj_getState(model, data, state, sig)
    arrays = {}
    for name in dir(data):
        if name.startswith("_"):
            continue
        try:
            value = getattr(data, name)
        except Exception:  # noqa: BLE001 - some properties exist only for some models
            continue
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and value.size:
            arrays[name] = torch.from_numpy(np.array(value, copy=True))
    return {"integration": torch.from_numpy(state), "arrays": arrays}


def set_mujoco_state(env, saved: dict) -> None:
    import mujoco

    sig = mujoco.mjtState.mjSTATE_INTEGRATION
    state = saved["integration"].numpy().astype(np.float64)
    if state.size != mujoco.mj_stateSize(env.model, sig):
        raise ValueError(f"MuJoCo state of size {state.size}, expected {mujoco.mj_stateSize(env.model, sig)}")
    for name, value in saved["arrays"].items():  # derived quantities; the variable-sized solver arrays (contacts,
        current = getattr(env.data, name, None)  # constraints) are rebuilt by the next step and may not fit now
        if isinstance(current, np.ndarray) and current.shape == tuple(value.shape):
            current[...] = value.numpy()
    mujoco.mj_setState(env.model, env.data, state, sig)


EXACT_RESUME_MODULES = ("gymnasium.envs.classic_control", "gymnasium.envs.mujoco")  # state: saved in full


def env_state(envs) -> Optional[list]:
    """Snapshot of each sub-environment of a SyncVectorEnv: the plain attributes (numbers, arrays) of the env and
    of every wrapper (TimeLimit's step counter, ...), its random generator and, for MuJoCo, the simulator state
    (which lives in env.unwrapped.data, not in plain attributes). None for AsyncVectorEnv, whose envs live in other
    processes, and for envs whose state lives elsewhere (Box2D's world): restoring part of it would be another game."""
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
        snapshot.append({"layers": layers, "np_random": env.np_random.bit_generator.state,
                         "mujoco": mujoco_state(env)})
    return snapshot


def load_env_state(envs, snapshot: list) -> None:
    for env, saved in zip(envs.envs, snapshot):
        for plain in saved["layers"]:
            for k, v in plain.items():
                setattr(env, k, v.numpy() if isinstance(v, torch.Tensor) else v)
            env = getattr(env, "env", env)
        env.np_random.bit_generator.state = saved["np_random"]
        if saved.get("mujoco") is not None:
            set_mujoco_state(env, saved["mujoco"])


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
                    obs_rms: RunningMeanStd, reward_scaler: RewardScaler, rollout: Optional[dict] = None,
                    other_ranks: list = (), kl_coef: Optional[float] = None) -> None:
    """Atomic write (temporary file, then rename): a kill during the save keeps the previous checkpoint.
    kl_coef: the adapted coefficient of the KL-penalty variant (None with the clipped objective).
    `rollout` holds what an exact resume needs besides the networks: env states, next obs, episode counters,
    the reward scaler's running return.
    Under torchrun `other_ranks` holds the RNG state and rollout of ranks 1, 2, ... (the networks are the same, and so
    are the normalisation statistics, merged over the ranks at the end of every rollout)."""
    state = {
        "script": SCRIPT,
        "env_id": args.env_id,
        "model": agent.state_dict(),
        "optimizer": optimizer.state_dict(),
        "global_step": global_step,
        "iteration": iteration,
        "rng": rng_state(),
        "args": dataclasses.asdict(args),
        "obs_rms": obs_rms.state_dict(),
        "return_rms": reward_scaler.rms.state_dict(),
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
def evaluate(agent: Agent, args: Args, device: torch.device, episodes: int, obs_rms: RunningMeanStd,
             video_dir: str = "", rank: int = 0) -> list[float]:
    """Run `episodes` full episodes with actions sampled from the policy (its mean with --eval-deterministic) and
    the observation statistics frozen; return their undiscounted (raw) returns. Under torchrun each rank plays with
    its own seed, and rank 0 alone records videos."""
    env = make_env(args.env_id, 0, args.capture_video and rank == 0, video_dir)()
    low, high = env.action_space.low, env.action_space.high
    returns = []
    obs, _ = env.reset(seed=args.seed + 10_000 + rank)
    ep_ret = 0.0
    while len(returns) < episodes:
        x = normalize_obs(obs, obs_rms, args.obs_clip) if args.norm_obs else obs
        with torch.inference_mode():
            x = torch.as_tensor(x[None], dtype=torch.float32, device=device)
            action = agent.act(x, args.eval_deterministic)
        obs, r, term, trunc, _ = env.step(np.clip(action[0].cpu().numpy(), low, high))
        ep_ret += float(r)
        if term or trunc:
            returns.append(ep_ret)
            ep_ret = 0.0
            if len(returns) < episodes:  # no reset after the last one: RecordVideo would start an empty video
                obs, _ = env.reset()
    env.close()
    return returns


def load_policy(path: str, deterministic: bool = False, device: str = "cpu"):
    """A trained policy for your own code: `policy = load_policy("runs/<run>/checkpoint.pt")`, then
    `action = policy(obs)` for one raw observation of the checkpoint's env, or `policy(batch)` for one action per
    row. The saved observation statistics normalise the input (frozen); actions are clipped to the action space."""
    import gymnasium as gym

    err = io.StringIO()
    try:  # a library call: a bad file raises instead of exiting the caller's program
        with contextlib.redirect_stderr(err):
            ckpt = load_checkpoint(path)
    except SystemExit:
        raise ValueError(err.getvalue().strip().removeprefix("error: ")) from None
    probe = gym.make(ckpt["env_id"])
    shape, low, high = probe.observation_space.shape, probe.action_space.low, probe.action_space.high
    probe.close()
    obs_dim = int(np.prod(shape))
    agent = Agent(obs_dim, int(np.prod(low.shape))).to(device)
    agent.load_state_dict(ckpt["model"])
    obs_rms = RunningMeanStd((obs_dim,))
    obs_rms.load_state_dict(ckpt["obs_rms"])
    saved = ckpt["args"]

    @torch.inference_mode()
    def policy(obs):
        x = np.asarray(obs, dtype=np.float64)
        if tuple(x.shape) in (shape, (obs_dim,)):
            batch = False
        elif tuple(x.shape[1:]) in (shape, (obs_dim,)):
            batch = True
        else:
            raise ValueError(f"an observation of shape {tuple(x.shape)}: expected {shape} or a batch of them")
        x = x.reshape(-1, obs_dim)
        if saved["norm_obs"]:
            x = normalize_obs(x, obs_rms, saved["obs_clip"])
        x = torch.as_tensor(x, dtype=torch.float32, device=device)
        actions = np.clip(agent.act(x, deterministic).cpu().numpy(), low, high)
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


def merge_ranks(stats: list[RunningMeanStd], world: int) -> None:
    """Under torchrun, once per rollout: each running statistics in `stats` (tracking its additions, see
    RunningMeanStd.track_additions) becomes that of the data of all ranks: the state of the last merge, the same on
    every rank, combined with what each rank added since. One collective for all of them."""
    added = gather_objects([(rms.added.mean, rms.added.var, rms.added.count) for rms in stats], world)
    for i, rms in enumerate(stats):
        rms.mean, rms.var, rms.count = merge_moments([rms.merged] + [rank_added[i] for rank_added in added])
        rms.track_additions()


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
    check_env(args.env_id)  # before anything is written: bad input leaves no run directory behind
    if ckpt is not None:
        for name in ("norm_obs", "norm_reward"):  # the network was trained on these inputs / value scale
            if ckpt["args"].get(name) != getattr(args, name):
                die(f"{args.resume} was trained with {name}={ckpt['args'].get(name)}; "
                    f"--{name.replace('_', '-')} cannot change on --resume")
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
    if args.capture_video and rank == 0:  # fail before training, not after it (rank 0 alone evaluates)
        backend = setup_rendering(args.env_id)
        print(f"video: MUJOCO_GL={backend}" + ("" if args.eval_episodes else
                                                " (videos are recorded of the --eval-episodes only; none asked)"))
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    act_dim = int(np.prod(envs.single_action_space.shape))
    act_low, act_high = envs.single_action_space.low, envs.single_action_space.high
    agent = Agent(obs_dim, act_dim).to(device)
    # lr lives in a tensor so that annealing does not recompile the compiled/captured optimizer step;
    # on CPU the fused Adam is one kernel instead of one per parameter (4x faster step for these small nets); on CUDA
    # `capturable` keeps the step counters on the GPU and reads the tensor lr there (no host sync per parameter)
    optimizer = torch.optim.Adam(agent.parameters(), lr=torch.tensor(args.learning_rate, device=device), eps=1e-5,
                                 capturable=args.cuda, fused=True if not args.cuda else None)
    obs_rms = RunningMeanStd((obs_dim,))
    reward_scaler = RewardScaler(args.num_envs, args.gamma, args.reward_clip)
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
            obs_rms.load_state_dict(ckpt["obs_rms"])
            reward_scaler.rms.load_state_dict(ckpt["return_rms"])
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
    if world > 1:  # each rank's statistics see its own data during a rollout; merge_ranks combines them after it
        obs_rms.track_additions()
        reward_scaler.rms.track_additions()
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
    def policy(obs, fused):
        action, logprob, _, value, (mean, _) = agent(obs, fused=fused)
        return action, logprob, value, mean

    def update(mb_obs, mb_actions, mb_logprobs, mb_advantages, mb_returns, mb_values, mb_old_mean=None,
               mb_old_logstd=None):
        optimizer.zero_grad(set_to_none=False)
        _, newlogprob, entropy, newvalue, (mean, logstd) = train_agent(mb_obs, mb_actions)
        loss, stats = ppo_loss(newlogprob, mb_logprobs, mb_advantages, newvalue, mb_values, mb_returns, entropy,
                               args.clip_coef, args.clip_vloss, args.ent_coef, args.vf_coef, norm_per_minibatch,
                               kl_coef if penalty else None,
                               gaussian_kl(mb_old_mean, mb_old_logstd, mean, logstd) if penalty else None)
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

    def prepare_obs(raw: np.ndarray, update_stats: bool) -> np.ndarray:
        if not args.norm_obs:
            return raw
        if update_stats:
            obs_rms.update(raw)
        return normalize_obs(raw, obs_rms, args.obs_clip)

    # Rollout storage (T, N, ...): what the envs return stays on the host (numpy), what the policy returns on the device
    obs = np.zeros((args.num_steps, args.num_envs, obs_dim), dtype=np.float32)
    rewards = np.zeros((args.num_steps, args.num_envs), dtype=np.float32)
    dones = np.zeros((args.num_steps, args.num_envs), dtype=np.float32)
    actions = torch.zeros((args.num_steps, args.num_envs, act_dim), device=device)
    logprobs = torch.zeros((args.num_steps, args.num_envs), device=device)
    values = torch.zeros((args.num_steps, args.num_envs), device=device)
    # the KL-penalty variant's exact KL needs the Gaussian pi_old(.|s) of every state (its std is the same in all)
    old_means = torch.zeros((args.num_steps, args.num_envs, act_dim), device=device) if penalty else None

    next_obs_np, _ = envs.reset(seed=[args.seed + global_step + rank * args.num_envs + i
                                      for i in range(args.num_envs)])
    next_done = np.zeros(args.num_envs, dtype=np.float32)
    ep_return = np.zeros(args.num_envs)
    ep_length = np.zeros(args.num_envs, dtype=np.int64)
    saved = ckpt.get("rollout") if ckpt is not None else None
    if saved is not None and saved["envs"] is not None and args.vector_mode == "sync":
        # exact resume: the episodes in flight continue where they stopped
        try:
            load_env_state(envs, saved["envs"])
        except (ValueError, KeyError, AttributeError) as e:
            die(f"checkpoint {args.resume}: cannot restore the environments: {e}")
        next_obs = saved["next_obs"].numpy().astype(np.float32)  # already normalised
        next_done = saved["next_done"].numpy().astype(np.float32)
        ep_return, ep_length = saved["ep_return"].numpy().copy(), saved["ep_length"].numpy().copy()
        reward_scaler.ret = saved["reward_ret"].numpy().astype(np.float64)
    else:
        if ckpt is not None and rank == 0:
            print("note: environments start new episodes (exact resume needs --vector-mode sync, then and now, "
                  "and an env whose whole state the script saves)")
        next_obs = prepare_obs(next_obs_np, update_stats=num_iterations >= start_iteration).astype(np.float32)

    def checkpoint(path: str, iteration: int) -> None:
        """Called by every rank at the same iteration; rank 0 writes the states of all ranks."""
        rollout = dict(envs=env_state(envs), next_obs=torch.from_numpy(next_obs.copy()),
                       next_done=torch.from_numpy(next_done.copy()), ep_return=torch.from_numpy(ep_return.copy()),
                       ep_length=torch.from_numpy(ep_length.copy()),
                       reward_ret=torch.from_numpy(reward_scaler.ret.copy()))
        ranks = gather_objects({"rng": rng_state(), "rollout": rollout}, world)
        if rank == 0:
            save_checkpoint(path, agent, optimizer, args, global_step, iteration, obs_rms, reward_scaler, rollout,
                            ranks[1:], beta if penalty else None)
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
        fused = agent.fused_weights()  # the policy of this iteration's rollout (theta_old)
        old_logstd = agent.actor_logstd.detach().clone() if penalty else None  # and its std, (1, act_dim)

        # Collect rollout
        for step in range(args.num_steps):
            global_step += args.num_envs * world  # environment steps of all ranks
            obs[step] = next_obs
            dones[step] = next_done
            with torch.inference_mode():
                action, logprob, value, mean = policy(torch.from_numpy(next_obs).to(device), fused)
            values[step] = value
            actions[step] = action
            logprobs[step] = logprob
            if penalty:
                old_means[step] = mean

            # detail: clip to the action bounds for the env only; the buffer keeps the sample the log-prob is of
            next_obs_np, raw_reward, terminations, truncations, infos = envs.step(
                np.clip(action.cpu().numpy(), act_low, act_high))
            done = np.logical_or(terminations, truncations)
            ep_return += raw_reward
            ep_length += 1
            next_obs = prepare_obs(next_obs_np, update_stats=True).astype(np.float32)  # detail: obs normalisation
            reward = reward_scaler(raw_reward, done) if args.norm_reward else np.asarray(raw_reward, np.float64)
            # Truncation is not termination: bootstrap r + gamma * V(final obs) for episodes cut by a time limit,
            # the final observation normalised with the same statistics as the policy's inputs.
            trunc_only = np.logical_and(truncations, np.logical_not(terminations))
            if trunc_only.any():
                idx = np.nonzero(trunc_only)[0]
                final = prepare_obs(np.stack(infos["final_obs"][idx]), update_stats=False)
                with torch.inference_mode():
                    final_value = agent.get_value(torch.as_tensor(final, dtype=torch.float32, device=device))
                reward[idx] += args.gamma * final_value.cpu().numpy()
            for i in np.nonzero(done)[0]:
                recent_returns.append(float(ep_return[i]))
                writer.add_scalar("charts/episodic_return", ep_return[i], global_step)
                writer.add_scalar("charts/episodic_length", ep_length[i], global_step)
            ep_return[done] = 0.0
            ep_length[done] = 0
            rewards[step] = reward
            next_done = done.astype(np.float32)
        if world > 1:  # every rank's normalisation statistics become those of all ranks' data (before the update)
            merge_ranks([obs_rms, reward_scaler.rms], world)

        # Compute advantages and returns (GAE)
        with torch.inference_mode():
            next_value = agent.get_value(torch.from_numpy(next_obs).to(device)).cpu().numpy()
        advantages, returns = compute_gae(rewards, values.cpu().numpy(), dones, next_value, next_done,
                                          args.gamma, args.gae_lambda)

        b_obs = torch.from_numpy(obs).to(device).reshape(batch_size, obs_dim)
        b_logprobs, b_actions = logprobs.reshape(-1), actions.reshape(batch_size, act_dim)
        b_advantages = torch.from_numpy(advantages).to(device).reshape(-1)
        b_returns, b_values = torch.from_numpy(returns).to(device).reshape(-1), values.reshape(-1)
        if penalty:
            b_old_means = old_means.reshape(batch_size, act_dim)
        if args.norm_adv and not norm_per_minibatch:  # the note's form (the default is per minibatch, in ppo_loss)
            b_advantages = normalize_advantages_rollout(b_advantages)

        # Optimise policy & value for E epochs
        stats_sum, n_updates = None, 0
        for epoch in range(args.update_epochs):
            b_inds = torch.randperm(batch_size, device=device)
            for start in range(0, batch_size, minibatch_size):
                mb = b_inds[start:start + minibatch_size]
                stats = update(b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb], b_returns[mb],
                               b_values[mb], b_old_means[mb] if penalty else None, old_logstd)
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
                    kl_sum += gaussian_kl(b_old_means[mb], old_logstd, agent.actor_mean(b_obs[mb]),
                                          agent.actor_logstd).sum()
            stats_sum["kl"] = kl_sum / batch_size * n_updates  # one value: the mean over updates below gives it back

        # one host sync: the statistics averaged over updates (and ranks), the number of ranks whose parameters are
        # all finite, and the number of stop signals received by any rank
        finite = torch.stack([torch.isfinite(p).all() for p in agent.parameters()]).all()
        summed = all_ranks_sum(torch.stack([*stats_sum.values(), finite.float(),
                                            torch.tensor(float(len(stop_signal)), device=device)]), world)
        *means, finite_ranks, signals = torch.cat([summed[:-2] / (n_updates * world), summed[-2:]]).tolist()
        last_stats = dict(zip(stats_sum, means))
        if finite_ranks < world:
            last_stats["parameters"] = float("nan")
        if not all(np.isfinite(v) for v in last_stats.values()):  # stop before a checkpoint of this update
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

    sps = int((global_step - steps_at_start) / (time.time() - start_time))
    result = {"global_step": global_step, "sps": sps, "run_dir": run_dir, "stats": last_stats,
              "returns": recent_returns, "agent": agent, "obs_rms": obs_rms, "return_rms": reward_scaler.rms}
    if args.eval_episodes and finished:  # under torchrun every rank plays its share; rank 0 logs them all
        share = args.eval_episodes // world + int(rank < args.eval_episodes % world)
        mine = evaluate(agent, args, device, share, obs_rms, os.path.join(run_dir, "videos"), rank) if share else []
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
