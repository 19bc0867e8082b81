"""The README and docs/ stay true: every code block runs or is checked, every link resolves.

The conventions (docs/testing.md, "How the docs are checked"): a ```python
block is executed, and its ``async def main(target)``, if any, is awaited
against a real server; a ```sh block after ``<!-- run -->`` is run; any other
```sh block has each command checked without running it; a block after
``<!-- excerpt: PATH -->`` must appear verbatim in PATH; ```yaml and ```json
blocks must parse; ```text blocks are output or diagrams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import re
import shlex
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from handoff_server.ops.config import Settings
from handoff_server.service.app import Server

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
HANDOFF = str(Path(sys.executable).with_name("handoff"))
TIMEOUT_S = 30.0
README_MAX_LINES = 250

# Commands a ```sh block may name that cannot run here; only the repository
# paths they mention are checked.
EXTERNAL_COMMANDS = {"docker", "kubectl", "promtool", "grpcurl"}
EXTERNAL_MODULES = {"pip", "venv"}  # python -m MODULE that is not the repository's
REPOSITORY_DIRS = ("bench/", "client/", "deploy/", "docs/", "proto/", "server/", "tests/")
LANGUAGES = {"python", "sh", "yaml", "json", "text"}

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>run|excerpt:\s*(?P<path>\S+))\s*-->\s*$")
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    run: bool = False
    excerpt_of: str | None = None

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks_of(doc: Path) -> Iterator[Block]:
    lines = doc.read_text().splitlines()
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        indent = fence["indent"]
        end = index + 1
        while lines[end].rstrip() != f"{indent}```":
            end += 1
        text = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end]) + "\n"
        marker = MARKER.match(lines[index - 1]) if index > 0 else None
        yield Block(
            doc,
            index + 1,
            fence["lang"],
            text,
            run=marker is not None and marker["kind"] == "run",
            excerpt_of=marker["path"] if marker is not None else None,
        )
        index = end + 1


BLOCKS = [block for doc in DOCS for block in blocks_of(doc)]


def blocks(lang: str, *, run: bool | None = None) -> list[Block]:
    chosen = [b for b in BLOCKS if b.lang == lang and b.excerpt_of is None]
    if run is not None:
        chosen = [b for b in chosen if b.run is run]
    return chosen


def ids(chosen: list[Block]) -> list[str]:
    return [block.name for block in chosen]


# --- every block -----------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS, ids=ids(BLOCKS))
def test_every_block_names_its_language(block: Block) -> None:
    assert block.lang in LANGUAGES, f"{block.name}: fence language {block.lang!r}"


EXCERPTS = [b for b in BLOCKS if b.excerpt_of is not None]


@pytest.mark.parametrize("block", EXCERPTS, ids=ids(EXCERPTS))
def test_an_excerpt_appears_verbatim_in_its_file(block: Block) -> None:
    assert block.excerpt_of is not None
    source = ROOT / block.excerpt_of
    assert source.is_file(), f"{block.name}: no file {block.excerpt_of}"
    assert block.text in source.read_text(), f"{block.name}: not in {block.excerpt_of}"


# --- python: executed -------------------------------------------------------------

PYTHON = blocks("python")


@pytest.mark.parametrize("block", PYTHON, ids=ids(PYTHON))
async def test_a_python_block_runs(block: Block, lean_server: Server) -> None:
    module = types.ModuleType("docs_example")
    async with asyncio.timeout(TIMEOUT_S):
        exec(compile(block.text, block.name, "exec"), module.__dict__)
        main = module.__dict__.get("main")
        if inspect.iscoroutinefunction(main):
            await main(f"127.0.0.1:{lean_server.port}")


# --- sh: run, or every command checked ------------------------------------------------

RUN = blocks("sh", run=True)


@pytest.mark.parametrize("block", RUN, ids=ids(RUN))
def test_a_runnable_sh_block_exits_0(block: Block) -> None:
    done = subprocess.run(
        ["bash", "-e", "-c", block.text],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{block.name}:\n{done.stdout}{done.stderr}"


def commands(text: str) -> Iterator[list[str]]:
    """Each command of a shell block as words, continuations joined, comments dropped."""
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words = words[1:]  # VAR=value before the command
        if words:
            yield words


@functools.cache
def help_of(subcommand: str) -> str:
    args = [HANDOFF, "--help"] if not subcommand else [HANDOFF, subcommand, "--help"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"handoff {subcommand} --help: {done.stderr}"
    return done.stdout


def flags(words: list[str]) -> list[str]:
    return [word.split("=", 1)[0] for word in words if word.startswith("--")]


def check_handoff(words: list[str]) -> None:
    rest = words[1:]
    subcommand = rest[0] if rest and not rest[0].startswith("-") else ""
    text = help_of(subcommand)
    if subcommand:
        assert f"handoff {subcommand}" in text, f"no subcommand {subcommand!r}"
    for flag in flags(rest):
        assert re.search(rf"{re.escape(flag)}\b", text), f"handoff {subcommand}: no {flag}"


def check_make(words: list[str]) -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in words[1:]:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.MULTILINE), f"no make {target}"


def module_source(module: str) -> Path:
    """The file `python -m MODULE` runs, wherever the repository keeps it."""
    for top in (ROOT, ROOT / "server", ROOT / "client"):
        path = top.joinpath(*module.split("."))
        if path.with_suffix(".py").is_file():
            return path.with_suffix(".py")
        if (path / "__main__.py").is_file():
            return path / "__main__.py"
    raise AssertionError(f"no module {module} in the repository")


def check_python(words: list[str]) -> None:
    if words[1] == "-m":
        if words[2] in EXTERNAL_MODULES:
            return
        source, rest = module_source(words[2]), words[3:]
    else:
        source, rest = ROOT / words[1], words[2:]
    assert source.is_file(), f"no {source.relative_to(ROOT)}"
    for flag in flags(rest):
        assert f'"{flag}"' in source.read_text(), f"{source.relative_to(ROOT)}: no {flag}"


def check_paths(words: list[str]) -> None:
    for word in words:
        value = word.split("=", 1)[-1]
        if value.startswith(REPOSITORY_DIRS):
            assert (ROOT / value).exists(), f"no {value} in the repository"


def check_command(words: list[str]) -> None:
    program = Path(words[0]).name
    if program == "handoff":
        check_handoff(words)
    elif program == "make":
        check_make(words)
    elif re.fullmatch(r"python3?(\.\d+)?", program):
        check_python(words)
    else:
        assert program in EXTERNAL_COMMANDS, f"{program}: mark the block <!-- run -->"
    check_paths(words)


CHECKED = blocks("sh", run=False)


@pytest.mark.parametrize("block", CHECKED, ids=ids(CHECKED))
def test_every_command_of_a_sh_block_exists_with_its_flags(block: Block) -> None:
    for words in commands(block.text):
        try:
            check_command(words)
        except AssertionError as error:
            raise AssertionError(f"{block.name}: {shlex.join(words)}: {error}") from None


# --- yaml and json: parse -----------------------------------------------------------

DATA = blocks("yaml") + blocks("json")


@pytest.mark.parametrize("block", DATA, ids=ids(DATA))
def test_a_data_block_parses(block: Block) -> None:
    if block.lang == "json":
        json.loads(block.text)
    else:
        assert yaml.safe_load(block.text) is not None


# --- links ------------------------------------------------------------------------


def anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", doc.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_resolves(doc: Path) -> None:
    for match in LINK.finditer(doc.read_text()):
        target = match["target"]
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.is_relative_to(ROOT), f"{doc.name}: {target} leaves the repository"
        assert resolved.exists(), f"{doc.name}: {target} does not exist"
        if anchor:
            assert anchor in anchors(resolved), f"{doc.name}: {target}: no such heading"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_repository_path_named_in_backquotes_exists(doc: Path) -> None:
    for name in re.findall(r"`([^`\s*]+)`", doc.read_text()):
        path = name.rstrip("/").split(":")[0]
        if not path.startswith(REPOSITORY_DIRS):
            continue
        assert (ROOT / path).exists(), f"{doc.name}: `{name}` does not exist"


# --- the README --------------------------------------------------------------------


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    top = "\n".join(lines[:8])
    assert "make demo" in top
    assert "make test" in top


def module_map() -> list[str]:
    """The first cell of each row of the README's module table."""
    return [
        line.split("|")[1] for line in README.read_text().splitlines() if line.startswith("| `")
    ]


@pytest.mark.parametrize("package", ["server/handoff_server", "client/handoff_client"])
def test_the_module_map_names_every_module(package: str) -> None:
    for module in sorted((ROOT / package).rglob("*.py")):
        folder = module.parent.relative_to(ROOT).as_posix()
        if module.name == "__init__.py" or folder.startswith(f"{package}/sim"):
            continue  # the simulator is one row (test_the_module_map_names_the_other_parts)
        rows = [row for row in module_map() if f"{folder}/" in row]
        name = module.relative_to(ROOT).as_posix()
        assert any(f"{module.name}`" in row for row in rows), f"README: no row for {name}"


def test_the_module_map_names_the_other_parts() -> None:
    rows = module_map()
    for part in ("client/handoff_client/sim/", "deploy/", "bench/", "tests/", "proto/"):
        assert any(part in row for row in rows), f"README: no row for {part}"


# --- inventories that must stay complete ---------------------------------------------


def test_the_testing_page_lists_every_test_file() -> None:
    text = (ROOT / "docs" / "testing.md").read_text()
    for test in sorted((ROOT / "tests").rglob("test_*.py")):
        name = str(test.relative_to(ROOT))
        assert f"`{name}`" in text, f"docs/testing.md does not list {name}"


LONG_MODULE_LINES = 500


def test_the_testing_page_lists_every_long_module() -> None:
    """Modules over 500 lines are listed, each with its reason, in one table."""
    text = (ROOT / "docs" / "testing.md").read_text()
    table = text.partition("## Modules over 500 lines")[2].partition("\n## ")[0]
    listed = set(re.findall(r"^\| `([^`]+\.py)` \| \S", table, re.M))
    for path in listed:
        assert (ROOT / path).is_file(), f"docs/testing.md lists {path}, which does not exist"
    for package in ("server", "client/handoff_client"):
        for module in sorted((ROOT / package).rglob("*.py")):
            name = module.relative_to(ROOT).as_posix()
            if len(module.read_text().splitlines()) > LONG_MODULE_LINES:
                assert name in listed, f"docs/testing.md: {name} is over 500 lines; say why"


def test_the_operations_page_lists_every_setting() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    settings = text.partition("## Settings")[2].partition("\n## ")[0]
    for field in dataclasses.fields(Settings):
        flag = "--" + field.name.replace("_", "-")
        variable = "HANDOFF_" + field.name.upper()
        assert f"`{flag}`" in settings, f"docs/operations.md, Settings: no {flag}"
        assert f"`{variable}`" in settings, f"docs/operations.md, Settings: no {variable}"


# --- the repository stands on its own ----------------------------------------------------

OUTSIDE = "/".join(("..", "shared")).encode()  # spelled so this file does not match itself


def tracked_files() -> list[Path]:
    done = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60, check=False
    )
    if done.returncode != 0:
        pytest.skip("not a git checkout: no tracked files to check")
    return [ROOT / name for name in done.stdout.decode().split("\0") if name]


def test_no_tracked_file_refers_to_a_directory_beside_the_clone() -> None:
    offenders = []
    for path in tracked_files():
        if not path.is_file():
            continue  # deleted in the work tree, not yet committed
        content = path.read_bytes()
        if b"\0" in content:
            continue  # binary
        if OUTSIDE in content:
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"these refer to {OUTSIDE.decode()}: {offenders}"


# --- the README's headline figures ---------------------------------------------------

FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def headline_table() -> str:
    """The marked block of bench/RESULTS.md: the current figures the README states."""
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    block = re.search(r"<!-- headline\b.*?-->\n(.*?)<!-- /headline -->", text, re.DOTALL)
    assert block, "bench/RESULTS.md: no <!-- headline --> ... <!-- /headline --> block"
    return block.group(1)


def test_the_readme_states_the_headline_figures_of_the_benchmark_sheet() -> None:
    rows = [line.split("|")[2] for line in headline_table().splitlines()[2:] if line]
    sheet = sorted(FIGURE.findall(" ".join(rows)))
    paragraph = README.read_text().partition("**What it costs**")[2].partition("\n\n")[0]
    assert "(bench/RESULTS.md)" in paragraph
    # The README's own figures, less the sizes that name what was measured.
    stated = [n for n in FIGURE.findall(paragraph) if n != "100,000"]
    assert sorted(stated) == sheet
    assert len(paragraph.strip().splitlines()) == 3
