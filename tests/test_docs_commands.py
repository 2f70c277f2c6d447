"""Every command the docs show can run: each `python <script> ...` and `torchrun ... <script> ...` in README.md,
docs/**/*.md and benchmarks/README.md names a script that exists, uses only flags that the script's `--help` lists,
and names only repository files that exist.

Where commands are found: fenced code blocks (a line ending in a backslash is joined with the next) and inline code
spans (which may wrap across the lines of a paragraph). A shell line splits into commands at `;`, `&&`, `||`, `|`
and `&`; redirections (`> file`) are dropped. A command starts at `python` / `python3` (after `timeout 60`,
`VAR=x`, `do` ...) or at `torchrun`, whose script is its first argument ending in `.py`. `python -m ...`,
`python -c ...` and a script written as a placeholder (`python SCRIPT`, `python <script>`) are not checked.
`<name>` placeholders and `[...]` optional parts may appear anywhere; a flag in brackets is checked like any other.

Flags: every `--flag` / `--flag=value` before a bare `--` must be listed by `python <script> --help` (run once per
script, in a subprocess of its own). That is done for the four ppo*.py (tyro: aliases count, and `--a_b` is
`--a-b`) and benchmarks/*.py (argparse: the full name, no abbreviations); another script is only checked to exist.
After a bare `--` the flags go to an RL script (reproduce.py, speed.py, scaling.py): they are checked against every
script named by `--script` / `--scripts`, or, where none is named, must exist in one ppo*.py.

Paths (the rule): the script must exist, relative to the repository root, where the docs run everything. Any other
argument (or `--flag=value` value) is a repository path when it ends in `.py` or its first component is a top-level
file or directory that the repository ships (`benchmarks/...`, `docs/...`, `ppo.py`); it must exist unless it is
a placeholder (contains `<...>`, `$` or `*`), lies under a directory .gitignore lists (run directories, made by
training: `.../runs/...`), or is the value of an output flag (`--out`, `--runs-dir`: the command creates it).
Every other path (`prompts.jsonl`, `/models/qwen`, `runs/<run>/checkpoint.pt`) is the user's own: a placeholder.
"""

import fnmatch
import functools
import glob
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL_SCRIPTS = ("ppo.py", "ppo_continuous.py", "ppo_atari_envpool.py", "ppo_llm.py")
OUTPUT_FLAGS = {"--out", "--runs-dir"}  # directories the command creates
PLACEHOLDER = re.compile(r"<[^<>\s]+>")  # <run>, <script stem>: rewritten to ⟨run⟩ before the shell split
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.DOTALL)
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", ";;"}
REDIRECTS = {">", ">>", "<", ">&", "<<", "&>", "2>", ">|"}


def doc_files() -> list[str]:
    """The docs this test reads, relative to the root: whatever exists today."""
    names = ["README.md", *sorted(glob.glob("docs/**/*.md", root_dir=ROOT, recursive=True)), "benchmarks/README.md"]
    return [n for n in names if os.path.isfile(os.path.join(ROOT, n))]


# --- finding commands in markdown ------------------------------------------------------------------------------------

def shell_snippets(text: str) -> list[tuple[int, str]]:
    """(line number, shell text) of every code-block line (backslash continuations joined) and inline code span."""
    snippets, prose, in_fence, pending = [], [], False, None
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            prose.append((i, ""))  # a fence ends a paragraph
            continue
        if not in_fence:
            prose.append((i, line))
            continue
        start, joined = pending if pending else (i, "")
        joined = f"{joined} {line.strip()}" if joined else line
        if joined.rstrip().endswith("\\"):
            pending = (start, joined.rstrip()[:-1])
        else:
            snippets.append((start, joined))
            pending = None
    if pending:
        snippets.append(pending)
    # inline code: within one paragraph (or one table row), possibly over several lines
    paragraphs, current = [], []
    for i, line in prose:
        if not line.strip() or line.lstrip().startswith("|"):
            if current:
                paragraphs.append(current)
            current = []
            if line.strip():
                paragraphs.append([(i, line)])
        else:
            current.append((i, line))
    if current:
        paragraphs.append(current)
    for para in paragraphs:
        body = "\n".join(line for _, line in para)
        for m in CODE_SPAN.finditer(body):
            snippets.append((para[0][0] + body.count("\n", 0, m.start()), m.group(2).replace("\n", " ")))
    return sorted(snippets)


def shell_commands(snippet: str) -> list[list[str]]:
    """The words of each simple command in a shell line (`<x>` kept as the placeholder ⟨x⟩, comments dropped)."""
    s = PLACEHOLDER.sub(lambda m: "\u27e8" + m.group(0)[1:-1] + "\u27e9", snippet)
    try:
        lex = shlex.shlex(s, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        tokens = list(lex)
    except ValueError:  # an unbalanced quote in prose: split on blanks and the usual separators
        tokens = re.findall(r"&&|\|\||[;|&()]|[^\s;|&()]+", s.split(" #")[0])
    commands, words, skip_next = [], [], False
    for tok in tokens:
        if skip_next:
            skip_next = False
        elif tok in SEPARATORS:
            commands.append(words)
            words = []
        elif tok in REDIRECTS or re.fullmatch(r"\d?[<>]+&?", tok):
            skip_next = True  # the redirection's target
        else:
            words.append(tok)
    commands.append(words)
    return [c for c in commands if c]


def script_and_args(words: list[str]):
    """(script, its arguments) of a `python X.py ...` or `torchrun ... X.py ...` command, else None."""
    for k, w in enumerate(words):
        base = os.path.basename(w)
        if re.fullmatch(r"python(3(\.\d+)?)?", base):
            rest = words[k + 1:]
            while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
                rest = rest[1:]  # python's own options (-u, -O)
            if rest and rest[0].endswith(".py"):
                return rest[0], rest[1:]
            return None
        if base == "torchrun":
            for j in range(k + 1, len(words)):
                if words[j].endswith(".py"):
                    return words[j], words[j + 1:]
            return None
    return None


def doc_commands(text: str) -> list[tuple[int, str, str, list[str]]]:
    """(line, the snippet, script, arguments) of every command in a markdown text."""
    found = []
    for line, snippet in shell_snippets(text):
        for words in shell_commands(snippet):
            parsed = script_and_args(words)
            if parsed:
                found.append((line, snippet.strip(), *parsed))
    return found


# --- what each script accepts ----------------------------------------------------------------------------------------

def flags_in_help(text: str) -> set[str]:
    """The long options of a tyro or argparse --help: those on option lines, not those that descriptions mention.
    tyro: inside its box, option lines are indented 1 (a long one wraps onto more lines at that indent, which may
    start with a metavar: `{gae,grpo}, --adv-estimator ...`), descriptions 7. argparse: option lines start with `-`
    at an indent of 2, help after two spaces or on the next lines, indented further."""
    flags = set()
    for line in text.splitlines():
        boxed = re.match(r"^\s*[│┃]", line)
        body = line[boxed.end():] if boxed else line
        stripped = body.lstrip()
        indent = len(body) - len(stripped)
        if (boxed and indent <= 2 and stripped[:1] not in ("", "╭", "╰")) or (
                stripped.startswith("-") and indent <= 4):
            head = re.split(r"\s{2,}|[│┃]", stripped)[0]  # argparse may put the help on the same line
            flags |= set(re.findall(r"(?<![\w-])--[A-Za-z0-9][\w.-]*", head))
    return flags


def has_flag_check(script: str) -> bool:
    """Scripts whose --help is run: the four ppo*.py and benchmarks/*.py (never an arbitrary script)."""
    return script in RL_SCRIPTS or (os.path.dirname(script) == "benchmarks" and script.endswith(".py"))


@functools.cache
def help_flags(script: str) -> frozenset:
    """The long options that `python <script> --help` lists, run once per script exactly as a user runs it."""
    p = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env={**os.environ, "COLUMNS": "120"}, text=True,
                       capture_output=True, timeout=120)
    assert p.returncode == 0, f"`python {script} --help` failed (exit {p.returncode}):\n{p.stderr[-2000:]}"
    flags = flags_in_help(p.stdout)
    assert "--help" in flags and len(flags) > 2, f"no options found in `python {script} --help`:\n{p.stdout[:2000]}"
    return frozenset(flags)


def normalise(script: str, flag: str) -> str:
    return flag.replace("_", "-") if script in RL_SCRIPTS else flag  # tyro takes --a_b for --a-b


def accepts(script: str, flag: str) -> bool:
    return normalise(script, flag) in {normalise(script, f) for f in help_flags(script)}


# --- repository paths ------------------------------------------------------------------------------------------------

def _ignored_patterns() -> list[str]:
    path = os.path.join(ROOT, ".gitignore")
    lines = open(path).read().splitlines() if os.path.isfile(path) else []
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


IGNORED = _ignored_patterns()


def is_ignored(path: str) -> bool:
    """The path, or a directory it lies under, is one that .gitignore lists (`runs/` at any depth, `*.pyc`, a path
    from the root such as `benchmarks/results/runs/`); no negations: enough for the patterns used here."""
    clean = path.strip("/")
    for pat in IGNORED:
        bare = pat.strip("/")
        if pat.startswith("!") or not bare:
            continue
        if "/" in bare:  # a path from the root
            if (clean + "/").startswith(bare + "/"):
                return True
        elif any(fnmatch.fnmatch(part, bare) for part in clean.split("/")):
            return True
    return False


TOP_LEVEL = {e for e in os.listdir(ROOT) if not e.startswith(".") and not is_ignored(e)}


def path_problem(token: str, after_flag: str = "") -> str:
    """Why a command-line word that names a repository path is wrong, or '' (see the module docstring's rule)."""
    token = token.strip("[]'\",")
    if not token or token.startswith("-") or "=" in token:
        return ""
    if "\u27e8" in token or "$" in token or "*" in token or after_flag in OUTPUT_FLAGS:
        return ""
    rel = token[2:] if token.startswith("./") else token
    if rel.split("/")[0] not in TOP_LEVEL and not rel.endswith(".py"):
        return ""  # the user's own file
    if is_ignored(rel) or os.path.exists(os.path.join(ROOT, rel)):
        return ""
    return f"no such file or directory in the repository: {token}"


# --- the check -------------------------------------------------------------------------------------------------------

def check_markdown(text: str, name: str) -> list[str]:
    """Every problem of every command in one markdown text, as 'name:line: problem (in `command`)'."""
    commands = doc_commands(text)
    problems = []
    for line, snippet, script, args in commands:
        where = f"{name}:{line}: "
        shown = snippet if len(snippet) <= 160 else snippet[:157] + "..."
        if "\u27e8" in script or "$" in script:
            continue
        if not os.path.isfile(os.path.join(ROOT, script)):
            problems.append(f"{where}script {script} does not exist (in `{shown}`)")
            continue
        own, forwarded = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
        targets = []  # the RL scripts a benchmark tool forwards the flags after `--` to
        for k, a in enumerate(own):
            if a in ("--script", "--scripts"):
                for v in own[k + 1:]:
                    if v.startswith("-"):
                        break
                    targets.append(v.strip("[]"))
        for part, owners in ((own, [script]), (forwarded, targets or None)):
            prev = ""
            for word in part:
                flag = word.strip("[]")
                if flag.startswith("--") and len(flag) > 2:
                    flag_name, _, value = flag.partition("=")
                    if owners is None:
                        if not any(accepts(s, flag_name) for s in RL_SCRIPTS):
                            problems.append(f"{where}no ppo*.py has the flag {flag_name} (in `{shown}`)")
                    else:
                        for s in owners:
                            if (has_flag_check(s) and os.path.isfile(os.path.join(ROOT, s))
                                    and not accepts(s, flag_name)):
                                problems.append(f"{where}{s} has no flag {flag_name} (in `{shown}`)")
                    if value and (why := path_problem(value, flag_name)):
                        problems.append(f"{where}{why} (in `{shown}`)")
                    prev = flag_name
                    continue
                if why := path_problem(word, prev):
                    problems.append(f"{where}{why} (in `{shown}`)")
                prev = ""
    return problems


@pytest.mark.parametrize("doc", doc_files())
def test_commands_in_the_docs_use_real_flags_and_paths(doc):
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    problems = check_markdown(text, doc)
    assert not problems, f"{len(problems)} wrong command(s) in {doc}:\n" + "\n".join(problems)


def test_the_docs_have_commands_to_check():
    """The parser really finds the docs' commands (a parser that finds none would pass everything)."""
    counts = {d: len(doc_commands(open(os.path.join(ROOT, d), encoding="utf-8").read())) for d in doc_files()}
    assert "README.md" in counts and counts["README.md"] >= 3, counts
    assert counts.get("benchmarks/README.md", 0) >= 5, counts
    assert sum(counts.values()) >= 20, counts


# --- the checker itself can fail ------------------------------------------------------------------------------------

FAKE = textwrap.dedent("""\
    Train with `python ppo.py --seed 1 --made-up-flag 3`, or over two lines of a
    paragraph: `python ppo_continuous.py --env-id Hopper-v5
    --another-made-up-flag`.

    ```bash
    torchrun --standalone --nproc-per-node 2 ppo.py \\
        --total-timesteps 1e5 --third-made-up-flag
    python ppo.py --resume runs/<run>/checkpoint.pt --anneal-lr=false --learning_rate 1e-3   # all fine
    for s in 1 2; do python ppo_llm.py --seed $s --dataset my_prompts.jsonl --n 2 | tail -3; done
    python benchmarks/report.py benchmarks/results/no_such_dir --out benchmarks/results/new_dir
    python benchmarks/reproduce.py --script ppo.py --env-ids CartPole-v1 -- --num-envs 8 --made-up-forwarded
    python benchmarks/speed.py --paths eager -- --num-threads 4 --made-up-anywhere
    python no_such_script.py --seed 1
    python -m pytest -q --made-up-but-not-a-script
    ```
    """)


def test_the_checker_reports_made_up_flags_missing_files_and_their_lines():
    problems = check_markdown(FAKE, "fake.md")
    expected = [
        "fake.md:1: ppo.py has no flag --made-up-flag",
        "fake.md:2: ppo_continuous.py has no flag --another-made-up-flag",
        "fake.md:6: ppo.py has no flag --third-made-up-flag",
        "fake.md:10: no such file or directory in the repository: benchmarks/results/no_such_dir",
        "fake.md:11: ppo.py has no flag --made-up-forwarded",
        "fake.md:12: no ppo*.py has the flag --made-up-anywhere",
        "fake.md:13: script no_such_script.py does not exist",
    ]
    assert [p.split(" (in `")[0] for p in problems] == expected, "\n".join(problems)


def test_commands_are_found_where_the_docs_write_them():
    found = [(line, script, args) for line, _, script, args in doc_commands(FAKE)]
    assert found[0] == (1, "ppo.py", ["--seed", "1", "--made-up-flag", "3"])
    assert found[2] == (6, "ppo.py", ["--total-timesteps", "1e5", "--third-made-up-flag"])  # backslash joined
    assert found[3][2][:2] == ["--resume", "runs/\u27e8run\u27e9/checkpoint.pt"]  # placeholder kept, comment dropped
    assert found[4] == (9, "ppo_llm.py", ["--seed", "$s", "--dataset", "my_prompts.jsonl", "--n", "2"])  # not `| tail`
    assert [script for _, script, _ in found] == [  # every command, and `python -m pytest` is none
        "ppo.py", "ppo_continuous.py", "ppo.py", "ppo.py", "ppo_llm.py", "benchmarks/report.py",
        "benchmarks/reproduce.py", "benchmarks/speed.py", "no_such_script.py"]


def test_flags_in_help_reads_option_lines_only():
    tyro_help = textwrap.dedent("""\
        ╭─ options ───────────────────────────────╮
        │ --seed INT                              │
        │       like --not-an-option              │
        │ --a, --no-a                             │
        │ --adv-type {gae,grpo},                  │
        │ --algorithm.adv-estimator {gae,grpo}    │
        ╰─────────────────────────────────────────╯
        """)
    argparse_help = textwrap.dedent("""\
        usage: tool.py [-h] [--out OUT]

            python tool.py --in-the-description 1

        options:
          -h, --help   show this help message and exit
          --out OUT    output directory, not --not-this-one
                       --nor-this
        """)
    assert flags_in_help(tyro_help) == {"--seed", "--a", "--no-a", "--adv-type", "--algorithm.adv-estimator"}
    assert flags_in_help(argparse_help) == {"--out", "--help"}


def field_helps(script: str) -> dict[str, str]:
    """Each Args field of a script with the docstring under it or the `# comment` after it on its line: what tyro
    prints as the field's help."""
    import ast

    source = open(os.path.join(ROOT, script)).read()
    lines, tree = source.splitlines(), ast.parse(source)
    args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
    helps = {}
    for field, doc in zip(args.body, [*args.body[1:], None]):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            helps[field.target.id] = doc.value.value
        elif isinstance(field, ast.AnnAssign) and "  # " in lines[field.end_lineno - 1][field.end_col_offset:]:
            helps[field.target.id] = lines[field.end_lineno - 1][field.end_col_offset:].split("  # ", 1)[1]
    return helps


@pytest.mark.parametrize("script", RL_SCRIPTS)
def test_help_texts_are_one_line_each_and_leave_the_default_to_tyro(script):
    """tyro keeps a docstring's line breaks (a help text cut mid-sentence in --help) and prints "(default: ...)"
    after each help (a second one written in the text reads twice)."""
    helps = field_helps(script)
    assert len(helps) > 20, sorted(helps)  # every field has one (the count: the file was read)
    assert [name for name, text in helps.items() if "\n" in text] == []
    assert [name for name, text in helps.items() if "(default:" in text] == []
