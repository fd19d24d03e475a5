"""The README and docs/ say only what is true: their commands run, their paths and keys exist.

Convention (README.md says it too): every fenced block has an info string. ```bash blocks are
quick commands, run here from the repository root with the virtualenv's bin first on PATH, each
block as one script that must exit 0. ```bash long (minutes, servers, many processes) and
```bash gpu (the H200) are not run here; they are run by hand before a change that touches them
is done. Any other info string (toml, python, text) is not a command. A block without an info
string, or with one outside this list, fails the test, so no command is skipped silently.

Also checked: every repository path named in backticks or linked exists (anchors included),
every `file.json: key` names a key of benchmarks/results/file.json, the README's layout table
names every module of every package, the patches table in docs/environment.md lists every
registered patch, and README.md stays an overview (at most 250 lines, no commit hashes).
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
COMMAND_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = {"bash": "quick", "bash long": "long", "bash gpu": "gpu", "toml": None, "python": None, "text": None}
REPO_DIRS = ("titan_ext/", "vllm_ext/", "router_ext/", "rl_loop/", "patches/", "tests/", "benchmarks/",
             "configs/", "scripts/", "requirements/", "docs/", ".ci/")
REPO_FILES = {"Makefile", "pyproject.toml", "README.md", "CHANGELOG.md"}
PACKAGES = ("titan_ext", "vllm_ext", "router_ext", "rl_loop")
RESULTS = ROOT / "benchmarks" / "results"
QUICK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    info: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    out, info, start, body = [], None, 0, []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        fence = re.match(r"\s*```(.*)$", line)
        if fence and info is None:
            info, start, body = fence[1].strip(), n, []
        elif fence:
            out.append(Block(doc, start, info, "\n".join(body)))
            info = None
        elif info is not None:
            body.append(line)
    assert info is None, f"{doc.relative_to(ROOT)}:{start}: fenced block never closed"
    return out


def prose(doc: Path) -> str:
    """The document without its fenced blocks (paths inside commands are checked by running them)."""
    return re.sub(r"^\s*```.*?^\s*```[^\n]*$", "", doc.read_text(), flags=re.S | re.M)


QUICK = [b for d in COMMAND_DOCS for b in blocks(d) if b.info == "bash"]


def test_every_block_says_what_it_is():
    unmarked = [f"{b.where}: ```{b.info}" for d in DOCS for b in blocks(d) if b.info not in KINDS]
    assert not unmarked, ("fenced blocks need one of the info strings " + ", ".join(map(repr, KINDS))
                          + " (bash = run by this test; bash long / bash gpu = run by hand):\n" + "\n".join(unmarked))


def test_benchmarks_readme_commands_are_marked_long_or_gpu():
    quick = [b.where for b in blocks(ROOT / "benchmarks" / "README.md") if b.info == "bash"]
    assert not quick, f"benchmark commands re-measure committed figures: mark them bash long or bash gpu: {quick}"


@pytest.mark.parametrize("block", QUICK, ids=[b.where for b in QUICK])
def test_quick_command_runs_as_written(block: Block):
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=QUICK_TIMEOUT_S)
    assert proc.returncode == 0, (f"{block.where} exited {proc.returncode}:\n{block.text}\n--- output tail ---\n"
                                  + (proc.stdout + proc.stderr)[-3000:])


def _repo_path(span: str) -> str | None:
    if " " in span or "*" in span.replace("/*", "") or "{" in span:
        return None
    path = span.split("::")[0].rstrip(",.")
    if path in REPO_FILES or path.startswith(REPO_DIRS):
        return path
    return None


def test_every_named_repository_path_exists():
    missing = []
    for doc in DOCS:
        for span in re.findall(r"`([^`\n]+)`", prose(doc)):
            path = _repo_path(span)
            if path and not glob.glob(str(ROOT / path)):
                missing.append(f"{doc.relative_to(ROOT)}: `{span}`")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def _anchors(doc: Path) -> set[str]:
    slugs = set()
    for title in re.findall(r"^#+\s+(.+)$", prose(doc), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def test_every_link_resolves():
    broken = []
    for doc in [*DOCS, ROOT / "CHANGELOG.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc)):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: ({target}): no such file")
            elif anchor and anchor not in _anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: ({target}): no heading with that anchor")
    assert not broken, "\n".join(broken)


def _lookup(obj, key: str):
    for part in re.findall(r'[^.\[\]]+|\[\d+\]|\["[^"]+"\]', key):
        if part.startswith('["'):
            obj = obj[part[2:-2]]
        elif part.startswith("["):
            obj = obj[int(part[1:-1])]
        else:
            obj = obj[part]
    return obj


def test_every_results_key_exists():
    spans = [(doc, m) for doc in DOCS for m in re.findall(r"`([\w.-]+\.json): ([^`]+)`", prose(doc))]
    assert spans, "benchmarks/README.md names no `file.json: key` source"
    bad = []
    for doc, (file, key) in spans:
        try:
            _lookup(json.loads((RESULTS / file).read_text()), key)
        except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
            bad.append(f"{doc.relative_to(ROOT)}: `{file}: {key}`: {type(e).__name__} {e}")
    assert not bad, "results keys the docs cite that benchmarks/results does not have:\n" + "\n".join(bad)


def _layout_rows() -> dict[str, str]:
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2:
            for path in re.findall(r"`([^`]+/)`", cells[0]):
                rows[path] = cells[1]
    return rows


def test_layout_table_names_every_module_of_every_package():
    rows = _layout_rows()
    problems = []
    for pkg in PACKAGES:
        for init in sorted((ROOT / pkg).rglob("__init__.py")):
            d = init.parent
            rel = f"{d.relative_to(ROOT).as_posix()}/"
            if rel not in rows:
                problems.append(f"no row for {rel}")
                continue
            have = {p.name for p in d.glob("*.py")} - {"__init__.py"}
            named = set(re.findall(r"\b(\w+\.py)\b", rows[rel])) - {"__init__.py"}
            if have - named:
                problems.append(f"{rel}: modules missing from the row: {sorted(have - named)}")
            if named - have:
                problems.append(f"{rel}: the row names modules that are not there: {sorted(named - have)}")
    assert not problems, "README.md's layout table is out of date:\n" + "\n".join(problems)


def test_patches_table_lists_every_patch():
    import patches

    registered = {p.name: p for p in patches.all_patches()}
    table = (ROOT / "docs" / "environment.md").read_text().split("## Patches", 1)[1]
    listed = set(re.findall(r"^\|\s*`(\w+)`\s*\|", table, flags=re.M))
    missing = [f"| `{n}` | {registered[n].upstream} | {registered[n].symptom} |" for n in sorted(set(registered) - listed)]
    gone = sorted(listed - set(registered))
    assert not missing and not gone, ("docs/environment.md's patches table differs from patches.all_patches():\n"
                                      + "rows to add:\n" + "\n".join(missing) + f"\nrows to remove: {gone}")


def test_readme_is_an_overview():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md is over 250 lines: move the detail to docs/"
    for doc in COMMAND_DOCS:
        hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", prose(doc))
                  if re.search(r"\d", h) and re.search(r"[a-f]", h)]
        assert not hashes, f"{doc.relative_to(ROOT)} names commits {hashes}: history goes in CHANGELOG.md"
