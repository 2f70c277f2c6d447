"""What a cluster does to a job, tested once for each of the three RL scripts (ppo.py, ppo_continuous.py,
ppo_atari_envpool.py): signals at any moment, name collisions, full disks, damaged or edited checkpoints, dead env
workers, forked children. The scripts stand alone and each carries this machinery; its tests are written here once,
parametrized over a small table of the scripts (SCRIPTS). What only one script has stays in its own test file.

    python -m pytest tests/test_faults.py -q
"""

import dataclasses
import errno
import glob
import os
import re
import signal
import struct
import subprocess
import sys
import time
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/shared.py
import ppo  # noqa: E402
import ppo_atari_envpool  # noqa: E402
import ppo_continuous  # noqa: E402
from shared import FullDisk, copy_run, edited_copy, error_lines, handlers  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Script:
    mod: types.ModuleType
    tiny: dict  # a tiny run's Args but its length (and the flags of the same run: argv)
    batch: int  # the steps of one of its iterations (num_envs * num_steps)
    make_envs: str  # the function its main makes the training envs with
    async_workers: bool = False  # --vector-mode async: gymnasium's worker processes
    mujoco_warning: bool = False  # MuJoCo may print its warning on stderr beside the error line

    @property
    def name(self) -> str:
        return self.mod.__name__

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
    Script(ppo, dict(env_id="CartPole-v1", num_envs=2, num_steps=64), 128, "make_vector_env", async_workers=True),
    Script(ppo_continuous, dict(env_id="Hopper-v5", num_envs=2, num_steps=64, num_minibatches=2, update_epochs=1),
           128, "make_vector_env", async_workers=True, mujoco_warning=True),  # Hopper: short episodes
    Script(ppo_atari_envpool, dict(env_id="Breakout-v5", num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1,
                                   torch_threads=1, num_threads=1), 64, "make_envs"),
]


def over(*needs, scripts=SCRIPTS):
    """Parametrize a test with `s`, each script that has everything in needs (Script's flags)."""
    chosen = [s for s in scripts if all(getattr(s, n) for n in needs)]
    return pytest.mark.parametrize("s", chosen, ids=[s.name for s in chosen])


def cases(table):
    """Parametrize a test with (s, edit, needle) from rows (script names or None for all, edit, needle)."""
    return pytest.mark.parametrize("s,edit,needle", [
        pytest.param(s, edit, needle, id=f"{s.name}-{needle}")
        for names, edit, needle in table for s in SCRIPTS if names is None or s.name in names])


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """stopped(s): the run directory of a run of s stopped after the first of its 2 iterations, trained once per
    script for this file; the tests that resume, edit or damage its checkpoint take a copy (shared.copy_run)."""
    runs = {}

    def get(s):
        if s.name not in runs:
            runs[s.name] = s.mod.main(s.args(tmp_path_factory.mktemp(s.name), 2, stop_after=1))["run_dir"]
        return runs[s.name]

    return get


def resume_error(s, capsys, path) -> tuple:
    """--resume PATH from the command line to main: (exit code, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        s.mod.main(s.mod.parse_args(["--resume", path]))
    return e.value.code, capsys.readouterr().err


def until(p, text: str) -> str:
    """Read p's stdout up to the line that holds text (that line)."""
    line = ""
    while text not in line:
        line = p.stdout.readline()
        assert line, p.stderr.read()
    return line


# --------------------------------------------------------------------------------------------------------------
# Signals: handlers given back, async workers, a signal during setup, the evaluation, the final save, the teardown
# --------------------------------------------------------------------------------------------------------------
@over()
def test_handlers_and_torch_settings_are_restored_when_the_loop_raises(s, tmp_path, monkeypatch):
    seen = []

    def broken_gae(*a, **k):  # the loop runs with torch's deterministic algorithms, then breaks
        seen.append(torch.are_deterministic_algorithms_enabled())
        raise RuntimeError("broken")

    monkeypatch.setattr(s.mod, "compute_gae", broken_gae)
    before = handlers()
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="broken"):
        s.mod.main(s.args(tmp_path, 1))
    assert seen == [True] and handlers() == before and not torch.are_deterministic_algorithms_enabled()


@over("async_workers")
def test_the_spaces_probe_of_an_async_env_leaves_the_main_process_handlers_alone(s):
    """gymnasium calls the first env thunk in the main process to read the spaces; only the workers ignore signals."""
    before = handlers()
    assert s.mod.leave_signals_to_main(lambda: "env")() == "env"
    assert handlers() == before


@over("async_workers")
def test_async_workers_ignore_the_signals_meant_for_the_main_process(s):
    import gymnasium as gym

    class ReportsHandlers(gym.Env):  # says, from its worker process, what SIGINT and SIGTERM do there
        observation_space, action_space = gym.spaces.Box(-1, 1, (1,)), gym.spaces.Box(-1, 1, (1,))

        def handlers(self):
            return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    envs = gym.vector.AsyncVectorEnv([s.mod.leave_signals_to_main(ReportsHandlers)] * 2)
    try:
        assert envs.call("handlers") == ((signal.SIG_IGN, signal.SIG_IGN),) * 2
    finally:
        envs.close()


@over()
def test_a_signal_during_setup_stops_after_the_first_iteration_with_a_checkpoint(s, tmp_path, monkeypatch, capsys):
    real = getattr(s.mod, s.make_envs)

    def make_then_signal(*a, **k):  # SIGTERM arrives while the run is being set up
        envs = real(*a, **k)
        os.kill(os.getpid(), signal.SIGTERM)
        return envs

    monkeypatch.setattr(s.mod, s.make_envs, make_then_signal)
    before = handlers()
    res = s.mod.main(s.args(tmp_path, 2))
    assert res["global_step"] == s.batch and handlers() == before
    assert f"stopped at iteration 1 (SIGTERM); continue with: python {s.name}.py --resume" in capsys.readouterr().out
    assert torch.load(os.path.join(res["run_dir"], "checkpoint.pt"), weights_only=True)["iteration"] == 1


@over()
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_evaluation_saves_the_trained_model_and_stops_cleanly(s, tmp_path, sig):
    p = subprocess.Popen(s.command("--total-timesteps", str(2 * s.batch), "--eval-episodes", "100000", "--runs-dir",
                                   str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path)
    until(p, "iter 2/2")  # the last iteration: the evaluation follows
    time.sleep(1.0)
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "Traceback" not in err, err
    name = signal.Signals(sig).name
    assert f"stopped at the end of the run ({name}); the trained model is in" in out
    assert f"evaluate it with: python {s.name}.py --resume" in out and "--eval-episodes 100000" in out
    (ckpt,) = glob.glob(str(tmp_path / f"{s.env_id}__{s.name}__1__*" / "checkpoint.pt"))
    assert torch.load(ckpt, weights_only=True)["iteration"] == 2  # the trained state, though no --save-model


@over()
def test_a_signal_during_the_final_save_skips_the_evaluation(s, tmp_path, monkeypatch, capsys):
    real = s.mod.save_checkpoint

    def save_and_signal(*a, **k):
        real(*a, **k)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(s.mod, "save_checkpoint", save_and_signal)
    monkeypatch.setattr(s.mod, "evaluate", lambda *a, stop, **k: [] if stop() else pytest.fail("evaluated anyway"))
    res = s.mod.main(s.args(tmp_path, 1, save_model=True, eval_episodes=3))
    out = capsys.readouterr().out
    assert "checkpoint written to" in out and "stopped at the end of the run (SIGTERM)" in out
    assert "eval_returns" not in res


@over()
def test_the_checkpoint_of_a_stop_during_the_evaluation_has_the_rng_of_the_trained_run(s, tmp_path, monkeypatch):
    full = s.mod.main(s.args(tmp_path / "full", 1, save_model=True))
    real = s.mod.evaluate

    def draw_then_signal(*a, **k):  # the evaluation draws random numbers, then a signal comes
        torch.rand(100)
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(s.mod, "evaluate", draw_then_signal)
    stopped = s.mod.main(s.args(tmp_path / "stopped", 1, eval_episodes=3))
    a, b = (torch.load(os.path.join(r["run_dir"], "checkpoint.pt"), weights_only=True) for r in (full, stopped))
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]) and a["iteration"] == b["iteration"] == 1


@over()
def test_a_second_signal_right_after_the_stop_keeps_the_exit_clean(s, tmp_path):
    p = subprocess.Popen(s.command("--total-timesteps", "1e6", "--runs-dir", str(tmp_path)), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert p.stdout.readline().startswith("iter 1/"), p.stderr.read()
    p.send_signal(signal.SIGTERM)
    until(p, "stopped at iteration")
    time.sleep(0.02)  # the teardown has begun; signals keep coming until the process is gone
    deadline = time.time() + 60
    while p.poll() is None and time.time() < deadline:
        p.send_signal(signal.SIGTERM)
        time.sleep(0.02)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, (p.returncode, err)


# --------------------------------------------------------------------------------------------------------------
# The run directory: names taken in the same second, the lock (held by a live process, a forked child), a checkpoint
# rewritten before the lock
# --------------------------------------------------------------------------------------------------------------
@over()
def test_runs_started_in_the_same_second_get_their_own_directories(s, tmp_path):
    now = int(time.time())
    for t in range(now - 1, now + 30):  # the name a run started now would take
        (tmp_path / f"{s.env_id}__t__1__{t}").mkdir()
    res = s.mod.main(s.args(tmp_path, 1, save_model=True))
    assert re.fullmatch(rf"{s.env_id}__t__1__\d+-2", os.path.basename(res["run_dir"])), res["run_dir"]
    assert os.path.isfile(os.path.join(res["run_dir"], "checkpoint.pt"))


@over()
def test_a_run_directory_held_by_a_live_process_is_refused(s, stopped, tmp_path, capsys):
    import fcntl

    ckpt = copy_run(stopped(s), tmp_path)
    run_dir = os.path.dirname(ckpt)
    with open(os.path.join(run_dir, ".lock"), "w") as held:  # another process resumed it already
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242")
        held.flush()
        before = os.stat(ckpt).st_mtime_ns
        code, err = resume_error(s, capsys, ckpt)
        assert code == 2 and s.one_line(err), err
        assert f"run directory {run_dir} is in use by another process (pid 4242)" in err
        assert os.stat(ckpt).st_mtime_ns == before
    assert s.mod.main(s.mod.parse_args(["--resume", ckpt]))["global_step"] == 2 * s.batch  # free again: it resumes


@over()
def test_fits_and_hint_text_read_the_types_of_the_args_fields(s):
    """What a checkpoint's stored args are checked with, against a table (bool is no int; an int is a float)."""
    import typing
    from typing import Literal, Optional

    table = [(1, int, True), (1.0, int, False), (True, int, False), (1, float, True), (2.5, float, True),
             (True, float, False), ("1", float, False), (True, bool, True), (1, bool, False), ("a", str, True),
             (None, str, False), (None, Optional[float], True), (0.5, Optional[float], True),
             ("x", Optional[float], False), ("sync", Literal["sync", "async"], True),
             ("threads", Literal["sync", "async"], False)]
    assert [(v, h) for v, h, want in table if s.mod.fits(v, h) is not want] == []
    hints = typing.get_type_hints(s.mod.Args, include_extras=True)
    assert s.mod.fits(7, hints["num_envs"]) and not s.mod.fits("abc", hints["num_envs"])  # a Count (Annotated int)
    assert not s.mod.fits(7, hints["env_id"]) and s.mod.fits(None, hints["target_kl"])
    assert s.mod.hint_text(hints["num_envs"]) == "int" and s.mod.hint_text(hints["target_kl"]) == "float or None"
    assert s.mod.hint_text(Literal["sync", "async"]) == "one of 'sync', 'async'"


@over()
def test_a_forked_child_does_not_hold_the_run_directory_lock(s, tmp_path):
    import multiprocessing

    fd = s.mod.lock_run_dir(str(tmp_path))
    try:
        ctx = multiprocessing.get_context("fork")

        lock = os.stat(tmp_path / ".lock")

        def child_sees_the_lock() -> None:  # exit 0: closed in the child (an open copy would keep the lock held)
            try:  # (the child may reuse the number for another file: compare what it names)
                st = os.fstat(fd)
                held = (st.st_dev, st.st_ino) == (lock.st_dev, lock.st_ino)
            except OSError:
                held = False
            os._exit(3 if held else 0 if fd not in s.mod.LOCK_FDS else 4)
        child = ctx.Process(target=child_sees_the_lock)
        child.start()
        child.join()
        assert child.exitcode == 0
    finally:
        s.mod.release_lock(fd)
    assert fd not in s.mod.LOCK_FDS


@over()
def test_a_checkpoint_rewritten_between_reading_and_locking_is_refused(s, stopped, tmp_path, monkeypatch, capsys):
    """A requeued job read checkpoint k; before it took the lock, the old job wrote k+1 and ended: resuming k would
    overwrite k+1."""
    ckpt = copy_run(stopped(s), tmp_path)
    real = s.mod.lock_run_dir

    def old_job_writes_first(run_dir):
        torch.save(torch.load(ckpt, weights_only=True), ckpt)  # (stands for the old job's next checkpoint)
        return real(run_dir)

    monkeypatch.setattr(s.mod, "lock_run_dir", old_job_writes_first)
    code, err = resume_error(s, capsys, ckpt)
    assert code == 2 and s.one_line(err), err
    assert "was rewritten by another process while this one started" in err, err


# --------------------------------------------------------------------------------------------------------------
# Full disks: the checkpoint, TensorBoard's events, the evaluation videos
# --------------------------------------------------------------------------------------------------------------
@over()
@pytest.mark.parametrize("good_saves", [0, 1])
def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(s, tmp_path, monkeypatch, capsys, good_saves):
    real, calls = torch.save, []

    def save(obj, f, *a, **k):  # the real torch.save, onto a disk that fills after `good_saves` checkpoints
        calls.append(1)
        return real(obj, f if len(calls) <= good_saves else FullDisk(f, 1000), *a, **k)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(SystemExit) as e:
        s.mod.main(s.args(tmp_path, 1 + good_saves, checkpoint_every=1))
    err = capsys.readouterr().err
    assert e.value.code == 1 and s.one_line(err) and "Traceback" not in err, err
    (run_dir,) = glob.glob(str(tmp_path / f"{s.env_id}__t__*"))
    ckpt = os.path.join(run_dir, "checkpoint.pt")
    assert f"error: cannot write {ckpt}: No space left on device" in err
    assert not os.path.exists(ckpt + ".tmp")  # the partial file is gone
    if good_saves:
        assert f"(last checkpoint kept: {ckpt})" in err
        assert torch.load(ckpt, weights_only=True)["iteration"] == 1
    else:
        assert "(no checkpoint was written)" in err and not os.path.exists(ckpt)


@over()
def test_a_full_disk_under_the_tensorboard_events_is_one_line(s, tmp_path, monkeypatch, capsys):
    from tensorboard.summary.writer import record_writer

    real, writes = record_writer.RecordWriter.write, []

    def write(self, data):
        writes.append(1)
        if len(writes) > 12:  # past the hyperparameters, among the scalars
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    with pytest.raises(SystemExit) as e:
        s.mod.main(s.args(tmp_path, 2))
    err = capsys.readouterr().err
    assert e.value.code == 1 and s.one_line(err) and "Traceback" not in err, err
    assert "error: cannot write the TensorBoard events in" in err and "No space left on device" in err


@over()
def test_a_full_disk_under_the_evaluation_videos_saves_the_model_and_is_one_line(s, tmp_path, monkeypatch, capsys):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(s.mod, "evaluate", full)
    with pytest.raises(SystemExit) as e:
        s.mod.main(s.args(tmp_path, 1, eval_episodes=2))
    err = capsys.readouterr().err
    assert e.value.code == 1 and s.one_line(err) and "Traceback" not in err, err
    assert "cannot write the evaluation videos in" in err and "No space left on device" in err
    (ckpt,) = glob.glob(str(tmp_path / f"{s.env_id}__t__*" / "checkpoint.pt"))
    assert f"(last checkpoint kept: {ckpt})" in err
    assert torch.load(ckpt, weights_only=True)["iteration"] == 1  # the trained state, saved first


# --------------------------------------------------------------------------------------------------------------
# Checkpoints: edited, damaged, states that do not load, read once
# --------------------------------------------------------------------------------------------------------------
ASYNC = ("ppo", "ppo_continuous")  # the scripts with gymnasium's vector envs (--vector-mode, rollout states)


@cases([
    (None, lambda s: s["args"].update(num_envs="abc"), "args.num_envs is 'abc'"),
    (ASYNC, lambda s: s["args"].update(vector_mode="threads"), "args.vector_mode is 'threads'"),
    (("ppo_atari_envpool",), lambda s: s["args"].update(norm_adv_scope="everything"),
     "args.norm_adv_scope is 'everything'"),
    (None, lambda s: s.update(args=list(s["args"])), "args is list, not dict"),
    (None, lambda s: s.pop("args"), "no args"),
    (None, lambda s: s.pop("iteration"), "no iteration"),
    (None, lambda s: s.pop("global_step"), "no global_step"),
    (None, lambda s: s.pop("rng"), "no rng"),
    (ASYNC, lambda s: s["rollout"].pop("envs"), "rollout state of rank 0 lacks"),
    (("ppo_continuous",), lambda s: s["rollout"].pop("reward_ret"), "rollout state of rank 0 lacks"),
    (None, lambda s: s["rng"].update(torch=torch.zeros(7, dtype=torch.uint8)), "RNG state of rank 0"),
    (None, lambda s: s.update(kl_coef="big"), "kl_coef is 'big'"),
    (("ppo",), lambda s: s.update(other_ranks=["rank 1"], world_size=2), "RNG state of rank 1"),
    # ppo_continuous.py's normalisation statistics
    (("ppo_continuous",), lambda s: s.pop("obs_rms"), "no obs_rms"),
    (("ppo_continuous",), lambda s: s["obs_rms"].update(var=-s["obs_rms"]["var"]), "normalisation statistics obs_rms"),
    (("ppo_continuous",), lambda s: s["obs_rms"].update(mean=s["obs_rms"]["mean"][:5]),
     "normalisation statistics obs_rms"),
    (("ppo_continuous",), lambda s: s["return_rms"].update(count=torch.tensor(float("nan"))),
     "normalisation statistics return_rms"),
    (("ppo_continuous",), lambda s: s["return_rms"].update(count=3), "normalisation statistics return_rms"),
])
def test_an_edited_checkpoint_is_one_line_exit_2(s, stopped, tmp_path, capsys, edit, needle):
    code, err = resume_error(s, capsys, edited_copy(stopped(s), tmp_path, edit))
    assert code == 2 and s.one_line(err) and "is damaged or was edited" in err and needle in err, err


def wrong_mujoco_state(s):
    s["rollout"]["envs"][0]["mujoco"]["integration"] = torch.zeros(3, dtype=torch.float64)


def statistics_of_another_env(s):  # a consistent mean and variance, of 5 observations where Hopper has 11
    s["obs_rms"].update(mean=s["obs_rms"]["mean"][:5], var=s["obs_rms"]["var"][:5])


@cases([
    (None, lambda s: s["rng"].update(torch=s["rng"]["torch"].float()), "RNG state"),  # the right size, wrong kind
    (None, lambda s: s["rng"].update(torch=torch.zeros_like(s["rng"]["torch"])), "mt19937"),
    (("ppo",), lambda s: s["rollout"].update(next_obs=torch.zeros(3, 4)), "expected (2, 4)"),
    (("ppo_continuous",), lambda s: s["rollout"].update(next_obs=torch.zeros(3, 11)), "expected (2, 11)"),
    (ASYNC, lambda s: s["rollout"].update(ep_return=[0.0, 0.0]), "expected (2,)"),
    (("ppo_continuous",), lambda s: s["rollout"].update(reward_ret=torch.zeros(3, dtype=torch.float64)),
     "expected (2,)"),
    (ASYNC, lambda s: s["rollout"].update(envs="abc"), "does not fit this run"),
    (("ppo_continuous",), wrong_mujoco_state, "MuJoCo state of size 3"),
    (("ppo_continuous",), lambda s: s["return_rms"].update(mean=torch.zeros(2, dtype=torch.float64),
                                                           var=torch.ones(2, dtype=torch.float64)),
     "statistics of shape (2,), expected ()"),
    (("ppo_continuous",), statistics_of_another_env,
     "does not fit this run: ValueError: normalisation statistics of shape (5,), expected (11,)"),
    (None, lambda s: [st.pop("exp_avg_sq") for st in s["optimizer"]["state"].values()], "moments do not fit"),
    (None, lambda s: [st.update(exp_avg=torch.zeros(1)) for st in s["optimizer"]["state"].values()],
     "moments do not fit"),
    (("ppo_atari_envpool",), lambda s: [st.pop("step") for st in s["optimizer"]["state"].values()],
     "does not fit this run"),
    (None, lambda s: s.update(kl_coef=-1.0), "kl_coef is -1.0, not a positive number"),
    (None, lambda s: s.update(iteration=-3), "iteration is -3"),
    (("ppo_continuous",), lambda s: s.update(global_step=-1), "global_step is -1"),
    (("ppo_atari_envpool",), lambda s: s.update(global_step=-64), "global_step is -64"),
])
def test_a_checkpoint_whose_states_do_not_load_is_one_line_exit_2(s, stopped, tmp_path, capsys, edit, needle):
    path = edited_copy(stopped(s), tmp_path, edit)
    events = glob.glob(os.path.join(os.path.dirname(path), "events.out.tfevents.*"))
    code, err = resume_error(s, capsys, path)
    assert code == 2 and s.one_line(err) and needle in err and "Traceback" not in err, err
    assert glob.glob(os.path.join(os.path.dirname(path), "events.out.tfevents.*")) == events  # restored first


@over()
def test_a_flipped_bit_in_a_stored_weight_is_found(s, stopped, tmp_path, capsys):
    import zipfile

    path = copy_run(stopped(s), tmp_path)
    data = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", bytes(data[info.header_offset + 26:info.header_offset + 30]))
    start = info.header_offset + 30 + name_len + extra_len  # the record's bytes (after its local header)
    data[start + info.file_size // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    assert torch.load(path, weights_only=True)["iteration"] == 1  # torch itself loads it silently
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        s.mod.parse_args(["--resume", path])
    err = capsys.readouterr().err
    assert e.value.code == 2 and s.one_line(err) and "is damaged" in err and "CRC" in err, err


@over()
def test_a_checkpoint_is_read_once_and_not_kept_after_main_took_it(s, tmp_path, monkeypatch):
    """parse_args reads it for the flags, main takes it over; it is not kept after that (the optimizer's state shares
    its tensors, and training changes them)."""
    first = s.mod.main(s.args(tmp_path, 1, checkpoint_every=1))  # a finished run: nothing rewrites its checkpoint
    ckpt = os.path.join(first["run_dir"], "checkpoint.pt")  # (--save-model would, and so read it anew: a new key)
    reads, real = [], s.mod.read_checkpoint
    monkeypatch.setattr(s.mod, "read_checkpoint", lambda path: reads.append(path) or real(path))
    args = s.mod.parse_args(["--resume", ckpt])
    s.mod.main(args)
    assert len(reads) == 1
    s.mod.main(args)
    assert len(reads) == 2


@over()
def test_the_nan_stop_says_when_no_checkpoint_exists(s, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(s.mod, "compute_gae", lambda *a, **k: (a[0] * float("nan"), a[1]))  # (torch or numpy)
    with pytest.raises(SystemExit) as e:
        s.mod.main(s.args(tmp_path, 1))
    err = capsys.readouterr().err
    assert e.value.code == 1 and "at iteration 1; stopping (no checkpoint was written)" in err, err


# --------------------------------------------------------------------------------------------------------------
# The machine: a dead env worker, more local processes than GPUs
# --------------------------------------------------------------------------------------------------------------
@over("async_workers")
def test_a_dead_env_worker_ends_the_run_in_one_line_instead_of_hanging(s, tmp_path):
    """An async worker killed (the OOM killer, say): the main process must not wait on it forever at the exit."""
    p = subprocess.Popen(s.command("--total-timesteps", "1e7", "--vector-mode", "async", "--runs-dir", str(tmp_path)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert p.stdout.readline().startswith("iter 1/"), p.stderr.read()
    workers = [int(c) for c in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
    os.kill(workers[0], signal.SIGKILL)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "Traceback" not in err, err
    assert "error: an environment worker process died" in err and err.count("error:") == 1 and s.one_line(err), err


@over()
def test_more_local_processes_than_gpus_is_one_line_error(s, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        s.mod.parse_args(["--cuda"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "--cuda with 2 processes on this machine but 1 GPU(s)" in err
