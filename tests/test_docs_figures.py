"""Every link in the docs leads somewhere, and every figure in a results table is in the result file it links.

Links: each markdown link or image `[text](target)` in README.md, docs/**/*.md and benchmarks/README.md whose target
is in the repository (not `http...` / `mailto:`) names a file or directory that exists, relative to the markdown
file; a `#anchor` (alone, or after a .md target) names a heading of that file (GitHub's anchors: lower case,
punctuation other than `-` and `_` dropped, each space a `-`).

Figures: a table in a section (`##` or `###`) of README.md or benchmarks/README.md that links a file under
`results/` is a results table. Each number in its cells (outside code spans and link targets; `1,754.42`, `77.7`,
`500k`, `2.0M`, `10.4%`, `1.16×`; not the digits of names such as `Hopper-v5`, nor dates) must be, at the precision
it is written with, a number of the result files that back the row: those its own cells link, else those its
section links. A linked `report.md` (or a report's curve) brings the other files of its directory (CSV,
`meta.json`); a directory all of its text files. A percentage also matches a fraction (`77.7` and `0.7773`).
Prose between the tables is not checked (its derived figures, e.g. hours at a given SPS, are arithmetic).

Counts: the 31 PPO details (13 core, 9 Atari, 9 continuous control) of README.md and docs/reading_guide.md are the
rows of the guide's tables, and the mutants benchmarks/README.md counts are those of benchmarks/mutants.py.
"""

import functools
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.DOTALL)
TEXT = (".md", ".csv", ".json", ".log", ".txt")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# a figure in a doc: 1,754.42 / 77.7 / 500k / 2.0M / 10.4% / 1.16× (not v5 of Hopper-v5, not 2026-11-22)
FIGURE = re.compile(r"(?<![\w.,/-])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:\s?([kM])(?![\w-]))?(?![\w-]|[.,]\d)")
# a number in a result file: 1754.4178, 0.7773, 2000896, 1.3e-05 (in a CSV row too), and 1,754.42
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
GROUPED = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)")
# Sections whose tables the figure check leaves out, with the reason
NOT_CHECKED = {
    ("benchmarks/README.md", "H100, 2026-11-26"): "its ratio columns are computed from the figures beside them, and "
                                                  "LeanRL's run-2 SPS is the median of the prints in its log (the "
                                                  "section says how)",
}


def doc_files() -> list[str]:
    names = ["README.md", *sorted(glob.glob("docs/**/*.md", root_dir=ROOT, recursive=True)), "benchmarks/README.md"]
    return [n for n in names if os.path.isfile(os.path.join(ROOT, n))]


def read(name: str) -> str:
    return open(os.path.join(ROOT, name), encoding="utf-8").read()


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked (a link in code is none)."""
    out, in_fence = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            out.append((i, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line) if blank_code else line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, seen = set(), {}
    for _, line in prose_lines(text, blank_code=False):
        m = HEADING.match(line)
        if m:
            base = slug(re.sub(r"\s+", " ", m.group(2)))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


# --- links -----------------------------------------------------------------------------------------------------------

def links(text: str) -> list[tuple[int, str]]:
    return [(i, m.group(2)) for i, line in prose_lines(text) for m in LINK.finditer(line)]


def link_problems(text: str, name: str, exists=None, anchors_of=None) -> list[str]:
    """'name:line: problem' for each link of one markdown text that leads nowhere. exists(path) and anchors_of(path)
    look at the repository unless given (the checker's own test gives fakes)."""
    exists = exists or (lambda p: os.path.exists(os.path.join(ROOT, p)))
    anchors_of = anchors_of or (lambda p: anchors(read(p)))
    problems = []
    for line, target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        if path:
            rel = os.path.normpath(os.path.join(os.path.dirname(name), path))
            if rel.startswith("..") or not exists(rel):
                problems.append(f"{name}:{line}: no such file in the repository: {target}")
                continue
        else:
            rel = name
        if anchor and rel.endswith(".md") and anchor not in anchors_of(rel):
            problems.append(f"{name}:{line}: no heading #{anchor} in {rel}")
    return problems


def test_every_link_in_the_docs_leads_to_a_file_and_heading_that_exist():
    problems = [p for doc in doc_files() for p in link_problems(read(doc), doc)]
    assert not problems, "\n".join(problems)


def test_the_docs_link_their_result_files():
    """The parser finds the links (one that finds none would pass everything), the results ones among them."""
    found = {doc: [t for _, t in links(read(doc))] for doc in doc_files()}
    results = [t for t in found.get("benchmarks/README.md", []) if t.startswith("results/")]
    assert len(results) >= 15 and any(t.startswith("benchmarks/results/") for t in found["README.md"]), found


def test_the_link_checker_reports_missing_files_and_headings():
    fake = ("# Top\n\nSee [the report](results/none/report.md), [speed](results/speed.md), "
            "![curve](results/ppo/curves.png), [a section](#top), [no section](#nowhere),\n"
            "[elsewhere](other.md#sub-part-2), [gone](other.md#gone), [web](https://example.org/x) and "
            "`[in code](results/missing.md)`.\n\n```\n[in a fence](results/missing.md)\n```\n")
    files = {"bench/results/speed.md", "bench/results/ppo/curves.png", "bench/other.md"}
    problems = link_problems(fake, "bench/README.md", exists=files.__contains__,
                             anchors_of=lambda p: {"sub-part-2"} if p == "bench/other.md" else anchors(fake))
    assert problems == ["bench/README.md:3: no such file in the repository: results/none/report.md",
                        "bench/README.md:3: no heading #nowhere in bench/README.md",
                        "bench/README.md:4: no heading #gone in bench/other.md"], problems
    assert slug("Option mapping (verl / ROLL / RLinf → flag here)") == "option-mapping-verl--roll--rlinf--flag-here"
    assert slug("LLM: `ppo_llm.py`") == "llm-ppo_llmpy"


# --- figures ---------------------------------------------------------------------------------------------------------

def figures(cell: str) -> list[tuple[float, float, str]]:
    """(value, half of its last digit's unit, as written) of each figure in a table cell."""
    text = LINK.sub(lambda m: m.group(1), CODE_SPAN.sub(" ", cell))
    text = re.sub(r"\d{4}-\d{2}-\d{2}", " ", text)  # dates
    out = []
    for m in FIGURE.finditer(text):
        whole, frac, suffix = m.group(1).replace(",", ""), m.group(2) or "", m.group(3) or ""
        scale = {"k": 1e3, "M": 1e6, "": 1.0}[suffix]
        unit = 10.0 ** -(len(frac) - 1) if frac else 1.0
        out.append((float(whole + frac) * scale, unit * scale / 2, m.group(0)))
    return out


@functools.cache
def numbers_in(path: str) -> tuple[float, ...]:
    """Every number of a result file, and of the files that come with it (see the module docstring)."""
    full = os.path.join(ROOT, path)
    if os.path.isdir(full):
        files = sorted(glob.glob(os.path.join(full, "**", "*"), recursive=True))
    elif os.path.basename(path) == "report.md" or not path.endswith(TEXT):  # a report's curves: its directory
        files = sorted(glob.glob(os.path.join(os.path.dirname(full), "*")))
    else:
        files = [full]
    values = []
    for f in files:
        if os.path.isfile(f) and f.endswith(TEXT):
            text = open(f, encoding="utf-8", errors="replace").read()
            values += [float(m.group(0)) for m in NUMBER.finditer(text)]
            values += [float(m.group(0).replace(",", "")) for m in GROUPED.finditer(text)]
    return tuple(values)


def backed(value: float, half_unit: float, paths: list[str]) -> bool:
    tol = half_unit * (1 + 1e-9)
    return any(abs(v - value) <= tol or abs(100 * v - value) <= tol for p in paths for v in numbers_in(p))


def result_links(text: str, base: str) -> list[str]:
    """The results/ files a piece of markdown links, relative to the root."""
    out = []
    for m in LINK.finditer(text):
        target = m.group(2).partition("#")[0]
        if "results/" in target and not re.match(r"^[a-z]+:", target):
            out.append(os.path.normpath(os.path.join(os.path.dirname(base), target)))
    return out


def sections(text: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """The (heading, lines) of each `##` / `###` section of a markdown text (fenced code left out)."""
    parts, current = [], ("", [])
    for i, line in prose_lines(text):
        if re.match(r"^#{2,3}\s", line):
            parts.append(current)
            current = (text.splitlines()[i - 1].lstrip("#").strip(), [])
        current[1].append((i, line))
    parts.append(current)
    return parts


def figure_problems(text: str, name: str) -> list[str]:
    """'name:line: problem' for each figure of a results table that none of its result files holds."""
    raw = text.splitlines()
    problems = []
    for heading, lines in sections(text):
        section_links = [p for i, _ in lines for p in result_links(raw[i - 1], name)]
        if not section_links or (name, heading) in NOT_CHECKED:
            continue
        for i, line in lines:
            if not line.lstrip().startswith("|") or re.fullmatch(r"[\s|:-]+", line):
                continue
            row = raw[i - 1]
            cells = row.strip().strip("|").split("|")[1:]  # the first cell names the row
            backing = result_links(row, name) or section_links
            for cell in cells:
                for value, half, written in figures(cell):
                    if not backed(value, half, backing):
                        problems.append(f"{name}:{i}: {written!r} is in none of {', '.join(sorted(set(backing)))}")
    return problems


def checked_tables(name: str) -> int:
    text = read(name)
    return sum(1 for _, lines in sections(text) if any(result_links(ln, name) for _, ln in lines)
               for _, ln in lines if re.fullmatch(r"\s*\|[\s|:-]+\|\s*", ln))


def test_every_figure_of_a_results_table_is_in_its_result_file():
    problems = [p for doc in ("README.md", "benchmarks/README.md") for p in figure_problems(read(doc), doc)]
    assert not problems, "\n".join(problems)
    assert checked_tables("README.md") >= 1 and checked_tables("benchmarks/README.md") >= 7


def test_the_figure_checker_reports_a_figure_its_result_file_does_not_hold(tmp_path, monkeypatch):
    (tmp_path / "results" / "run").mkdir(parents=True)
    (tmp_path / "results" / "run" / "report.md").write_text("| env | return |\n| Hopper-v5 | 2853.1903 |\n")
    (tmp_path / "results" / "run" / "summary.csv").write_text("mean,std,acc\n2853.1903,301.3289,0.7773\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    numbers_in.cache_clear()
    try:
        doc = ("## Results\n\n| env | return | accuracy |\n|---|---|---|\n"
               "| Hopper-v5 | **2,853.19 ± 301.33** ([report](results/run/report.md)) | 77.7 % |\n"
               "| Hopper-v5, 2026-11-24 | 2,853.2 ± 301.4 ([report](results/run/report.md)) | 9k, 1.5M |\n"
               "\n## Other\n\n| flag | default |\n|---|---|\n| --x | 12.5 |\n")
        problems = figure_problems(doc, "README.md")
    finally:
        numbers_in.cache_clear()
    assert [p.split(" is in none")[0] for p in problems] == [
        "README.md:6: '301.4'", "README.md:6: '9k'", "README.md:6: '1.5M'"], problems
    assert figures("1,754.42 ± 69.69 (v5) `--seed 3` 10.4% 1.16× 500k [x](a1.md)") == [
        (1754.42, 0.005, "1,754.42"), (69.69, 0.005, "69.69"), (10.4, 0.05, "10.4"), (1.16, 0.005, "1.16"),
        (500e3, 500.0, "500k")]


# --- counts the docs state, against what they count ------------------------------------------------------------------

def numbered_rows(text: str, heading_start: str) -> int:
    """The rows `| 1 | ...` of the table under the `###` heading that starts with heading_start."""
    part = text.split(f"\n### {heading_start}", 1)[1].split("\n#", 1)[0]
    return len(re.findall(r"^\|\s*\d+\s*\|", part, re.M))


def test_the_counts_of_ppo_details_are_the_rows_of_the_reading_guide():
    guide, readme = read("docs/reading_guide.md"), read("README.md")
    rows = {name: numbered_rows(guide, name) for name in ("Core", "Atari", "Continuous control")}
    total = sum(rows.values())
    assert f"## The implementation details of PPO ({total} of the 37)" in guide, rows
    stated = f"the {total} that apply to these scripts: {rows['Core']} core, {rows['Atari']} Atari, " \
             f"{rows['Continuous control']} continuous control"
    assert stated in " ".join(guide.split()), rows
    flat = " ".join(readme.split())
    assert (f"lists where each of the {total} details" in flat
            and f"({rows['Core']} core, {rows['Atari']} Atari, {rows['Continuous control']} continuous control;"
            in flat), rows


def test_the_mutant_count_is_the_mutation_check_table():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import mutants
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    stated = re.search(r"holds (\d+) named mutants", read("benchmarks/README.md"))
    assert stated and int(stated.group(1)) == len(mutants.MUTANTS), (stated, len(mutants.MUTANTS))
