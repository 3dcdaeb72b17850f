"""The docs name only what exists (issue 44): every repository path in README.md,
ARCHITECTURE.md and docs/*.md is in the tree, every relative link resolves, the README
stays short enough to read in five minutes and no table cell is a wall of text.

A path is a token such as `engine/runner.py`, `models/families/`, `tests/test_x.py::test_y`,
`configs/*.toml`, `families/registry.py` (a tail of a repository path), `kv_transfer.py`
(a file name somewhere in the tree), `models/decoder.final_logits` (a name in that
file) or `jaxfill.engine.loading.build_model` (a module path and a name in it). Tokens
whose first part names nothing in the tree (`jax/...`, `/path/to/...`, `~/.cache/...`,
`grpc://...`) are outside the repository and not checked.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_PROSE_MAX_BYTES = 12_000  # all but the generated capability matrix, which grows a row a family
TABLE_CELL_MAX_CHARS = 300
SKIP_DIRS = {"__pycache__", "build", "dist", "out", "jaxfill-bench"}
CHECKED_SUFFIXES = (".py", ".md", ".toml", ".sh", ".proto")  # a bare file name with one of these is ours
PACKAGES = ("engine", "models", "serving", "pallas_kernels", "configs")


def doc_files(root: str = ROOT) -> list[str]:
    return [os.path.join(root, "README.md"), os.path.join(root, "ARCHITECTURE.md")] + sorted(
        glob.glob(os.path.join(root, "docs", "*.md")))


def _tree(root: str) -> tuple[set[str], set[str]]:
    """(files, directories) of the repository, relative, '/'-separated."""
    files, dirs = set(), set()
    for d, subdirs, names in os.walk(root):
        subdirs[:] = [s for s in subdirs if s not in SKIP_DIRS and not s.endswith(".egg-info")
                      and (not s.startswith(".") or s == ".ci")]
        rel = os.path.relpath(d, root).replace(os.sep, "/")
        if rel != ".":
            dirs.add(rel)
        files |= {n if rel == "." else f"{rel}/{n}" for n in names}
    return files, dirs


class Tree:
    def __init__(self, root: str = ROOT):
        self.root = root
        self.files, self.dirs = _tree(root)
        self.top = {p.split("/")[0] for p in self.files | self.dirs}
        self.dir_names = {d.rsplit("/", 1)[-1] for d in self.dirs}
        self.basenames = {f.rsplit("/", 1)[-1] for f in self.files}

    def _matches(self, path: str, rooted: bool) -> list[str]:
        """Repository paths equal to `path` (or ending in it, unless `rooted`); globs allowed."""
        path = path.rstrip("/")
        pool = self.files | self.dirs
        if any(c in path for c in "*?["):
            return [p for p in pool if fnmatch.fnmatch(p, path) or (not rooted and fnmatch.fnmatch(p, "*/" + path))]
        return [p for p in pool if p == path or (not rooted and p.endswith("/" + path))]

    def _source(self, rel: str) -> str:
        with open(os.path.join(self.root, rel), encoding="utf-8") as f:
            return f.read()

    def _defines(self, rel: str, name: str) -> bool:
        return re.search(rf"\b{re.escape(name)}\b", self._source(rel)) is not None

    def check_path(self, token: str) -> str | None:
        """None when `token` names something in the tree (or is not a repository path),
        else why not."""
        path, _, test = token.partition("::")
        first = path.split("/")[0]
        if "/" in path:
            if first in self.top:
                rooted = True
            elif first in self.dir_names:
                rooted = False  # families/registry.py: a tail of models/families/registry.py
            else:
                return None  # outside the repository
        elif path.endswith(CHECKED_SUFFIXES):
            rooted = False  # a file name somewhere in the tree
        else:
            return None
        found = self._matches(path, rooted)
        last = path.rsplit("/", 1)[-1]
        if not found and "/" in path and "." in last and last.rsplit(".", 1)[1] not in ("py", "md", "toml"):
            module, _, name = path.rpartition(".")  # models/decoder.final_logits
            files = [p for p in self._matches(module + ".py", rooted) if p in self.files]
            if not files:
                return f"{token}: no file {module}.py"
            if not any(self._defines(f, name) for f in files):
                return f"{token}: {files[0]} has no {name}"
            return None
        if not found:
            return f"{token}: no such file or directory"
        if test:
            name = test.split("::")[-1].split("[")[0]
            if not any(p in self.files and self._defines(p, name) for p in found):
                return f"{token}: {found[0]} has no {name}"
        return None

    def check_module(self, token: str) -> str | None:
        """jaxfill.engine.loading.build_model: the modules exist and the last one names the rest."""
        parts = token.split(".")[1:]
        if not parts or parts[0] not in PACKAGES:
            return None
        rel = ""
        for i, part in enumerate(parts):
            candidate = f"{rel}/{part}".lstrip("/")
            if candidate in self.dirs and candidate + "/__init__.py" in self.files:
                rel = candidate
            elif candidate + ".py" in self.files:
                rel = candidate + ".py"
                if i + 1 < len(parts) and not self._defines(rel, parts[i + 1]):
                    return f"{token}: {rel} has no {parts[i + 1]}"
                return None
            else:
                source = rel + "/__init__.py" if rel in self.dirs else rel
                if rel in self.dirs and self._defines(source, part):
                    return None
                return f"{token}: no module {candidate.replace('/', '.')}"
        return None


BRACES = re.compile(r"([\w./-]*)\{([\w.-]+(?:,[\w.-]+)+)\}([\w./-]*)")
TOKEN = re.compile(r"[\w.*:/-]+")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _expand_braces(text: str) -> str:
    """serving/{generation,jetstream}_service.py -> both paths."""
    while (m := BRACES.search(text)):
        text = text[:m.start()] + " ".join(m.group(1) + x + m.group(3) for x in m.group(2).split(",")) + \
            text[m.end():]
    return text


def path_tokens(text: str) -> list[str]:
    out = []
    for raw in TOKEN.findall(_expand_braces(text)):
        token = raw.rstrip(".:-")
        if "://" in raw or raw.startswith(("~", "/", "./", "../", "$")) or not token:
            continue
        if "/" in token or token.endswith(CHECKED_SUFFIXES) or token.startswith("jaxfill."):
            out.append(token)
    return out


def _slug(heading: str) -> str:
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set[str]:
    text = open(path, encoding="utf-8").read()
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", _without_code(text), re.M)}


def _without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def problems(doc: str, text: str, tree: Tree) -> list[str]:
    """Every path in `text` (the content of `doc`, a file under tree.root) checked."""
    found = []
    # Placeholders such as <kind> or a model DIR are not paths.
    text = re.sub(r"<[^>\n]*>", " ", text)
    for token in path_tokens(text):
        why = tree.check_module(token) if token.startswith("jaxfill.") else tree.check_path(token)
        if why:
            found.append(why)
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(doc), file)) if file else doc
        if not os.path.exists(full):
            found.append(f"link {target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            found.append(f"link {target}: no heading #{anchor} in {os.path.relpath(full, tree.root)}")
    return sorted(set(found))


@pytest.fixture(scope="module")
def tree() -> Tree:
    return Tree()


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_path_a_doc_names_exists(doc, tree):
    text = open(doc, encoding="utf-8").read()
    assert not problems(doc, text, tree), "\n".join(problems(doc, text, tree))


def test_the_check_finds_stale_paths(tree):
    """What the old ARCHITECTURE.md got wrong is caught: moved files, a file that became a
    package, a name that left its module, a link to nothing."""
    doc = os.path.join(ROOT, "ARCHITECTURE.md")
    stale = {"`engine/replicas.py`": "engine/replicas.py: no such file",
             "(engine/engine.py, scheduler.py)": "scheduler.py: no such file",
             "`engine/config.check_stackable`": "engine/config.py has no check_stackable",
             "`jaxfill.engine.no_such_module`": "no module engine.no_such_module",
             "tests/test_no_such_file.py": "tests/test_no_such_file.py: no such file",
             "`tests/test_readme.py::test_no_such_test`": "tests/test_readme.py has no test_no_such_test",
             "[x](docs/none.md)": "link docs/none.md: no such file",
             "[y](README.md#no-such-heading)": "no heading #no-such-heading in README.md"}
    for text, why in stale.items():
        assert any(why in p for p in problems(doc, text, tree)), (text, problems(doc, text, tree))
    fine = ("`engine/scheduler/replicas.py`, `families/registry.py`, `configs/*.toml`, `models/decoder.final_logits`, "
            "`jaxfill.engine.loading.build_model`, `serving/{generation,vllm}_service.py`, "
            "`tests/test_readme.py::test_notebook_example_matches_the_engine`, `jax/experimental/x.py`, "
            "`~/.cache/jaxfill/xla`, `grpc://127.0.0.1:50051`, `--model DIR/`, [z](README.md#set-up)")
    assert problems(doc, fine, tree) == []


def test_readme_is_short():
    """The prose, not the matrix: the matrix is generated from the capability table and
    gains a row with every family, while the prose is what a newcomer reads through."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    begin, end = "<!-- capability-matrix:begin -->", "<!-- capability-matrix:end -->"
    assert begin in text and end in text, "README.md lost its capability-matrix markers"
    prose = text[:text.index(begin)] + text[text.index(end):]
    size = len(prose.encode())
    assert size < README_PROSE_MAX_BYTES, (f"README.md's prose is {size} bytes; move details to docs/ "
                                           f"(limit {README_PROSE_MAX_BYTES})")


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_no_table_cell_is_a_wall_of_text(doc):
    long = []
    for line in _without_code(open(doc, encoding="utf-8").read()).splitlines():
        if line.lstrip().startswith("|"):
            long += [cell.strip()[:60] + "..." for cell in line.strip("|").split("|")
                     if len(cell.strip()) > TABLE_CELL_MAX_CHARS]
    assert not long, f"table cells over {TABLE_CELL_MAX_CHARS} characters: {long}"
