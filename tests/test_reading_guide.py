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


def test_guide_exists_and_is_linked_from_readme():
    assert os.path.isfile(GUIDE)
    assert "docs/reading_guide.md" in open(os.path.join(ROOT, "README.md")).read()


def test_every_reference_in_the_guide_exists():
    refs = REF.findall(open(GUIDE).read())
    assert len(refs) > 50  # the guide really names code
    missing, names, comments = [], {}, {}
    for script, target in refs:
        if script not in names:  # each script parsed once
            source = open(os.path.join(ROOT, script)).read()
            names[script] = defined_names(source)
            comments[script] = [ln.strip() for ln in source.splitlines() if ln.strip().startswith("#")]
        if target.startswith("#"):
            if not any(c.startswith(target) for c in comments[script]):
                missing.append(f"{script}:{target}")
        elif target not in names[script]:
            missing.append(f"{script}:{target}")
    assert not missing, missing


def test_checker_catches_a_missing_name():
    assert "compute_gae" in defined_names("def compute_gae():\n    pass\n")
    assert "Agent.get_value" in defined_names("class Agent:\n    def get_value(self):\n        pass\n")
    assert "nope" not in defined_names("def compute_gae():\n    pass\n")
