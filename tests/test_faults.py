"""The guarantees a user meets when a run is stopped, a disk fills or a checkpoint is wrong, tested once for each of
the three RL scripts over a table of the scripts (SCRIPTS). What only one script has stays in its own test file.

    python -m pytest tests/test_faults.py -q            # all rows;  -k ppo-  (or ppo_continuous-, ...) for one

What a row (Script) needs from its script (module name `name`, imported when a test of the row runs):
- Args with the fields env_id, num_envs, num_steps, total_timesteps, runs_dir, exp_name, seed, save_model,
  checkpoint_every, stop_after, eval_episodes, resume, cuda; `tiny` holds a run small enough for these tests and `batch`
  the environment steps of one of its iterations; `other_env` an env id the script takes but its checkpoint does not.
- main(args) -> dict with "run_dir" and "global_step" ("eval_returns" after an evaluation); parse_args(argv);
  class Failure(Exception) with .code (2: bad input / a checkpoint that does not fit, 1: a failed write / non-finite
  update), which main and parse_args raise and `__main__` prints as "error: <message>" (one line) before sys.exit;
  make_run_dir(args, rank, world); compute_gae (called once in each iteration, with the signal handlers on); evaluate(..., stop=callable) called by main after the final save;
  save_checkpoint, which writes through torch.save (a patched torch.save fills the disk here).
- The words of the [SHARED] helpers of /work/rl_core.py, and in main:
  "stopped at iteration N (SIGTERM); continue with: python SCRIPT --resume PATH" after a stop by a signal, and
  "stopped during the evaluation (SIGTERM); the trained model is in PATH" after a signal during --eval-episodes.
- The checkpoint layout of the brief: script, env_id, args, model, optimizer, iteration, global_step, kl_coef,
  world_size, rng (one entry per rank), and the script's own states.
`mujoco_warning`: MuJoCo may print its deprecation warning on stderr beside the error line (ppo_continuous.py).
"""

import dataclasses
import glob
import importlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/shared.py
from shared import FullDisk, copy_run, edited_copy, error_lines, handlers  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@dataclasses.dataclass(frozen=True)
class Script:
    name: str  # the module (the script's file name without .py)
    tiny: dict  # a tiny run's Args but its length (and the flags of the same run: command)
    batch: int  # the environment steps of one of its iterations (num_envs * num_steps)
    other_env: str  # an env id the script trains on, which its tiny run's checkpoint does not fit
    mujoco_warning: bool = False  # MuJoCo may print its warning on stderr beside the error line

    @property
    def mod(self):
        return importlib.import_module(self.name)

    @property
    def env_id(self) -> str:
        return self.tiny["env_id"]

    def args(self, tmp_path, iterations: int, **kw):
        """The tiny run's Args, `iterations` iterations long, its runs under tmp_path (named ENV__t__1__TIME)."""
        return self.mod.Args(**{**self.tiny, "total_timesteps": iterations * self.batch, "runs_dir": str(tmp_path),
                                "exp_name": "t", **kw})

    def command(self, *argv) -> list:
        """The tiny run as a command line (the runs named ENV__SCRIPT__1__TIME), argv added."""
        flags = [x for k, v in self.tiny.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        return [sys.executable, os.path.join(ROOT, f"{self.name}.py"), *flags, *argv]

    def one_line(self, err: str) -> bool:
        """stderr holds one line (and, for ppo_continuous.py, MuJoCo's warning beside it)."""
        return len(error_lines(err)) == 1 if self.mujoco_warning else err.count("\n") == 1


SCRIPTS = [
    Script("ppo", dict(env_id="CartPole-v1", num_envs=2, num_steps=64), 128, "Acrobot-v1"),
    Script("ppo_continuous", dict(env_id="Hopper-v5", num_envs=2, num_steps=64, num_minibatches=2, update_epochs=1),
           128, "Walker2d-v5", mujoco_warning=True),  # Hopper: short episodes
    Script("ppo_atari_envpool", dict(env_id="Breakout-v5", num_envs=2, num_steps=32, num_minibatches=2,
                                     update_epochs=1, torch_threads=1, num_threads=1), 64, "Pong-v5"),
]
over = pytest.mark.parametrize("s", SCRIPTS, ids=[f"{s.name}-" for s in SCRIPTS])  # -k ppo- picks ppo.py's row


def cases(table):
    """Parametrize a test with (s, case, ...) for each script and each row of the table (the row's first item: its
    id; the rest: its parameters)."""
    return pytest.mark.parametrize("s,case", [pytest.param(s, row, id=f"{s.name}-{row[0]}")
                                               for s in SCRIPTS for row in table])


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """stopped(s): the run directory of a run of s stopped (--stop-after 1) after the first of its 2 iterations,
    trained once per script for this file; the tests that resume, edit or damage its checkpoint take a copy."""
    runs = {}

    def get(s):
        if s.name not in runs:
            runs[s.name] = s.mod.main(s.args(tmp_path_factory.mktemp(s.name), 2, stop_after=1))["run_dir"]
        return runs[s.name]

    return get


def failure(s, call):
    """The Failure that call() raises: (its exit code, its message)."""
    with pytest.raises(s.mod.Failure) as e:
        call()
    return e.value.code, str(e.value)


def checkpoint(run_dir: str) -> dict:
    return torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)


# --------------------------------------------------------------------------------------------------------------
# SIGTERM / Ctrl-C: the iteration ends, the checkpoint is written, the command that continues is printed; during
# --eval-episodes the trained model is on disk first; the handlers are given back
# --------------------------------------------------------------------------------------------------------------
@over
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_after_the_iteration_with_a_checkpoint_and_the_command_that_continues(
        s, tmp_path, monkeypatch, capsys, sig):
    real = s.mod.compute_gae

    def signal_then_gae(*a, **k):  # the signal arrives in the middle of the first iteration
        os.kill(os.getpid(), sig)
        return real(*a, **k)

    monkeypatch.setattr(s.mod, "compute_gae", signal_then_gae)
    before = handlers()
    res = s.mod.main(s.args(tmp_path, 3))
    ckpt = os.path.join(res["run_dir"], "checkpoint.pt")
    assert res["global_step"] == s.batch and handlers() == before
    out = capsys.readouterr().out
    assert f"stopped at iteration 1 ({sig.name}); continue with: python {s.name}.py --resume {ckpt}" in out, out
    state = checkpoint(res["run_dir"])
    assert state["iteration"] == 1 and state["global_step"] == s.batch and state["script"] == f"{s.name}.py"


@over
def test_a_signal_during_the_evaluation_stops_it_with_the_trained_model_on_disk_first(s, tmp_path, monkeypatch,
                                                                                       capsys):
    real, seen = s.mod.evaluate, []

    def signal_then_evaluate(*a, **k):
        (ckpt,) = glob.glob(str(tmp_path / "*" / "checkpoint.pt"))
        seen.append(torch.load(ckpt, weights_only=True)["iteration"])  # on disk before the evaluation starts
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)  # which stops at its first look at stop()

    monkeypatch.setattr(s.mod, "evaluate", signal_then_evaluate)
    before = handlers()
    res = s.mod.main(s.args(tmp_path, 1, eval_episodes=100_000))  # (without --save-model)
    assert seen == [1] and handlers() == before and "eval_returns" not in res
    ckpt = os.path.join(res["run_dir"], "checkpoint.pt")
    assert f"stopped during the evaluation (SIGTERM); the trained model is in {ckpt}" in capsys.readouterr().out


@over
def test_ctrl_c_on_the_command_line_checkpoints_and_exits_0(s, tmp_path):
    """As a terminal's Ctrl-C: SIGINT to the whole process group, once the first iteration is out."""
    p = subprocess.Popen(s.command("--total-timesteps", "1e7", "--runs-dir", str(tmp_path)), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=ENV, start_new_session=True)
    first = p.stdout.readline()
    assert first.startswith("iter 1/"), first + p.stderr.read()
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "Traceback" not in err, err
    (ckpt,) = glob.glob(str(tmp_path / "*" / "checkpoint.pt"))
    assert f"(SIGINT); continue with: python {s.name}.py --resume {ckpt}" in out, out
    state = torch.load(ckpt, weights_only=True)
    assert state["global_step"] == state["iteration"] * s.batch > 0


@over
def test_ctrl_c_before_the_loop_is_exit_130_without_a_traceback(s, tmp_path):
    """A Ctrl-C while the run starts (here: a SIGINT sent where main seeds torch) ends it quietly, nothing to save
    yet (the handlers that defer a signal to the end of an iteration come on just before the loop)."""
    cmd = s.command("--runs-dir", str(tmp_path))
    code = ("import os, runpy, signal, sys, torch\nseed = torch.manual_seed\n"
            "def interrupted(*a):\n    os.kill(os.getpid(), signal.SIGINT)\n    return seed(*a)\n"
            f"torch.manual_seed = interrupted\nsys.argv = {cmd[1:]!r}\nrunpy.run_path({cmd[1]!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=120)
    assert p.returncode == 130 and "Traceback" not in p.stderr, p.stderr[-2000:]


@over
def test_the_handlers_are_given_back_when_main_returns_or_raises(s, tmp_path, monkeypatch):
    before = handlers()
    s.mod.main(s.args(tmp_path / "ok", 1))
    assert handlers() == before

    def broken_gae(*a, **k):
        assert handlers() != before  # (main's own handlers were on)
        raise RuntimeError("broken")

    monkeypatch.setattr(s.mod, "compute_gae", broken_gae)
    with pytest.raises(RuntimeError, match="broken"):
        s.mod.main(s.args(tmp_path / "raises", 1))
    assert handlers() == before


# --------------------------------------------------------------------------------------------------------------
# Writing: a full disk (one line, exit 1, no partial file, the previous checkpoint intact); a run directory per run
# --------------------------------------------------------------------------------------------------------------
@over
@pytest.mark.parametrize("good_saves", [0, 1])
def test_a_full_disk_is_one_line_exit_1_and_keeps_the_previous_checkpoint(s, tmp_path, monkeypatch, good_saves):
    real, calls = torch.save, []

    def save(obj, f, *a, **k):  # the real torch.save, onto a disk that fills after `good_saves` checkpoints
        calls.append(1)
        return real(obj, f if len(calls) <= good_saves else FullDisk(f, 1000), *a, **k)

    monkeypatch.setattr(torch, "save", save)
    code, msg = failure(s, lambda: s.mod.main(s.args(tmp_path, 1 + good_saves, checkpoint_every=1)))
    (run_dir,) = glob.glob(str(tmp_path / f"{s.env_id}__t__*"))
    ckpt = os.path.join(run_dir, "checkpoint.pt")
    assert code == 1 and "\n" not in msg and msg.startswith(f"cannot write {ckpt}: No space left on device"), msg
    assert not os.path.exists(ckpt + ".tmp")  # the partial file is gone
    if good_saves:
        assert msg.endswith("(the previous checkpoint is kept)"), msg
        assert torch.load(ckpt, weights_only=True)["iteration"] == 1
    else:
        assert msg.endswith("(no checkpoint was written)") and not os.path.exists(ckpt), msg


@over
def test_a_full_disk_on_the_command_line_is_one_line_exit_1(s, tmp_path):
    """A file-size limit stands for the full disk (a write past it fails with EFBIG), under the real __main__."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    r = subprocess.run(s.command("--total-timesteps", str(s.batch), "--save-model", "--runs-dir", str(tmp_path)),
                       capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=240, preexec_fn=small_files)
    assert r.returncode == 1 and s.one_line(r.stderr) and "Traceback" not in r.stderr, r.stderr
    (line,) = error_lines(r.stderr)
    assert line.startswith("error: cannot write ") and "checkpoint.pt: File too large" in line, line
    assert not glob.glob(str(tmp_path / "*" / "checkpoint.pt*"))  # no partial file


@over
def test_runs_started_in_the_same_second_get_two_directories(s, tmp_path, monkeypatch):
    args = s.args(tmp_path, 1)
    monkeypatch.setattr(time, "time", lambda: 1_000_000_000.5)
    a, b = s.mod.make_run_dir(args, 0, 1), s.mod.make_run_dir(args, 0, 1)
    assert a != b and os.path.isdir(a) and os.path.isdir(b)
    assert os.path.basename(b) == f"{os.path.basename(a)}-2"


# --------------------------------------------------------------------------------------------------------------
# Checkpoints that do not load or do not fit: one line, exit 2, nothing trained or logged
# --------------------------------------------------------------------------------------------------------------
def truncated(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def garbage(path):
    open(path, "wb").write(b"not a checkpoint")


def edit(change):
    return lambda path: edited_copy_in_place(path, change)


def edited_copy_in_place(path, change):
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


@cases([
    ("damaged", truncated, [], "cannot read checkpoint"),
    ("not-a-checkpoint", garbage, [], "cannot read checkpoint"),
    ("another-scripts", edit(lambda st: st.update(script="ppo_other.py")), [], "checkpoint"),
    ("another-env", None, ["--env-id", "OTHER"], ""),
    ("edited-args-type", edit(lambda st: st["args"].update(num_envs="abc")), [], ""),
    ("edited-args-unknown", edit(lambda st: st["args"].update(num_envs=None)), [], ""),
    ("no-args", edit(lambda st: st.pop("args")), [], ""),
    ("no-model", edit(lambda st: st.pop("model")), [], ""),
    ("model-of-other-shapes", edit(lambda st: st["model"].update({k: v[..., :1] for k, v in st["model"].items()})),
     [], "does not fit"),
    ("no-rng", edit(lambda st: st.pop("rng")), [], ""),
    ("rng-of-the-wrong-kind", edit(lambda st: st.update(rng=[{"torch": torch.zeros(7)}] * len(st["rng"]))), [], ""),
])
def test_a_checkpoint_that_does_not_load_or_fit_is_one_line_exit_2(s, case, stopped, tmp_path):
    _, damage, argv, needle = case
    path = copy_run(stopped(s), tmp_path)
    if damage:
        damage(path)
    argv = [a.replace("OTHER", s.other_env) for a in argv]
    events = sorted(glob.glob(os.path.join(os.path.dirname(path), "events.out.tfevents.*")))
    before = open(path, "rb").read()
    code, msg = failure(s, lambda: s.mod.main(s.mod.parse_args(["--resume", path, *argv])))
    assert code == 2 and "\n" not in msg and needle in msg and path in msg, msg
    assert open(path, "rb").read() == before  # nothing written,
    assert sorted(glob.glob(os.path.join(os.path.dirname(path), "events.out.tfevents.*"))) == events  # nor logged


@over
def test_a_checkpoint_that_does_not_fit_is_one_line_exit_2_on_the_command_line(s, stopped, tmp_path):
    path = edited_copy(stopped(s), tmp_path, lambda st: st.update(script="ppo_other.py"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, f"{s.name}.py"), "--resume", path], capture_output=True,
                       text=True, cwd=tmp_path, env=ENV, timeout=240)
    assert r.returncode == 2 and s.one_line(r.stderr) and "Traceback" not in r.stderr, r.stderr
    assert error_lines(r.stderr)[0] == f"error: {path} is not a {s.name}.py checkpoint", r.stderr


@over
def test_the_stopped_run_resumes_from_its_copy(s, stopped, tmp_path):
    """(the checkpoints the tests above damage are good before the damage)"""
    res = s.mod.main(s.mod.parse_args(["--resume", copy_run(stopped(s), tmp_path)]))
    assert res["global_step"] == 2 * s.batch and checkpoint(res["run_dir"])["iteration"] == 2


# --------------------------------------------------------------------------------------------------------------
# Bad command-line values: one line, exit 2, nothing written (tyro's own parse errors: exit 2, nothing written)
# --------------------------------------------------------------------------------------------------------------
@cases([
    ("num-envs-0", ["--num-envs", "0"], "--num-envs"),
    ("num-steps-negative", ["--num-steps", "-5"], "--num-steps"),
    ("learning-rate-nan", ["--learning-rate", "nan"], "--learning-rate"),
    ("num-minibatches-not-dividing", ["--num-envs", "2", "--num-steps", "64", "--num-minibatches", "3"],
     "--num-minibatches"),
    ("total-timesteps-under-one-rollout", ["--num-envs", "2", "--num-steps", "64", "--total-timesteps", "100"],
     "--total-timesteps"),
    ("unknown-env", ["--env-id", "NoSuchEnv-v9"], "NoSuchEnv-v9"),
    ("cuda-without-a-gpu", ["--cuda"], "--cuda"),
    ("no-such-checkpoint", ["--resume", "/nonexistent/checkpoint.pt"], "/nonexistent/checkpoint.pt"),
])
def test_bad_values_are_one_line_exit_2_and_nothing_written(s, case, tmp_path, monkeypatch):
    _, argv, needle = case
    if "--cuda" in argv:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    code, msg = failure(s, lambda: s.mod.main(s.mod.parse_args([*argv, "--runs-dir", str(tmp_path / "runs")])))
    assert code == 2 and "\n" not in msg and needle in msg, msg
    assert not (tmp_path / "runs").exists()


@over
def test_bad_values_on_the_command_line_are_one_line_exit_2_and_tyros_errors_stay_tyros(s, tmp_path):
    for argv, one_line in [(["--num-envs", "0"], True), (["--num-envs", "abc"], False)]:
        r = subprocess.run(s.command(*argv, "--runs-dir", str(tmp_path / "runs")), capture_output=True, text=True,
                           cwd=tmp_path, env=ENV, timeout=240)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        if one_line:
            assert s.one_line(r.stderr) and error_lines(r.stderr)[0].startswith("error: --num-envs"), r.stderr
        else:
            assert "abc" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------------------------
# A non-finite update stops the run with a message, exit 1, before it is logged or saved
# --------------------------------------------------------------------------------------------------------------
@over
def test_a_non_finite_update_stops_with_a_message_exit_1(s, tmp_path, monkeypatch):
    calls, real = [], s.mod.compute_gae

    def poisoned(*a, **k):  # the second iteration's advantages are NaN (torch or numpy)
        calls.append(1)
        adv, ret = real(*a, **k)
        return (adv * float("nan"), ret) if len(calls) == 2 else (adv, ret)

    monkeypatch.setattr(s.mod, "compute_gae", poisoned)
    code, msg = failure(s, lambda: s.mod.main(s.args(tmp_path, 3, checkpoint_every=1, save_model=True)))
    (ckpt,) = glob.glob(str(tmp_path / "*" / "checkpoint.pt"))
    assert code == 1 and "\n" not in msg and "non-finite" in msg and "at iteration 2" in msg, msg
    assert ckpt in msg, msg  # where the last good state is
    state = torch.load(ckpt, weights_only=True)
    assert state["iteration"] == 1 and all(torch.isfinite(v).all() for v in state["model"].values())
