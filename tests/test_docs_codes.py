"""The reject codes the docs list are the ones the code gives, both ways.

docs/preprocessing.md's "Reject codes" tables list `preprocess.errors.REJECT_CODES`, every
registered code is produced somewhere, and `RejectError` takes no other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from preprocess import images, render
from preprocess.errors import REJECT_CODES, RejectError, check_reject_code

ROOT = Path(__file__).resolve().parents[1]
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
    from preprocess.job import _reject_record

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
