"""What the tests of more than one script share: slow, obviously correct references (plain Python floats), a helper
that runs a script the way a user does, a file that fills as a full disk does, and what the tests of a damaged or
interrupted run look at (signal handlers, stderr's lines, copies of a stopped run)."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import time


def reference_gae(rewards, values, dones, next_value, next_done, gamma, lam):
    """A_t = sum_l (gamma*lam)^l delta_{t+l}, summed forward until the episode ends (plain Python floats)."""
    T, N = len(rewards), len(rewards[0])
    # episode_over[t][i]: the transition at t is the last of its episode
    over = [[(dones[t + 1][i] if t + 1 < T else next_done[i]) for i in range(N)] for t in range(T)]
    v_next = [[(values[t + 1][i] if t + 1 < T else next_value[i]) for i in range(N)] for t in range(T)]
    adv = [[0.0] * N for _ in range(T)]
    for i in range(N):
        for t in range(T):
            total, weight = 0.0, 1.0
            for k in range(t, T):
                delta = rewards[k][i] + (0.0 if over[k][i] else gamma * v_next[k][i]) - values[k][i]
                total += weight * delta
                if over[k][i]:
                    break
                weight *= gamma * lam
            adv[t][i] = total
    return adv


def ctrl_c_after_first_iteration(argv: list, cwd) -> tuple:
    """Run `python *argv` in a process group of its own and, once its first progress line is out, send SIGINT to the
    whole group, as a terminal's Ctrl-C does. Returns (exit code, stdout after the first line, stderr)."""
    p = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         start_new_session=True)
    first = p.stdout.readline()
    assert first.startswith("iter 1/"), first + p.stderr.read()
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err


class FullDisk:
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, b):
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)


def handlers() -> tuple:
    """The process's SIGTERM and SIGINT handlers (a run must give them back as it found them)."""
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


# MuJoCo 4.0 prints this deprecation warning (and a blank line) on stderr whenever it compiles gymnasium's model
# files, which ppo_continuous.py does for the env checks that need a made env; it is not ours and not part of the error.
MUJOCO_WARNING = "WARNING: compiler attribute 'settotalmass' is deprecated"


def error_lines(stderr: str) -> list:
    """stderr's lines, without blank ones and MuJoCo's warning."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(MUJOCO_WARNING)]


def copy_run(run_dir: str, tmp_path) -> str:
    """A copy of a run directory (its checkpoint and logs) under tmp_path: the path of the copy's checkpoint."""
    return os.path.join(shutil.copytree(run_dir, tmp_path / os.path.basename(run_dir)), "checkpoint.pt")


def edited_copy(run_dir: str, tmp_path, edit) -> str:
    """copy_run, with edit(state) applied to the copy's checkpoint."""
    import torch

    path = copy_run(run_dir, tmp_path)
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    return path


def stand_in_for_cuda_graphs(monkeypatch, events: list) -> None:
    """torch.cuda's streams and graphs stood in for on the CPU, to test a capturing helper's dispatch: a "capture" runs
    its body once between the events "capture" and "captured", a replay runs nothing and adds "replay", a generator's
    registration adds ("register", generator). The real ones: tests/test_gpu.py."""
    import contextlib
    import types

    import torch

    @contextlib.contextmanager
    def capturing(graph):
        events.append("capture")
        yield
        events.append("captured")

    def new_graph():
        return types.SimpleNamespace(replay=lambda: events.append("replay"),
                                     register_generator_state=lambda g: events.append(("register", g)))
    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", new_graph)
    monkeypatch.setattr(torch.cuda, "graph", capturing)
