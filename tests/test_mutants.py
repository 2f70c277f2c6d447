"""Tests of benchmarks/mutants.py, the tool itself (not a mutation run: that is `python benchmarks/mutants.py`).

test_every_mutant_matches_exactly_once_in_its_script is there to fail when a rewrite of a script moves or changes
the code a mutant targets: then update that mutant's old/new text in the table (benchmarks/mutants.py, MUTANTS) to
the new code, keeping the behaviour it breaks."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import mutants  # noqa: E402  (benchmarks/mutants.py)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def enclosing_block(text, pos):
    """The top-level def or class around pos (compiling it alone is cheaper than compiling the whole script)."""
    starts = [mt.start() for mt in re.finditer(r"^(?:def |class |async def |@)", text, re.M)] + [len(text)]
    begin = max([s for s in starts if s <= pos], default=0)
    return text[begin:min(s for s in starts if s > pos)]


def test_every_mutant_matches_exactly_once_in_its_script():
    problems = []
    for m in mutants.MUTANTS:
        text = read(os.path.join(ROOT, m.script))
        n = text.count(m.old)
        if n != 1:
            problems.append(f"{m.name}: {'not found' if n == 0 else f'{n} matches'}: {m.old!r}")
            continue
        try:  # the mutated script is still Python: a kill must come from a test, not from a syntax error
            compile(enclosing_block(mutants.mutate(text, m), text.index(m.old)), m.script, "exec")
        except SyntaxError as e:
            problems.append(f"{m.name}: the mutated script does not compile: {e}")
    assert not problems, "mutants to update in benchmarks/mutants.py:\n" + "\n".join(problems)


def test_the_table_names_each_mutant_once_and_its_tests_exist():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))
    for m in mutants.MUTANTS:
        assert m.breaks and m.old != m.new and re.fullmatch(r"[a-z0-9-]+", m.id), m.name
        test_names = []
        for f in m.test_files:
            test_names += re.findall(r"^def (test_\w+)", read(os.path.join(ROOT, f)), re.M)
        # every word of the -k expression names some test of the selection (a typo would collect nothing)
        for word in re.findall(r"\w+", m.k or ""):
            assert word in ("and", "or", "not") or any(word in t for t in test_names), (m.name, word)


def test_mutate_refuses_a_pattern_found_twice_or_not_at_all():
    m = mutants.M("x.py", "a", "b", "x = 1", "x = 2")
    assert mutants.mutate("x = 1\ny = 1\n", m) == "x = 2\ny = 1\n"
    with pytest.raises(mutants.TableError, match="not found"):
        mutants.mutate("y = 1\n", m)
    with pytest.raises(mutants.TableError, match="ambiguous"):
        mutants.mutate("x = 1\nx = 1\n", m)


def test_applying_a_mutant_to_a_copy_changes_exactly_its_text(tmp_path):
    m = next(m for m in mutants.MUTANTS if m.name == "ppo:gae-lambda-ignored")
    files = [m.script, "tests/shared.py"]
    mutants.copy_repo(ROOT, str(tmp_path), files)
    mutants.apply(m, str(tmp_path))
    before, after = read(os.path.join(ROOT, m.script)), read(tmp_path / m.script)
    assert after != before and after == before.replace(m.old, m.new)
    assert read(tmp_path / "tests/shared.py") == read(os.path.join(ROOT, "tests/shared.py"))
    assert read(os.path.join(ROOT, m.script)) == before  # the repository's own file is untouched


def test_select_by_name_id_and_script():
    t = mutants.MUTANTS
    assert [m.name for m in mutants.select(t, ["ppo:gae-lambda-ignored"])] == ["ppo:gae-lambda-ignored"]
    assert {m.script for m in mutants.select(t, ["gae-lambda-ignored"])} >= {"ppo.py", "ppo_llm.py"}
    assert {m.script for m in mutants.select(t, script="ppo_llm")} == {"ppo_llm.py"}
    with pytest.raises(SystemExit, match="unknown"):
        mutants.select(t, ["no-such-mutant"])


def test_statuses_on_a_tiny_repository(tmp_path, capsys, monkeypatch):
    """A 3-line module with a test that checks it and one that does not: killed, survived, timeout, error."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # pytest starts in 1 s instead of 3-6 s here
    (tmp_path / "tests").mkdir()
    (tmp_path / "mod.py").write_text("def f():\n    return 1\n\n")
    (tmp_path / "tests" / "test_mod.py").write_text(
        "import os, sys\nsys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))\nimport mod\n\n\n"
        "def test_f():\n    assert mod.f() == 1\n\n\ndef test_nothing():\n    mod.f()\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    (tmp_path / "untracked.py").write_text("raise SystemExit('not copied')\n")
    table = [
        mutants.M("mod.py", "wrong-value", "f returns 2", "return 1", "return 2", k="test_f",
                  tests=["tests/test_mod.py"]),
        mutants.M("mod.py", "unchecked", "f returns 2, a test that does not look", "return 1", "return 2",
                  k="test_nothing", tests=["tests/test_mod.py"]),
        mutants.M("mod.py", "slow", "f sleeps", "return 1", "__import__('time').sleep(60)", k="test_f",
                  tests=["tests/test_mod.py"], timeout=0.5),
        mutants.M("mod.py", "missing", "a pattern that is not there", "return 3", "return 4"),
        mutants.M("mod.py", "no-test", "a selection that collects nothing", "return 1", "return 2", k="test_zzz",
                  tests=["tests/test_mod.py"]),
    ]
    out = tmp_path / "report"
    rc = mutants.main(["--jobs", "4", "--timeout", "60", "--out", str(out)], table=table, root=str(tmp_path))
    printed = capsys.readouterr().out
    report = __import__("json").loads(read(out / "report.json"))
    status = {r["name"]: r["status"] for r in report["mutants"]}
    assert status == {"mod:wrong-value": "killed", "mod:unchecked": "survived", "mod:slow": "timeout",
                      "mod:missing": "error", "mod:no-test": "error"}, printed
    assert rc == 1 and report["score"] == {"killed": 1, "total": 5, "table_size": 5}
    assert "pattern not found" in printed and "score: 1/5 killed; survived: mod:unchecked" in printed
    assert report["hardware"]["cores"] and report["versions"]["python"] and report["command"].startswith("python")
    md = read(out / "report.md")
    assert "**Score: 1/5 killed**" in md and "| `mod:unchecked` | f returns 2, a test that does not look |" in md
    assert read(tmp_path / "mod.py") == "def f():\n    return 1\n\n"  # the repository itself is never mutated
