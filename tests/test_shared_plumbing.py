"""The three RL scripts stand alone, so each carries its own copy of the plumbing below its banner. A helper that does
the same job in each is the same text in each: this test compares their source, so that the copies cannot drift
apart (a fix made in one script and not in the others fails here). ppo_llm.py marks the few it copies from ppo.py."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("ppo.py", "ppo_continuous.py", "ppo_atari_envpool.py")
SHARED = (
    "Failure", "setup_distributed", "all_ranks_mean", "gather_objects", "set_torch_determinism", "make_run_dir",
    "open_logs", "StopSignals", "check_finite", "eta_text", "explained_variance", "launcher", "save_checkpoint",
    "load_checkpoint", "checkpoint_fits", "first_line", "rng_state", "set_rng_state", "load_optimizer_state",
    "compile_hot_functions", "execution_path", "compile_or_fail", "cuda_graphed", "parse_count", "Count", "parse_args",
    "iteration_stats", "close_run",
)
# Below the banner, in all three scripts under the same name, and different on purpose:
DIFFERENT = {
    "SCRIPT": "the script's own file name, in its messages and checkpoints",
    "save_state": "what a checkpoint holds besides the learner: episodes in flight (ppo.py, MuJoCo's states too),"
                  " normalisation statistics (continuous), nothing of envpool's games (Atari)",
    "check_resume": "what must match to resume: the normalisation switches (continuous); Atari says its games restart",
    "log_iteration": "each script's extra metrics and its progress line (Atari counts whole games)",
    "evaluate": "gymnasium (with the saved normalisation statistics in continuous) or envpool",
    "log_evaluation": "episodes or whole games (Atari)",
    "load_policy": "each script's Agent, spaces and observation preprocessing",
    "validate": "each script's flags and environments",
}


def definitions(script: str, parsed: bool = False) -> dict:
    """Top-level functions, classes and assignments of a script (or of source text): name -> source text."""
    if parsed:
        src = script
    else:
        with open(os.path.join(ROOT, script)) as f:
            src = f.read()
    out, lines = {}, src.splitlines(keepends=True)

    def text(node) -> str:  # its whole lines (ast.get_source_segment splits the file again at every call: slow)
        return "".join(lines[node.lineno - 1:node.end_lineno])
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = text(node)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = text(node)
    return out


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_helper_is_the_same_text_in_the_three_scripts(name):
    texts = {script: definitions(script).get(name) for script in SCRIPTS}
    assert all(texts.values()), f"{name} is missing from {[s for s, t in texts.items() if not t]}"
    first = texts[SCRIPTS[0]]
    assert all(t == first for t in texts.values()), f"{name} differs: " + ", ".join(
        s for s, t in texts.items() if t != first)


def test_every_helper_below_the_banner_in_all_three_is_shared_or_named_as_different():
    below = []
    for script in SCRIPTS:
        with open(os.path.join(ROOT, script)) as f:
            src = f.read()
        banner = src.index("# Plumbing: nothing below this line")
        below.append(set(definitions(src[banner:], parsed=True)))
    unclassified = set.intersection(*below) - set(SHARED) - set(DIFFERENT)
    assert not unclassified, f"add these to SHARED (the same text) or DIFFERENT (with the reason): {unclassified}"


def test_the_error_boundary_is_the_same_text():
    tails = set()
    for script in SCRIPTS:
        with open(os.path.join(ROOT, script)) as f:
            src = f.read()
        tails.add(src[src.rindex('\nif __name__ == "__main__":'):])  # (the last: Atari sets OMP_WAIT_POLICY at the top)
    assert len(tails) == 1


@pytest.mark.parametrize("name", ["compute_gae", "say_stopped"])  # GAE on the host; the line of a stopped run
def test_a_helper_of_the_continuous_and_atari_scripts_is_the_same_text(name):
    assert definitions("ppo_continuous.py")[name] == definitions("ppo_atari_envpool.py")[name]


def test_the_wrapper_walk_of_the_episodes_in_flight_is_the_same_text_in_ppo_and_continuous():
    assert definitions("ppo.py")["wrapper_layers"] == definitions("ppo_continuous.py")["wrapper_layers"]


def test_the_comparison_can_fail():
    a, b = definitions("ppo.py"), definitions("ppo_continuous.py")
    assert a["Args"] != b["Args"]  # a helper that differs is seen as different


def test_the_helpers_ppo_llm_marks_shared_are_ppo_py_text():
    with open(os.path.join(ROOT, "ppo_llm.py")) as f:
        llm = definitions(f.read(), parsed=True)
    rl = definitions("ppo.py")
    marked = [n for n, text in llm.items() if "# [SHARED]" in text.splitlines()[0]]
    assert len(marked) >= 3, marked  # Failure, StopSignals, eta_text, ...
    assert [n for n in marked if llm[n] != rl.get(n)] == [], "ppo_llm.py's copy differs from ppo.py's"
