"""The project's mutation check: named mutants of the behaviours users rely on, each applied to a copy of the
repository, with the script's tests run on it. A mutant the tests kill is a behaviour they guard; one that survives
is a missing test. Not part of the default test run (it runs the test files once per mutant).

    python benchmarks/mutants.py --list                          # the table
    python benchmarks/mutants.py --jobs 2                        # every mutant, two at a time
    python benchmarks/mutants.py --only ppo:gae-lambda-ignored   # one mutant (or a short id: every script's)
    python benchmarks/mutants.py --script ppo_llm.py --baseline  # one script; --baseline: unmutated selections first

Each mutant is an exact text replacement (old -> new) that must match exactly once in its script; a pattern that
is missing or ambiguous is an error of the table, not a kill (tests/test_mutants.py checks the table against the
current scripts). For each mutant the tracked files (`git ls-files`, as they are in the working tree; no .git, no
runs/) are copied to a temporary directory, the one replacement is made, and
`python -m pytest -q -x -p no:cacheprovider <selection>` runs there with a timeout. Status: killed (the tests
failed), survived (they passed: a missing test), timeout, or error (the table, or a selection that collects no
test). Writes report.md and report.json (command, date, hardware, versions, each mutant's status and seconds, the
score killed/total) under --out (default benchmarks/results/mutants/).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (benchmarks/common.py: the machine and versions of a report)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL = ("ppo.py", "ppo_continuous.py", "ppo_atari_envpool.py")


@dataclass(frozen=True)
class Mutant:
    script: str  # path relative to the repository root
    id: str  # short, unique within its script
    breaks: str  # the behaviour it breaks, one line
    old: str  # exact text, found exactly once in the script
    new: str
    k: str | None = None  # pytest -k expression (None: the whole selection)
    tests: tuple[str, ...] = ()  # test files; () means tests/test_<script stem>.py
    timeout: float | None = None  # seconds, instead of --timeout

    @property
    def name(self) -> str:
        return f"{os.path.splitext(self.script)[0]}:{self.id}"

    @property
    def test_files(self) -> tuple[str, ...]:
        return self.tests or (f"tests/test_{os.path.splitext(os.path.basename(self.script))[0]}.py",)

    def pytest_args(self) -> list[str]:
        return [*self.test_files, *(["-k", self.k] if self.k else [])]


def M(script, id, breaks, old, new, k=None, tests=(), timeout=None):
    return Mutant(script, id, breaks, old, new, k, tuple(tests), timeout)


# --- The table ---------------------------------------------------------------------------------------------------
# The math above each script's banner, and the resume code below it (written against the code before the plumbing
# rewrite: expect to move those patterns after it lands). Selections are kept short with -k where a test names the
# behaviour; where none does, the script's whole test file runs (-x stops at the first failure).
GAE_LAMBDA = ("lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam",
              "lastgaelam = delta + gamma * nextnonterminal * lastgaelam")
GAE_LAST_BOOTSTRAP = ("nextnonterminal, nextvalues = 1.0 - next_done, next_value",
                      "nextnonterminal, nextvalues = 1.0 - next_done, 0.0 * next_value")
GAE_DONE_SHIFT = ("nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]",
                  "nextnonterminal, nextvalues = 1.0 - dones[t], values[t + 1]")
CLIP_RANGE = ("torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)",
              "torch.clamp(ratio, 1 - 2 * clip_coef, 1 + 2 * clip_coef)")
RATIO_EXP = ("    ratio = logratio.exp()\n", "    ratio = 1.0 + logratio\n")
VCLIP_NEW = ("v_clipped = oldvalue + torch.clamp(newvalue - oldvalue, -clip_coef, clip_coef)",
             "v_clipped = newvalue + torch.clamp(oldvalue - newvalue, -clip_coef, clip_coef)")
TRUNC_DROPPED = ("reward[idx] += gamma * final_value.cpu().numpy()",
                 "reward[idx] += 0.0 * final_value.cpu().numpy()")
GSTEP = ('first_iteration, global_step = ckpt["iteration"] + 1, ckpt["global_step"]',
         'first_iteration, global_step = ckpt["iteration"] + 1, 0')

MUTANTS: list[Mutant] = [
    # ppo.py -----------------------------------------------------------------------------------------------------
    M("ppo.py", "gae-lambda-ignored", "GAE with lambda = 1 whatever --gae-lambda says", *GAE_LAMBDA, k="compute_gae"),
    M("ppo.py", "gae-last-bootstrap-dropped", "the value of the observation after the rollout is not bootstrapped",
      *GAE_LAST_BOOTSTRAP, k="compute_gae"),
    M("ppo.py", "gae-done-off-by-one", "GAE reads the done flag of the step before (episode ends one step late)",
      *GAE_DONE_SHIFT, k="compute_gae"),
    M("ppo.py", "clip-min-for-max", "the clipped objective takes the optimistic (min) loss instead of the max",
      "pg_loss = torch.max(pg_loss1, pg_loss2).mean()", "pg_loss = torch.min(pg_loss1, pg_loss2).mean()",
      k="clipped_policy_loss"),
    M("ppo.py", "clip-range-doubled", "the ratio is clipped to 1 +- 2 epsilon", *CLIP_RANGE, k="clipped_policy_loss"),
    M("ppo.py", "ratio-not-exponentiated", "the probability ratio is 1 + log ratio, not exp(log ratio)", *RATIO_EXP,
      k="clipped_policy_loss or kl_penalty_policy_loss"),
    M("ppo.py", "vclip-around-new", "value clipping clips the old prediction around the new one", *VCLIP_NEW,
      k="clipped_value_loss"),
    M("ppo.py", "vclip-no-max", "value clipping takes the clipped error alone instead of the max of both",
      "v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - returns) ** 2).mean()",
      "v_loss = 0.5 * ((v_clipped - returns) ** 2).mean()", k="clipped_value_loss"),
    M("ppo.py", "advnorm-no-eps", "minibatch advantage normalisation divides by the bare std (NaN on equal advantages)",
      "return (adv - adv.mean()) / (adv.std() + eps)", "return (adv - adv.mean()) / adv.std()",
      k="normalize_advantages"),
    M("ppo.py", "advnorm-mean-kept", "advantage normalisation does not subtract the mean",
      "return (adv - adv.mean()) / (adv.std() + eps)", "return adv / (adv.std() + eps)", k="normalize_advantages"),
    M("ppo.py", "advnorm-scope-swapped", "--norm-adv-scope minibatch normalises over the rollout and vice versa",
      'norm_per_minibatch = args.norm_adv and args.norm_adv_scope == "minibatch"',
      'norm_per_minibatch = args.norm_adv and args.norm_adv_scope != "minibatch"', k="norm_adv_scope"),
    M("ppo.py", "trunc-bootstrap-dropped", "a truncated episode is treated as terminated (no gamma * V(final obs))",
      *TRUNC_DROPPED, k="truncat"),
    M("ppo.py", "trunc-value-of-reset-obs", "truncation bootstraps the value of the next episode's first observation",
      'final_value = agent.get_value(obs_tensor(np.stack(infos["final_obs"][idx]), device))',
      "final_value = agent.get_value(obs_tensor(next_obs_np[idx], device))", k="truncat"),
    M("ppo.py", "eval-obs-negated", "evaluation feeds the policy negated observations",
      "env.step(int(agent.act(obs_tensor(obs[None], device), args.eval_deterministic)))",
      "env.step(int(agent.act(obs_tensor(-obs[None], device), args.eval_deterministic)))", k="evaluat"),
    M("ppo.py", "eval-deterministic-sampled", "deterministic play samples instead of taking the argmax",
      "return self.actor(x).argmax(-1) if deterministic else self.get_action_and_value(x)[0]",
      "return self.get_action_and_value(x)[0]", k="deterministic or load_policy"),
    M("ppo.py", "resume-optimizer-not-loaded", "a resumed run starts Adam afresh (moments and step count lost)",
      'load_optimizer_state(optimizer, ckpt["optimizer"], device)', '(optimizer, ckpt["optimizer"], device)',
      k="resume"),
    M("ppo.py", "resume-rng-not-restored", "a resumed run does not restore torch's RNG",
      'set_rng_state(ckpt["rng"][rank], device)', '(ckpt["rng"][rank], device)', k="resume"),
    M("ppo.py", "resume-global-step-zero", "a resumed run counts its steps from 0", *GSTEP, k="resume"),
    # ppo_continuous.py ------------------------------------------------------------------------------------------
    M("ppo_continuous.py", "gae-lambda-ignored", "GAE with lambda = 1 whatever --gae-lambda says", *GAE_LAMBDA,
      k="compute_gae"),
    M("ppo_continuous.py", "clip-min-for-max", "the clipped objective takes the optimistic (min) loss",
      "pg_loss = torch.max(pg_loss1, pg_loss2).mean()", "pg_loss = torch.min(pg_loss1, pg_loss2).mean()",
      k="loss or norm_adv_scope"),
    M("ppo_continuous.py", "trunc-bootstrap-dropped", "a truncated episode is treated as terminated", *TRUNC_DROPPED,
      k="truncat"),
    M("ppo_continuous.py", "trunc-final-obs-unnormalised",
      "truncation bootstraps V of the raw final observation, not of the normalised one",
      'final_value = agent.get_value(norm.obs(np.stack(infos["final_obs"][idx])))',
      'final_value = agent.get_value(obs_tensor(np.stack(infos["final_obs"][idx]), device))', k="truncat"),
    M("ppo_continuous.py", "eval-obs-negated", "evaluation feeds the policy negated observations",
      "action = agent.act(obs_tensor(obs[None], device, obs_rms if args.norm_obs else None, args.obs_clip),",
      "action = agent.act(obs_tensor(-obs[None], device, obs_rms if args.norm_obs else None, args.obs_clip),",
      k="eval or deterministic"),
    M("ppo_continuous.py", "eval-obs-unnormalised", "evaluation does not normalise with the saved statistics",
      "obs_tensor(obs[None], device, obs_rms if args.norm_obs else None, args.obs_clip)",
      "obs_tensor(obs[None], device, None, args.obs_clip)", k="eval or deterministic"),
    M("ppo_continuous.py", "load-policy-obs-unnormalised", "load_policy does not normalise with the saved statistics",
      'obs_tensor(obs.reshape(-1, obs_dim), device, rms, clip)',
      'obs_tensor(obs.reshape(-1, obs_dim), device, None, clip)', k="load_policy"),
    M("ppo_continuous.py", "eval-deterministic-sampled", "deterministic play samples instead of the Gaussian's mean",
      "return self.actor_mean(x) if deterministic else self.get_action_and_value(x)[0]",
      "return self.get_action_and_value(x)[0]", k="deterministic or load_policy"),
    M("ppo_continuous.py", "resume-obs-rms-not-loaded", "a resumed run starts the observation statistics afresh",
      'norm.obs_rms.load_state_dict(ckpt["obs_rms"])', '(ckpt["obs_rms"])', k="resume"),
    M("ppo_continuous.py", "resume-global-step-zero", "a resumed run counts its steps from 0", *GSTEP, k="resume"),
    # ppo_atari_envpool.py ---------------------------------------------------------------------------------------
    M("ppo_atari_envpool.py", "gae-done-off-by-one", "GAE reads the done flag of the step before", *GAE_DONE_SHIFT,
      k="gae"),
    M("ppo_atari_envpool.py", "clip-min-for-max", "the clipped objective takes the optimistic (min) loss",
      "pg_loss = masked_mean(torch.max(pg_loss1, pg_loss2), mask)",
      "pg_loss = masked_mean(torch.min(pg_loss1, pg_loss2), mask)", k="ppo_loss"),
    M("ppo_atari_envpool.py", "advnorm-over-reset-steps", "minibatch advantage normalisation's mean counts the "
      "masked reset steps", "mean = (adv * mask).sum() / n.clamp(min=1.0)", "mean = adv.mean()", k="ppo_loss"),
    M("ppo_atari_envpool.py", "trunc-bootstrap-dropped", "a truncated game is treated as terminated",
      "return rewards + gamma * next_values * truncated", "return rewards + 0.0 * next_values * truncated",
      k="bootstrap"),
    M("ppo_atari_envpool.py", "trunc-value-of-same-obs", "truncation bootstraps V(s_t) instead of V(s_t+1)",
      "next_values = np.concatenate([values[1:], next_value[None]], axis=0)", "next_values = values",
      k="bootstrap"),
    M("ppo_atari_envpool.py", "reset-mask-inverted", "the loss trains on envpool's reset steps only",
      "mask = 1.0 - dones", "mask = dones", k="norm_adv_scope or real_transitions or smoke"),
    M("ppo_atari_envpool.py", "reset-mask-all-ones", "the loss trains on envpool's reset steps too (CleanRL's way)",
      "mask = 1.0 - dones", "mask = torch.ones_like(dones)", k="norm_adv_scope or real_transitions or smoke"),
    M("ppo_atari_envpool.py", "eval-deterministic-sampled", "deterministic play samples instead of taking the argmax",
      "return self.actor(self.hidden(x)).argmax(-1) if deterministic else self.get_action_and_value(x)[0]",
      "return self.get_action_and_value(x)[0]", k="deterministic or load_policy"),
    M("ppo_atari_envpool.py", "resume-rng-not-restored", "a resumed run does not restore torch's RNG",
      'set_rng_state(ckpt["rng"][rank], device)', '(ckpt["rng"][rank], device)', k="resume"),
    # ppo_llm.py -------------------------------------------------------------------------------------------------
    M("ppo_llm.py", "gae-lambda-ignored", "token-level GAE with lambda = 1",
      "new = delta + gamma * lam * lastgaelam", "new = delta + gamma * lastgaelam", k="gae"),
    M("ppo_llm.py", "grpo-no-std", "grpo never divides by the group std, even with norm_adv_by_std_in_grpo",
      "    if norm_by_std:\n", "    if False:\n", k="grpo"),
    M("ppo_llm.py", "grpo-std-always", "grpo divides by the group std even when told not to (Dr. GRPO)",
      "    if norm_by_std:\n", "    if True:\n", k="grpo"),
    M("ppo_llm.py", "rloo-self-in-baseline", "rloo's baseline includes the response itself (the group mean)",
      "return ((scores * n - mean * n) / (n - 1).clamp(min=1))[:, None] * mask",
      "return (scores - mean)[:, None] * mask", k="rloo"),
    M("ppo_llm.py", "reinforce-no-discount", "REINFORCE(++)'s return-to-go ignores gamma",
      "running = token_rewards[:, t] + gamma * running", "running = token_rewards[:, t] + running", k="reinforce"),
    M("ppo_llm.py", "reinforce-pp-not-whitened", "REINFORCE++ advantages are not whitened over the batch",
      "return masked_whiten(returns, mask) * mask, returns", "return returns * mask, returns", k="reinforce"),
    M("ppo_llm.py", "reinforce-pp-baseline-no-mean", "REINFORCE++-baseline does not subtract the group mean",
      "adv = (scores - mean)[:, None] * mask", "adv = scores[:, None] * mask", k="reinforce"),
    M("ppo_llm.py", "kl-k1-sign", "kl (k1) is log ref - log pi", "return logp - ref_logp\n",
      "return ref_logp - logp\n", k="kl_penalty or kl_low_var"),
    M("ppo_llm.py", "kl-abs-signed", "abs KL keeps the sign", "return (logp - ref_logp).abs()",
      "return (logp - ref_logp)", k="kl_penalty or kl_low_var"),
    M("ppo_llm.py", "kl-k2-no-half", "mse (k2) KL without the 1/2", "return 0.5 * (logp - ref_logp).square()",
      "return (logp - ref_logp).square()", k="kl_penalty or kl_low_var"),
    M("ppo_llm.py", "kl-k3-direction", "low_var_kl (k3) estimates the other direction",
      "kl = (ref_logp - logp).clamp(-20, 20)", "kl = (logp - ref_logp).clamp(-20, 20)",
      k="kl_penalty or kl_low_var"),
    M("ppo_llm.py", "kl-full-reversed", "full KL computes KL(ref || pi) instead of KL(pi || ref)",
      "return (logp.exp() * (logp - ref_logp)).sum(-1)", "return (ref_logp.exp() * (ref_logp - logp)).sum(-1)",
      k="kl_penalty or kl_low_var"),
    M("ppo_llm.py", "agg-token-mean-over-padding", "token-mean also counts the padding tokens",
      "return (loss_mat * mask).sum() / n_tokens", "return (loss_mat * mask).mean()", k="agg_loss"),
    M("ppo_llm.py", "agg-seq-mean-token-sum-by-tokens", "seq-mean-token-sum divides by the tokens, not sequences",
      "return (loss_mat * mask).sum(-1).sum() / n_seqs", "return (loss_mat * mask).sum(-1).sum() / n_tokens",
      k="agg_loss"),
    M("ppo_llm.py", "agg-seq-mean-token-mean-by-max-len", "seq-mean-token-mean divides each sequence by the max length",
      "((loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n_seqs",
      "((loss_mat * mask).sum(-1) / norm_len).sum() / n_seqs", k="agg_loss"),
    M("ppo_llm.py", "agg-sum-norm-by-tokens", "seq-mean-token-sum-norm (Dr. GRPO) divides by the tokens present",
      "return (loss_mat * mask).sum() / (n_seqs * norm_len)", "return (loss_mat * mask).sum() / n_tokens",
      k="agg_loss"),
    M("ppo_llm.py", "pl-min-for-max", "the clipped surrogate takes the optimistic (min) loss",
      "clipped = torch.maximum(loss1, loss2)", "clipped = torch.minimum(loss1, loss2)", k="policy_loss"),
    M("ppo_llm.py", "pl-dual-clip-on-positive", "the dual clip bounds positive advantages instead of negative ones",
      "torch.where(advantages < 0, torch.minimum(clipped, loss3), clipped)",
      "torch.where(advantages > 0, torch.minimum(clipped, loss3), clipped)", k="policy_loss"),
    M("ppo_llm.py", "vl-clip-around-new", "value clipping clips the old value around the new one",
      "vclipped = old_values + (vpreds - old_values).clamp(-value_clip, value_clip)",
      "vclipped = vpreds + (old_values - vpreds).clamp(-value_clip, value_clip)", k="value_loss"),
    M("ppo_llm.py", "resume-kl-coef-not-restored", "a resumed run restarts the adaptive KL coefficient",
      'kl_ctrl.value = float(ckpt["kl_coef"])', 'float(ckpt["kl_coef"])', k="resume"),
    M("ppo_llm.py", "resume-generator-not-restored", "a resumed run does not restore the sampling generator",
      'gen.set_state(ckpt["rng"]["gen"])', '(ckpt["rng"]["gen"])', k="resume"),
]


# --- Applying and running one mutant -----------------------------------------------------------------------------
class TableError(Exception):
    """A mutant whose pattern does not match exactly once: the table needs fixing, nothing was run."""


def mutate(text: str, m: Mutant) -> str:
    n = text.count(m.old)
    if n != 1:
        raise TableError(f"{m.name}: pattern {'not found' if n == 0 else f'ambiguous ({n} matches)'} in {m.script}")
    return text.replace(m.old, m.new, 1)


def tracked_files(root: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def copy_repo(root: str, dest: str, files: list[str] | None = None) -> None:
    """The tracked files as they are in the working tree (a tracked file deleted there is left out)."""
    for rel in tracked_files(root) if files is None else files:
        src = os.path.join(root, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def apply(m: Mutant, repo: str) -> None:
    path = os.path.join(repo, m.script)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(mutate(text, m))


@dataclass
class Result:
    name: str
    status: str  # killed / survived / timeout / error
    seconds: float
    detail: str = ""  # the last lines of pytest's output, or the error
    command: list = field(default_factory=list)


def status_of(returncode: int) -> str:
    """pytest's exit code -> status: 0 passed (survived), 1 tests failed and 2 an error while collecting (the
    mutated script does not import: killed), 5 no test collected, 3/4 pytest's own errors (error)."""
    return {0: "survived", 1: "killed", 2: "killed"}.get(returncode, "error")


LIVE: set = set()  # the pytest process groups running now (ended on Ctrl-C / SIGTERM of this tool)
STOPPING: list = []  # not empty once the tool is stopping: no new pytest starts


def end_live_runs() -> None:
    STOPPING.append(True)
    for pid in list(LIVE):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_selection(repo: str, args: list[str], timeout: float) -> tuple[str, str]:
    # (-o addopts=: one process, without pytest.ini's workers; a selection is a few tests)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", *args]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    if STOPPING:
        return "error", "not run: the tool was stopped"
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout ends the scripts it started
    LIVE.add(proc.pid)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", tail(out)
    finally:
        LIVE.discard(proc.pid)
    status = status_of(proc.returncode)
    if proc.returncode == 5:
        return "error", "no test collected (the selection matches no test)\n" + tail(out)
    return status, tail(out)


def tail(out: str, n: int = 6) -> str:
    return "\n".join((out or "").strip().splitlines()[-n:])


def run_mutant(m: Mutant | None, root: str, timeout: float, args: list[str] | None = None) -> Result:
    """Copy the repository, apply m (None: no mutant, the baseline), run its selection there."""
    start = time.time()
    args = m.pytest_args() if args is None else args
    name = m.name if m else "baseline"
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        try:
            copy_repo(root, tmp)
            if m is not None:
                apply(m, tmp)
        except (TableError, OSError, subprocess.CalledProcessError) as e:
            return Result(name, "error", time.time() - start, str(e))
        status, detail = run_selection(tmp, args, m.timeout if m and m.timeout else timeout)
    return Result(name, status, round(time.time() - start, 1), detail, args)


# --- The report --------------------------------------------------------------------------------------------------
def version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def commit(root: str) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_report(out: str, results: list[Result], table: list[Mutant], meta: dict) -> dict:
    by_name = {m.name: m for m in table}
    killed = sum(r.status == "killed" for r in results)
    report = {**meta, "score": {"killed": killed, "total": len(results), "table_size": len(table)},
              "mutants": [{"name": r.name, "script": by_name[r.name].script, "breaks": by_name[r.name].breaks,
                           "selection": shlex.join(by_name[r.name].pytest_args()), "status": r.status,
                           "seconds": r.seconds, "detail": r.detail} for r in results]}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = ["# Mutation check", "",
             f"**Score: {killed}/{len(results)} killed**" + (f" ({len(results)} of the {len(table)} mutants of the "
                                                             "table ran)" if len(results) < len(table) else ""), "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}",
             f"- hardware: {meta['hardware']['cpu']}, {meta['hardware']['cores']} cores",
             f"- versions: python {meta['versions']['python']}, torch {meta['versions']['torch']}",
             f"- commit: {meta['commit']}", "",
             "A survivor is a missing test: the script's tests pass with that behaviour broken.", "",
             "| mutant | breaks | selection | status | s |", "|---|---|---|---|---|"]
    for r in results:
        m = by_name[r.name]
        lines.append(f"| `{r.name}` | {m.breaks} | `{shlex.join(m.pytest_args())}` | {r.status} | {r.seconds:.0f} |")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return report


# --- Command line ------------------------------------------------------------------------------------------------
def select(table: list[Mutant], only=None, script=None) -> list[Mutant]:
    chosen = [m for m in table if script is None or m.script == script or m.script == f"{script}.py"]
    if only:
        unknown = [o for o in only if not any(o in (m.name, m.id) for m in table)]
        if unknown:
            raise SystemExit(f"error: unknown mutant(s): {', '.join(unknown)} (see --list)")
        chosen = [m for m in chosen if m.name in only or m.id in only]
    return chosen


def main(argv=None, table: list[Mutant] = MUTANTS, root: str = ROOT) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=1, help="mutants run at a time (default 1)")
    p.add_argument("--only", nargs="+", metavar="ID", help="these mutants: script:id, or an id (every script's)")
    p.add_argument("--script", help="the mutants of one script (ppo.py, ppo_llm, ...)")
    p.add_argument("--list", action="store_true", help="print the table and exit")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mutant (default 600)")
    p.add_argument("--baseline", action="store_true",
                   help="first run each selection unmutated; a mutant whose selection fails there is an error")
    p.add_argument("--out", default=os.path.join(root, "benchmarks", "results", "mutants"))
    a = p.parse_args(argv)
    chosen = select(table, a.only, a.script)
    if a.list:
        for m in chosen:
            print(f"{m.name:55s} {m.breaks}\n{'':55s} pytest {shlex.join(m.pytest_args())}")
        print(f"{len(chosen)} mutants")
        return 0
    if not chosen:
        raise SystemExit("error: no mutant selected")
    jobs = max(1, a.jobs)
    meta = {"command": " ".join(["python", "benchmarks/mutants.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "hardware": {"cpu": common.cpu_model(), "cores": os.cpu_count(), "jobs": jobs},
            "versions": {"python": platform.python_version(), "torch": version("torch")},
            "commit": commit(root), "timeout_s": a.timeout}
    broken = {}
    if a.baseline:
        selections = {tuple(m.pytest_args()) for m in chosen}
        with concurrent.futures.ThreadPoolExecutor(jobs) as ex:
            base = dict(zip(selections, ex.map(lambda s: run_mutant(None, root, a.timeout, list(s)), selections)))
        broken = {s: r for s, r in base.items() if r.status != "survived"}
        for s, r in broken.items():
            print(f"baseline {r.status}: pytest {shlex.join(s)}\n{r.detail}", flush=True)
    results: dict[str, Result] = {}

    def one(m: Mutant) -> Result:
        if tuple(m.pytest_args()) in broken:
            return Result(m.name, "error", 0.0, "the unmutated selection does not pass (--baseline)")
        return run_mutant(m, root, a.timeout)

    ex = concurrent.futures.ThreadPoolExecutor(jobs)
    try:
        futures = {ex.submit(one, m): m for m in chosen}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            r = fut.result()
            results[r.name] = r
            print(f"[{i}/{len(chosen)}] {r.status:8s} {r.seconds:6.1f}s  {r.name}", flush=True)
            if r.status in ("error", "timeout"):
                print("    " + r.detail.replace("\n", "\n    "), flush=True)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: no test run left behind, no report of a partial run
        ex.shutdown(wait=False, cancel_futures=True)
        end_live_runs()
        print(f"stopped after {len(results)} of {len(chosen)} mutants; no report written", file=sys.stderr)
        return 130
    ex.shutdown()
    ordered = [results[m.name] for m in chosen]
    report = write_report(a.out, ordered, table, meta)
    s = report["score"]
    survivors = [r.name for r in ordered if r.status == "survived"]
    print(f"score: {s['killed']}/{s['total']} killed" + (f"; survived: {', '.join(survivors)}" if survivors else ""))
    print(f"report: {os.path.join(a.out, 'report.md')}")
    return 0 if s["killed"] == s["total"] else 1


def interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, interrupt)
    sys.exit(main())
