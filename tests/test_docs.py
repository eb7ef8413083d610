"""The front page and docs/ point at things that exist: every relative link (and its #anchor) and
every raw result file they cite under bench/results/, and the README's recipe is one lowbit reads.
Results move between folders; a stale path in the docs is a number nobody can check."""

import re
from pathlib import Path

import pytest

from lowbit.recipe_files import load_recipe

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "bench" / "results").glob("*/NOTES.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(link)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_result_files_exist(page):
    text = page.read_text()
    cited = {p.rstrip(".,;:") for p in re.findall(r"bench/results/[\w./-]+\.(?:json|txt|svg)", text)}
    if page.name == "results.md":  # docs/results.md names files relative to bench/results/
        cited |= {"bench/results/" + p for p in re.findall(r"`((?:[a-z]+)/[\w.-]+\.(?:json|txt|svg))`", text)}
    if page == ROOT / "bench" / "README.md":  # its example of a path as older files record it
        cited.discard("bench/results/budget-rtn-w3-cpu.json")
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, f"{page.relative_to(ROOT)} cites result files that do not exist: {missing}"


def test_the_readme_recipe_loads(tmp_path):
    recipe = re.search(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    (tmp_path / "r.yaml").write_text(recipe)
    assert load_recipe(tmp_path / "r.yaml").model == "smollm2-135m"


def expand_braces(pattern: str) -> list[str]:
    """`w{2,3}-x.json` -> [`w2-x.json`, `w3-x.json`], as a shell would."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [e for option in match.group(1).split(",") for e in expand_braces(head + option + tail)]


def test_every_result_file_is_in_the_index():
    """bench/README.md names every raw result (a name, or a pattern such as `sass-<commit>.json`)."""
    from fnmatch import fnmatch

    index = (ROOT / "bench" / "README.md").read_text()
    patterns = {re.sub(r"<[^>]*>", "*", e) for token in re.findall(r"`([^`\s]+)`", index)
                for e in expand_braces(token)}
    results = ROOT / "bench" / "results"
    unnamed = sorted(str(f.relative_to(results)) for f in results.rglob("*")
                     if f.is_file() and f.name != "NOTES.md"
                     and not any(fnmatch(f.name, p) or fnmatch(str(f.relative_to(results)), p) for p in patterns))
    assert not unnamed, f"bench/README.md does not index these result files: {unnamed}"
