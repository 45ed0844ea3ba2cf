"""The reject codes and exit codes the docs list are the ones the code gives, both ways.

docs/preprocessing.md's "Reject codes" tables list `preprocess.errors.REJECT_CODES`, every
registered code is produced somewhere, and `RejectError` takes no other. docs/testing.md's
"Exit codes:" list is `shards_schema.errors.EXIT_CODES`; every other exit status the docs
name is one of those, and every exit status in the source is a named constant of it.
"""

from __future__ import annotations

import ast
import re
import signal
from pathlib import Path

import pytest

from preprocess import images, render
from preprocess.errors import REJECT_CODES, RejectError, check_reject_code
from shards_schema.errors import EXIT_CODES, EXIT_SIGNAL_BASE, SIGNAL_EXIT

ROOT = Path(__file__).resolve().parents[1]
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
SOURCE_PACKAGES = ("preprocess", "shards_schema", "train")


def _section(page: Path, heading: str) -> str:
    """The text under `## heading` up to the next heading of that level or above."""
    text = page.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^#{{1,2}} |\Z)", text, flags=re.S | re.M)
    assert match, f"{page.relative_to(ROOT)} has no '## {heading}' section"
    return match.group(1)


def documented_reject_codes() -> list[str]:
    """The code in the first column of each row of the tables under "## Reject codes"."""
    codes = []
    for line in _section(ROOT / "docs" / "preprocessing.md", "Reject codes").splitlines():
        if not line.startswith("|") or re.match(r"^\|\s*(Code\s*\||-)", line):
            continue  # prose, a header row or the separator row
        first = line.split("|")[1].strip()
        match = re.fullmatch(r"`([a-z][a-z0-9_]*)`", first)
        assert match, f"reject-code table row whose first column is not one backticked code: {line}"
        codes.append(match.group(1))
    return codes


def test_the_reject_code_tables_list_exactly_the_registry():
    documented = documented_reject_codes()
    assert len(documented) == len(set(documented)), "a reject code listed twice"
    assert sorted(set(REJECT_CODES) - set(documented)) == [], "in REJECT_CODES but not in docs/preprocessing.md"
    assert sorted(set(documented) - set(REJECT_CODES)) == [], "in docs/preprocessing.md but not in REJECT_CODES"


def test_every_reject_code_has_a_meaning():
    for code, meaning in REJECT_CODES.items():
        assert re.fullmatch(r"[a-z][a-z0-9_]*[a-z0-9]", code), code
        assert meaning.strip() and "\n" not in meaning, code


def test_a_reject_code_outside_the_registry_is_refused_where_it_is_raised():
    with pytest.raises(ValueError, match="'bad_jsn' is not in preprocess.errors.REJECT_CODES"):
        RejectError("bad_jsn", "a typo")
    with pytest.raises(ValueError, match="REJECT_CODES"):
        check_reject_code("internal_eror")
    assert RejectError("bad_json", "x").code == "bad_json"


def test_the_reject_records_of_the_job_take_only_registered_codes():
    from preprocess.job.units import _reject_record

    assert _reject_record("rows.jsonl", 3, "internal_error", "ValueError: x")["code"] == "internal_error"
    with pytest.raises(ValueError, match="REJECT_CODES"):
        _reject_record("rows.jsonl", 3, "some_new_code", "x")


def test_the_module_code_lists_are_part_of_the_registry():
    assert set(render.REJECT_CODES) <= set(REJECT_CODES)
    assert set(images.REJECT_CODES) <= set(REJECT_CODES)


def _python_sources():
    for package in SOURCE_PACKAGES:
        yield from sorted((ROOT / package).glob("**/*.py"))


def _string_literals(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_every_registered_reject_code_is_produced_somewhere():
    """Each code is written as a string in the source outside the registry itself: raised,
    passed to a helper that raises it, or mapped to (a dead entry would document a reject
    that never happens)."""
    registry = ROOT / "preprocess" / "errors.py"
    written = set().union(*(_string_literals(path) for path in _python_sources() if path != registry))
    assert sorted(set(REJECT_CODES) - written) == []


def _exit_code_clauses(paragraph: str) -> list[str]:
    """The exit status each ';'-separated clause of an "Exit codes: ..." paragraph's first
    sentence begins with."""
    text = paragraph.split(":", 1)[1]
    while True:  # parenthesised asides (nested too) may hold ';', '.' and numbers of their own
        stripped = re.sub(r"\([^()]*\)", "", text)
        if stripped == text:
            break
        text = stripped
    text = re.split(r"\.(?:\s+(?=[A-Z`])|\s*$)", text, maxsplit=1)[0]
    codes = []
    for clause in text.split(";"):
        match = re.match(r"\s*(\d+)(\s*\+\s*N\b)?", clause)
        assert match, f"an exit-code clause that does not begin with its code: {clause.strip()!r}"
        codes.append(SIGNAL_EXIT if match.group(2) else int(match.group(1)))
    return codes


def _exit_code_paragraphs(page: Path) -> list[str]:
    """Each paragraph that begins "Exit codes ...:" or "Exit status ...:"."""
    paragraphs = re.split(r"\n\s*\n", page.read_text(encoding="utf-8"))
    return [" ".join(p.split()) for p in paragraphs if re.match(r"Exit (codes|status)\b[^:\n]*:", p.strip())]


def test_the_exit_codes_of_testing_md_are_exactly_the_registry():
    (paragraph,) = [p for p in _exit_code_paragraphs(ROOT / "docs" / "testing.md") if p.startswith("Exit codes:")]
    documented = _exit_code_clauses(paragraph)
    assert len(documented) == len(set(documented)), f"an exit code listed twice: {documented}"
    assert sorted(map(str, set(EXIT_CODES) - set(documented))) == [], "in EXIT_CODES but not in docs/testing.md"
    assert sorted(map(str, set(documented) - set(EXIT_CODES))) == [], "in docs/testing.md but not in EXIT_CODES"


def _is_registered(code: int | str) -> bool:
    return code in EXIT_CODES or (isinstance(code, int) and EXIT_SIGNAL_BASE < code < EXIT_SIGNAL_BASE + signal.NSIG)


# "exit 2", "exits 0", "exit code is 1", "exits with code 3", "exit status 128 + the signal"
EXIT_MENTION = re.compile(r"\bexit(?:s|ed)?(?: with)?(?: (?:code|status))?(?: is)? (\d+)( ?\+)?")


def test_every_exit_code_the_docs_name_is_in_the_registry():
    unknown = []
    for page in DOC_PAGES:
        text = " ".join(page.read_text(encoding="utf-8").split())
        found: list[int | str] = []
        for paragraph in _exit_code_paragraphs(page):
            found += _exit_code_clauses(paragraph)
        for number, plus in EXIT_MENTION.findall(text):
            found.append(SIGNAL_EXIT if plus and int(number) == EXIT_SIGNAL_BASE else int(number))
        unknown += [f"{page.relative_to(ROOT)}: exit {code}" for code in found if not _is_registered(code)]
    assert unknown == []


def test_the_exit_code_parsers_read_the_docs_forms():
    assert _exit_code_clauses("Exit status: 0 done (a; b (c; 7. D)); 1 none; 128 + N signal N (x; y); 141 pipe. "
                              "Other; text.") == [0, 1, SIGNAL_EXIT, 141]
    mentions = EXIT_MENTION.findall("exits with code 3, exit code is 1, exit 2, exit status 128 + the signal")
    assert mentions == [("3", ""), ("1", ""), ("2", ""), ("128", " +")]


def _exit_status_literals(path: Path) -> list[str]:
    """Exit statuses written as bare numbers (0 aside) instead of shards_schema.errors' constants:
    in `sys.exit`/`parser.exit` calls, `exit_code` and `EXIT_*` assignments, the values a
    command's `run`, `main` or `_dispatch` returns, and `128 + ...` sums (signal_exit_code)."""
    found = []

    def literal(node: ast.AST | None) -> list[int]:
        if isinstance(node, ast.IfExp):
            return literal(node.body) + literal(node.orelse)
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value != 0:
            return [node.value]
        return []

    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        values: list[int] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "exit" and node.args:
            values = literal(node.args[0])
        elif isinstance(node, ast.Assign):
            names = [t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else "" for t in node.targets]
            if any(name == "exit_code" or name.startswith("EXIT_") for name in names):
                values = literal(node.value)
        elif isinstance(node, ast.FunctionDef) and node.name in ("run", "main", "_dispatch"):
            values = [v for ret in ast.walk(node) if isinstance(ret, ast.Return) for v in literal(ret.value)]
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
              and EXIT_SIGNAL_BASE in (getattr(node.left, "value", None), getattr(node.right, "value", None))):
            values = [EXIT_SIGNAL_BASE]
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {value}" for value in values]
    return found


def test_every_exit_status_in_the_source_is_a_registry_constant():
    registry = ROOT / "shards_schema" / "errors.py"
    assert [hit for path in _python_sources() if path != registry for hit in _exit_status_literals(path)] == []
