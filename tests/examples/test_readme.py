"""The README runs as written: its Python programs run on a local cluster, and its commands exist with the flags shown.

The same holds for the docs pages that hold what used to be the README's manual (DOCUMENTS). A ```python block is a
complete program unless the line before it is `<!-- fragment -->` (a snippet showing an API call). Commands that need
a running job or a capture are checked against their subcommand's --help; the quick,
harmless ones (--help, --version, plan) are run. Programs and commands run as the README says to run them: from a
new terminal after `source .venv/bin/activate` (fresh_shell.py).
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import fresh_shell
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCUMENTS = [
    README,
    *(
        ROOT / "docs" / f"{page}.md"
        for page in ("training", "data", "tfdata", "embeddings", "reliability-and-faults", "security", "profiling")
    ),
    ROOT / "docs" / "cli.md",
    ROOT / "docs" / "examples.md",
]
"""The README and the docs pages that hold its former sections: their code blocks and commands are checked."""
FRAGMENT_MARKER = "<!-- fragment -->"
ACTIVATE = "source .venv/bin/activate"
"""How the README has a new terminal find `shardflow` and `python`; the tests do it for their own environment."""


@dataclass(frozen=True, kw_only=True)
class CodeBlock:
    language: str
    code: str
    document: str
    """The file, relative to the repository's root."""
    line: int
    """1-based line of the opening fence, to name the block in failures."""
    fragment: bool


def code_blocks(text: str, document: str = "README.md") -> list[CodeBlock]:
    blocks = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = re.fullmatch(r"```(\w*)\s*", lines[index])
        if opening is None:
            index += 1
            continue
        end = lines.index("```", index + 1)
        fragment = index > 0 and lines[index - 1].strip() == FRAGMENT_MARKER
        code = "\n".join(lines[index + 1 : end]) + "\n"
        blocks.append(CodeBlock(language=opening[1], code=code, document=document, line=index + 1, fragment=fragment))
        index = end + 1
    return blocks


def shell_commands(text: str) -> list[str]:
    """Each command of the ```sh blocks, and each inline `shardflow ...` span of the prose and tables."""
    commands = []
    for block in code_blocks(text):
        if block.language == "sh":
            commands += [line.split(" #")[0].strip() for line in block.code.splitlines() if line.strip()]
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    # An inline span may wrap onto the next line of its paragraph, not past a blank line.
    spans = (" ".join(span.split()) for span in re.findall(r"`((?:[^`\n]|\n(?!\s*\n))+)`", prose))
    commands += [span for span in spans if span.startswith("shardflow ")]
    return list(dict.fromkeys(commands))


BLOCKS = [block for path in DOCUMENTS for block in code_blocks(path.read_text(), str(path.relative_to(ROOT)))]
PROGRAMS = [block for block in BLOCKS if block.language == "python" and not block.fragment]
FRAGMENTS = [block for block in BLOCKS if block.language == "python" and block.fragment]
COMMANDS = list(dict.fromkeys(command for path in DOCUMENTS for command in shell_commands(path.read_text())))


def shardflow(*args: str) -> subprocess.CompletedProcess[str]:
    """`shardflow ARGS` typed into a new terminal after the README's activation."""
    return fresh_shell.run(f"{fresh_shell.activate()} && shardflow {shlex.join(args)}", ROOT, timeout_s=30)


@functools.cache
def help_of(*path: str) -> str:
    """The --help of `shardflow PATH`; it fails the test if the subcommand does not exist."""
    done = shardflow(*path, "--help")
    assert done.returncode == 0, f"shardflow {' '.join(path)} --help failed\n{done.stderr}"
    return done.stdout


def subcommands(help_text: str) -> set[str]:
    """The subcommands a --help lists under its positional arguments, one a line indented by four spaces."""
    positional = help_text.partition("positional arguments:")[2].partition("\n\n")[0]
    return set(re.findall(r"^    ([\w-]+)", positional, flags=re.MULTILINE))


def test_the_readme_has_a_complete_program_and_its_fragments_are_marked():
    assert any(block.document == "README.md" for block in PROGRAMS), "the Quickstart should be a complete program"
    assert all(block.language for block in BLOCKS if block.code.lstrip().startswith(("import ", "shardflow "))), (
        "a code block without a language is not tested"
    )


def test_the_readme_says_how_a_new_terminal_finds_the_tools_make_demo_installed():
    assert ACTIVATE in shell_commands(README.read_text())


@pytest.mark.parametrize("block", PROGRAMS, ids=lambda block: f"{block.document}-line-{block.line}")
def test_python_program_runs_as_a_script_on_a_local_cluster(block: CodeBlock, tmp_path: Path):
    (tmp_path / "train.py").write_text(block.code)
    done = fresh_shell.run(f"{fresh_shell.activate()} && python train.py", tmp_path, timeout_s=90)
    assert done.returncode == 0, (
        f"{block.document} line {block.line}: the program exited {done.returncode} (if it is a snippet, put "
        f"{FRAGMENT_MARKER} on the line before it)\n{done.stdout}{done.stderr}"
    )


@pytest.mark.parametrize("block", FRAGMENTS, ids=lambda block: f"{block.document}-line-{block.line}")
def test_python_fragment_is_valid_python(block: CodeBlock):
    compile(block.code, f"{block.document}:{block.line}", "exec")


def test_programs_that_train_seed_their_data_so_every_role_sees_the_same():
    training = [block for block in PROGRAMS if "train_and_evaluate" in block.code]
    assert any(block.document == "README.md" for block in training), "the Quickstart should train"
    unseeded = [f"{block.document} line {block.line}" for block in training if "manual_seed(" not in block.code]
    assert not unseeded, f"every role re-runs the program: seed its data ({', '.join(unseeded)})"


@pytest.mark.parametrize("command", COMMANDS)
def test_shell_command_exists_with_every_flag_it_uses(command: str):
    words = [word.strip("[]") for word in shlex.split(command.replace("\\|", "|"))]
    program, *args = words
    if command == ACTIVATE:
        assert re.search(r"^VENV := \.venv$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE), "make's venv moved"
        return
    if program == "make":
        makefile = (ROOT / "Makefile").read_text()
        for target in args:
            assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.MULTILINE), f"no make target {target}"
        return
    assert program == "shardflow", f"a documented command this test does not know how to check: {command}"
    if args in (["--version"], ["--help"]):
        done = shardflow(*args)
        assert done.returncode == 0 and done.stdout.startswith(("shardflow", "usage: shardflow")), done.stderr
        return
    # The subcommand path: each word the --help of the path so far lists as a subcommand. A word "a|b|c" names
    # alternatives, each of which must exist.
    path: list[str] = []
    help_text = help_of()
    for word in args:
        alternatives = word.split("|")
        available = subcommands(help_text)
        if not available or not set(alternatives) <= available:
            assert len(alternatives) == 1, f"{command}: {word} are not all subcommands of shardflow {path}"
            break
        for alternative in alternatives[1:]:
            help_of(*path, alternative)
        path.append(alternatives[0])
        help_text = help_of(*path)
    assert path, f"{command}: no such subcommand"
    # "--a=1" uses --a; "--a/--b" (two flags named together in prose) uses both.
    flags = {flag.split("=")[0] for word in args if word.startswith("--") for flag in word.split("/")}
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), (
            f"{command}: shardflow {' '.join(path)} --help lists no {flag}"
        )
    if path == ["plan"]:  # a quick calculation: run it as written
        done = shardflow(*args)
        assert done.returncode == 0, done.stderr
