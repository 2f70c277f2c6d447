"""The reading guide names code as `script:function`, `script:Class.method` or `script:# section comment`;
every such reference must exist, so the guide cannot rot silently."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "reading_guide.md")
REF = re.compile(r"`(ppo[a-z_]*\.py):([^`]+)`")


def defined_names(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
    return names


def step_titles(guide: str) -> set[str]:
    """The note's five step names, as the guide states them: `1. **Collect rollout.**` -> `# 1. Collect rollout`."""
    return {f"# {n}. {title}" for n, title in re.findall(r"^(\d)\. \*\*(.+?)\.\*\*", guide, re.M)}


def names_comment(target: str, comment: str, steps: set[str]) -> bool:
    """A `script:# ...` reference names a section comment whole: the comment itself, its heading before a colon,
    comma, semicolon or parenthesis, or a step of the note whose comment goes on (`# 1. Collect rollout with ...`);
    a cut reference (`# 2. Compute adv`, `# Truncation is`) names none."""
    rest = comment[len(target):] if comment.startswith(target) else None
    return rest is not None and (rest == "" or rest[0] in ":,;" or rest.startswith(" (") or target in steps)


def test_guide_exists_and_is_linked_from_readme():
    assert os.path.isfile(GUIDE)
    assert "docs/reading_guide.md" in open(os.path.join(ROOT, "README.md")).read()


def test_every_reference_in_the_guide_exists():
    guide = open(GUIDE).read()
    refs, steps = REF.findall(guide), step_titles(guide)
    assert len(refs) > 50 and len(steps) == 5  # the guide really names code, and states the note's five steps
    missing, names, comments = [], {}, {}
    for script, target in refs:
        if script not in names:  # each script parsed once
            source = open(os.path.join(ROOT, script)).read()
            names[script] = defined_names(source)
            comments[script] = [ln.strip() for ln in source.splitlines() if ln.strip().startswith("#")]
        if target.startswith("#"):
            if not any(names_comment(target, c, steps) for c in comments[script]):
                missing.append(f"{script}:{target}")
        elif target not in names[script]:
            missing.append(f"{script}:{target}")
    assert not missing, missing


def test_checker_catches_a_missing_name():
    assert "compute_gae" in defined_names("def compute_gae():\n    pass\n")
    assert "Agent.get_value" in defined_names("class Agent:\n    def get_value(self):\n        pass\n")
    assert "nope" not in defined_names("def compute_gae():\n    pass\n")


def test_checker_catches_a_cut_section_comment():
    steps = step_titles(open(GUIDE).read())
    assert "# 2. Compute advantages and returns (GAE)" in steps
    for target in ("# Reward", "# Truncation is not termination", "# 2. Compute advantages and returns (GAE)"):
        assert names_comment(target, target, steps)
    assert names_comment("# Reward", "# Reward: each response's score", steps)
    assert names_comment("# 3. Advantage normalisation", "# 3. Advantage normalisation (whitening, ...)", steps)
    assert names_comment("# 1. Collect rollout", "# 1. Collect rollout with pi_old, the policy as it is now", steps)
    for target in ("# 2. Compute advantages", "# Truncation is not", "# Rew", "# 1. Collect roll"):
        comment = {"# Rew": "# Reward: the rule", "# Truncation is not": "# Truncation is not termination: r + ...",
                   "# 1. Collect roll": "# 1. Collect rollout"}.get(target, "# 2. Compute advantages and returns (GAE)")
        assert not names_comment(target, comment, steps), target
    assert not names_comment("# Reward", "# Rewards of the batch", steps)
