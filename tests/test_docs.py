"""The docs hold to the tree: README.md stays a landing page whose first two code blocks are the
two commands; every relative link in README.md and docs/ resolves; every page is in the site's
nav; every path and module docs/ARCHITECTURE.md names exists. (mkdocs itself builds the site in
CI: `mkdocs build --strict`.) Text only: nothing here imports the product."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
ARCHITECTURE = os.path.join(DOCS, "ARCHITECTURE.md")
PAGES = sorted(glob.glob(os.path.join(DOCS, "*.md")))

TRAIN_COMMAND = "pip install -e . && python train_main.py --workdir=runs/tiny"
TEST_COMMAND = 'pip install -e ".[test,tpu,gpu,eval,serve,wandb]" && python -m pytest -q -n 2'

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.M | re.S)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, start offset) of every fenced code block."""
    return [(m.group(1), m.group(2), m.start()) for m in _FENCE.finditer(text)]


def _prose(text: str) -> str:
    """The text outside code blocks and code spans (links there are not links)."""
    text = _FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """A heading's anchor as MkDocs' toc extension makes it (GitHub's agrees for the headings
    these pages use: letters, digits, spaces, hyphens, and punctuation that both drop)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: str) -> set[str]:
    return {_slug(h) for h in _HEADING.findall(_FENCE.sub("", _read(path)))}


def test_readme_is_a_landing_page_of_at_most_300_lines():
    lines = _read(README).count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move reference text into docs/"


def test_the_two_commands_are_the_readmes_first_two_code_blocks():
    blocks = _blocks(_read(README))
    assert len(blocks) >= 2, "README.md needs the two commands as its first code blocks"
    assert [body.strip() for _, body, _ in blocks[:2]] == [TRAIN_COMMAND, TEST_COMMAND]
    assert [language for language, _, _ in blocks[:2]] == ["bash", "bash"]


def test_the_readme_has_a_runnable_python_example():
    text = _read(README)
    runnable = [b for b in _blocks(text) if text[: b[2]].rstrip().endswith("<!-- runnable -->")]
    # The marker says "run me as written" (the examples' test runs each such block).
    assert runnable and all(language == "python" for language, _, _ in runnable), runnable


def test_the_models_page_shows_the_readmes_example_as_it_is():
    # One copy runs in the tests (the README's); the site's copy must be the same text.
    readme_python = [body for language, body, _ in _blocks(_read(README)) if language == "python"]
    models_page = _read(os.path.join(DOCS, "models.md"))
    models_python = [body for language, body, _ in _blocks(models_page) if language == "python"]
    assert readme_python and models_python and readme_python[0] == models_python[0]


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(page):
    here = os.path.dirname(page)
    for target in _LINK.findall(_prose(_read(page))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(here, file_part)) if file_part else page
        where = f"{os.path.relpath(page, ROOT)} links to {target!r}"
        assert os.path.isfile(path), f"{where}: no file {os.path.relpath(path, ROOT)}"
        if page != README:
            # MkDocs builds docs/ alone: a link out of it is broken on the site.
            assert os.path.dirname(path) == DOCS, f"{where}: outside docs/ (use a code span)"
        if anchor:
            assert anchor in _anchors(path), f"{where}: no heading with anchor #{anchor}"


def test_every_page_is_in_the_sites_nav_and_every_nav_entry_exists():
    nav = re.findall(
        r"^\s+- [^:\n]+:\s*(\S+\.md)\s*$", _read(os.path.join(ROOT, "mkdocs.yml")), re.M
    )
    in_nav = {os.path.join(DOCS, page) for page in nav}
    assert len(nav) == len(in_nav), f"a page is in mkdocs.yml's nav twice: {nav}"
    assert not in_nav - set(PAGES), f"nav names missing pages: {sorted(in_nav - set(PAGES))}"
    left_out = [os.path.relpath(p, ROOT) for p in PAGES if p not in in_nav]
    assert not left_out, f"pages not in mkdocs.yml's nav: {left_out}"


# --- docs/ARCHITECTURE.md names only what exists ------------------------------------------

# The packages a dotted name in ARCHITECTURE.md may start with; the run machinery's are also
# written without their `nnx_zoo.` prefix, and zoo's `layers` without `zoo.`.
_TOP = ("zoo", "shardings", "configs", "nnx_zoo", "tests", "bench")
_NAMESPACE = tuple(
    d for d in sorted(os.listdir(os.path.join(ROOT, "nnx_zoo"))) if not d.startswith("_")
)
_PREFIXES = ("", "nnx_zoo.", "zoo.")


def _module_file(parts: list[str]) -> str | None:
    base = os.path.join(ROOT, *parts)
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _defines(source_file: str, name: str) -> bool:
    """`name` is a function, class, module-level name or import of that file."""
    source = _read(source_file)
    pattern = (
        rf"^(?:\s*(?:async\s+)?(?:def|class)\s+{name}\b|{name}\s*[:=]|.*\bimport\b.*\b{name}\b)"
    )
    imported = rf"\bimport \([^)]*\b{name}\b[^)]*\)"  # from x import (a, b, ...)
    return re.search(pattern, source, re.M) is not None or re.search(imported, source) is not None


def _resolves(dotted: str) -> bool:
    """A module, or a module's attribute (a class's method by its name in that file)."""
    for prefix in _PREFIXES:
        parts = (prefix + dotted).split(".")
        for cut in range(len(parts), 0, -1):
            source = _module_file(parts[:cut])
            if source is None:
                continue
            rest = parts[cut:]
            if not rest or all(_defines(source, name) for name in rest):
                return True
            break
    return False


def _architecture_names() -> tuple[list[str], list[str]]:
    """(paths, dotted names) the page names: in backticks, and in the flow's code block."""
    text = _read(ARCHITECTURE)
    paths, dotted = [], []
    for line in _FENCE.sub("", text).splitlines():
        # In the package table a path may be relative to its row's package (`layers/` in zoo's).
        row = re.match(r"\| `([\w/.]+)/` \|", line)
        for token in re.findall(r"`([^`\n]+)`", line):
            if re.fullmatch(r"[\w.\-/]+", token) is None:
                continue  # a signature, a placeholder such as zoo/<family>/, a shell line
            if "/" in token or re.fullmatch(r"[\w\-]+\.(py|md|toml|txt|yml)", token):
                paths.append(token)
                if row and not os.path.exists(os.path.join(ROOT, token)):
                    paths[-1] = f"{row.group(1)}/{token}"
            elif re.fullmatch(r"[a-z_]\w*(\.\w+)+", token) and token.split(".")[0] in (
                *_TOP,
                *_NAMESPACE,
                "layers",
            ):
                dotted.append(token)
    for _, body, _ in _blocks(text):
        words = r"|".join((*_TOP, *_NAMESPACE))
        dotted += re.findall(rf"\b(?:{words})\.[a-z_][\w.]*\w", body)
    return paths, dotted


def test_every_path_architecture_names_exists():
    paths, _ = _architecture_names()
    assert len(paths) > 30, paths  # the page names its packages and modules by path
    missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p.rstrip("/")))]
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_module_architecture_names_exists():
    _, dotted = _architecture_names()
    assert len(dotted) > 20, dotted
    missing = sorted({d for d in dotted if not _resolves(d)})
    assert not missing, f"docs/ARCHITECTURE.md names modules or names that do not exist: {missing}"


def test_every_package_architecture_lists_exists_and_every_package_is_listed():
    rows = re.findall(r"^\| `([\w/.*]+)` \|", _read(ARCHITECTURE), re.M)
    listed = {r.rstrip("/") for r in rows}
    packages = {
        f"nnx_zoo/{d}" for d in _NAMESPACE if os.path.isdir(os.path.join(ROOT, "nnx_zoo", d))
    }
    packages |= {"zoo", "shardings", "configs", "bench", "tests", ".ci"}
    assert not packages - listed, f"packages missing from the table: {sorted(packages - listed)}"
    assert all(os.path.exists(os.path.join(ROOT, r)) for r in listed if "*" not in r), listed


# Words in backticks in the package table that are values, not code (`auto`: the strategy).
_VALUES = {"auto"}


def test_every_module_an_architecture_row_names_is_in_its_package():
    # A row names its modules bare (`manager`, `peers`): each must be a module or folder
    # somewhere under the row's package, or a name defined there (`abstract_model`).
    checked = 0
    for line in _read(ARCHITECTURE).splitlines():
        row = re.match(r"\| `([\w/.]+)/` \| (.*?) \| .* \|$", line)
        if row is None:
            continue
        package, concern = row.groups()
        files = glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True)
        modules = {os.path.basename(f)[:-3] for f in files}
        modules |= {os.path.basename(os.path.dirname(f)) for f in files}
        for name in set(re.findall(r"`([a-z_]\w*)`", concern)) - _VALUES:
            checked += 1
            assert name in modules or any(_defines(f, name) for f in files), (
                f"docs/ARCHITECTURE.md: `{name}` is not a module or name under {package}/"
            )
    assert checked > 40, checked


# Paths the pages name that are not in this tree: MaxText's files, and the venv CI makes.
_NOT_IN_THE_TREE = {
    "docs/reference/models/tiering.md",
    "maxtext/layers/nnx_decoders.py",
    ".ci/venv-newest",
}
_REPO_DIRS = ("zoo", "shardings", "configs", "nnx_zoo", "tests", "bench", "docs", ".ci")
_REPO_PATH = re.compile(r"(?:" + "|".join(re.escape(d) for d in _REPO_DIRS) + r")/[\w.\-/]*")


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: os.path.relpath(p, ROOT))
def test_every_repository_path_a_page_names_exists(page):
    # After a move (nnx_zoo/...), a page naming the old place is wrong even without a link.
    tokens = re.findall(r"`([^`\n]+)`", _FENCE.sub("", _read(page)))
    paths = [t for t in tokens if _REPO_PATH.fullmatch(t)]
    missing = [
        p for p in paths if p not in _NOT_IN_THE_TREE and not os.path.exists(os.path.join(ROOT, p))
    ]
    assert not missing, f"{os.path.relpath(page, ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: os.path.relpath(p, ROOT))
def test_every_module_and_bench_a_page_names_exists(page):
    text = _read(page)
    benches = re.findall(r"python -m (bench\.\w+)", text)
    dotted = [
        t
        for t in re.findall(r"`([^`\n]+)`", _FENCE.sub("", text))
        if re.fullmatch(r"(?:nnx_zoo|zoo|shardings|configs)(?:\.\w+)+(?:\(\))?", t)
    ]
    missing = [b for b in benches if _module_file(b.split(".")) is None]
    missing += [d for d in dotted if not _resolves(d.removesuffix("()"))]
    assert not missing, f"{os.path.relpath(page, ROOT)} names modules that do not exist: {missing}"
