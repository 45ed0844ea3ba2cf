"""The layout of the packages, read from their sources.

* Model families: everything family-specific lives in one module per family, under
  `preprocess/families/`, `shards_schema/families/` and `train/model/families/`; shared code asks
  the family instead of testing its name. A branch on a family name anywhere else in the three
  packages fails `test_no_family_branches_outside_the_families`, and one in `benchmarks/`
  `test_no_family_branches_in_the_benchmarks`.
* Imports: no circle between modules of `preprocess/`, `shards_schema/` and `train/`, imports
  inside functions included (they close a circle as surely, only later).
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("preprocess", "shards_schema", "train")
# `family ==` / `!=` / `in (...)`, `qwen3 = ...` flags, names built on "qwen2" (e.g. `hf_qwen2_...`)
FAMILY_BRANCH = re.compile(r"family *(==|!=|in \()|qwen3 *=|qwen2|\.family *(==|!=)")
# transformers' module names hold "qwen2" (Qwen3-VL's image processor is `Qwen2VLImageProcessor`)
TRANSFORMERS_IMPORT = re.compile(r" *from transformers[. ]")


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the three packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _in_families(path: Path) -> bool:
    return "families" in path.relative_to(ROOT).parts[:-1]


def _code_only(source: str) -> str:
    """`source` with comments and the text of string literals blanked (positions kept): what the
    code tests, not what its messages and docs say (`--profile` help names qwen2.5-vl, rightly)."""
    lines = source.splitlines(keepends=True)
    blank = {"COMMENT", "STRING", "FSTRING_MIDDLE"}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if tokenize.tok_name[token.type] not in blank:
            continue
        (row0, col0), (row1, col1) = token.start, token.end
        for row in range(row0, row1 + 1):
            line = lines[row - 1]
            a = col0 if row == row0 else 0
            b = col1 if row == row1 else len(line.rstrip("\r\n"))
            lines[row - 1] = line[:a] + " " * (b - a) + line[b:]
    return "".join(lines)


def _family_names() -> set[str]:
    from preprocess.families import BUILTIN_PROFILES, FAMILY_NAMES, MODEL_TYPE_FAMILY

    return set(FAMILY_NAMES) | set(BUILTIN_PROFILES) | set(MODEL_TYPE_FAMILY)


def _is_family_literal(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_family_literal(element, names) for element in node.elts)
    return False


def family_branches(path: Path, names: set[str], root: Path = ROOT) -> list[str]:
    """`file:line: code` of each branch on a family in one module: a FAMILY_BRANCH match in its
    code, or a comparison with a family or profile name written as a string."""
    source = path.read_text(encoding="utf-8")
    where = path.relative_to(root)
    lines = source.splitlines()
    hits = {row: line for row, line in enumerate(_code_only(source).splitlines(), 1)
            if FAMILY_BRANCH.search(line) and not TRANSFORMERS_IMPORT.match(line)}
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Compare) and any(_is_family_literal(n, names) for n in (node.left, *node.comparators)):
            hits[node.lineno] = lines[node.lineno - 1]
    return [f"{where}:{row}: {lines[row - 1].strip()}" for row, _ in sorted(hits.items())]


def test_no_family_branches_outside_the_families():
    names = _family_names()
    found = {package: [] for package in PACKAGES}
    for module, path in _modules().items():
        if not _in_families(path):
            found[module.split(".")[0]] += family_branches(path, names)
    hits = [hit for package in PACKAGES for hit in found[package]]
    assert hits == [], (
        "branch on a model family outside preprocess/families/, shards_schema/families/ and "
        "train/model/families/ (ask the family object instead, docs/families.md):\n" + "\n".join(hits))


def test_no_family_branches_in_the_benchmarks():
    """The benchmarks run every family through the same code: they ask the family objects too."""
    names = _family_names()
    hits = [hit for path in sorted((ROOT / "benchmarks").glob("*.py")) for hit in family_branches(path, names)]
    assert hits == [], "branch on a model family in benchmarks/ (ask the family object instead):\n" + "\n".join(hits)


def test_the_branch_count_sees_branches_and_not_text(tmp_path):
    """The count finds each kind of branch, and not a family named in a message or a comment."""
    names = {"qwen3-vl", "qwen2.5-vl"}
    module = tmp_path / "module.py"
    module.write_text(
        'HELP = "qwen2.5-vl or qwen3-vl"  # family == "qwen3-vl" in a comment\n'
        'def f(profile, family, name):\n'
        '    """Docs may say family != x and qwen2."""\n'
        '    if profile.family == "x":\n'
        '        return 1\n'
        '    qwen3 = family == "y"\n'
        '    if name in ("qwen2.5-vl", "other"):\n'
        '        return hf_qwen2_indices()\n'
        '    return name != "qwen3-vl"\n', encoding="utf-8")
    hits = [line.split(":")[1] for line in family_branches(module, names, root=tmp_path)]
    assert hits == ["4", "6", "7", "8", "9"]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports, anywhere in its body (`import a.b`,
    `from a import b` naming module a.b or a name of a, relative forms)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in modules:
                        imported.add(target)
                    elif base in modules:
                        imported.add(base)
        graph[name] = imported - {name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(frozenset(component))
    return circles


def test_no_import_circles():
    circles = [sorted(circle) for circle in import_circles(import_graph())]
    assert not circles, f"modules that import each other (directly or through others): {circles}"


def _in_model_package(module: str) -> bool:
    return module == "train.model" or module.startswith("train.model.")


def test_the_model_package_imports_nothing_else_of_train():
    """train/model is the model alone: the trainer, its config and checkpoints stand on it, never
    the other way round (what it shares with them lives in train.model.settings)."""
    graph = import_graph()
    outside = sorted(f"{module} imports {target}" for module, targets in graph.items() if _in_model_package(module)
                     for target in targets if target.split(".")[0] == "train" and not _in_model_package(target))
    assert not outside, outside


def test_the_circle_search_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert import_circles(graph) == [frozenset({"a", "b", "c"})]
    assert import_circles({"x": {"y"}, "y": {"x"}}) == [frozenset({"x", "y"})]


@pytest.mark.parametrize("side", ["preprocess", "shards_schema"])
def test_every_family_has_the_whole_interface(side):
    """A new family module is complete: every member its package's Protocol documents."""
    if side == "preprocess":
        from preprocess.families import FAMILIES as families, ModelFamily as interface
    else:
        from shards_schema.families import RULES as families, FamilyRules as interface
    members = set(interface.__annotations__) | {name for name, value in vars(interface).items()
                                                if callable(value) and not name.startswith("_")}
    assert members
    for name, family in families.items():
        assert family.name == name
        assert not [member for member in sorted(members) if not hasattr(family, member)], name


def test_the_registries_agree():
    from preprocess.families import BUILTIN_PROFILES, FAMILIES, MODEL_TYPE_FAMILY, official_template_kind
    from shards_schema.builtin import BUILTIN_CHAT_TEMPLATES, BUILTIN_VISION
    from shards_schema.families import RULES

    assert list(FAMILIES) == list(RULES) == list(BUILTIN_VISION)
    for name, family in FAMILIES.items():
        assert family.shard_rules is RULES[name]
        assert set(family.official_template_sha256) == set(family.templates)
        for kind, sha256 in family.official_template_sha256.items():
            assert official_template_kind(sha256) == kind
    assert set(MODEL_TYPE_FAMILY.values()) <= set(FAMILIES)
    assert set(BUILTIN_PROFILES) == set(BUILTIN_CHAT_TEMPLATES)
    for family, template in BUILTIN_PROFILES.values():
        assert template in FAMILIES[family].templates


def imported_test_modules(path: Path, root: Path = ROOT) -> list[str]:
    """`file:line: module` of each test module (`test_*`, in tests/ or next to the importer) that
    one source file imports, anywhere in its body: `from tests.test_x import ...`, `from test_x
    import ...`, `from .test_x import ...`, `from tests import test_x`, `import test_x`."""
    where = path.relative_to(root)
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base, *(f"{base}.{alias.name}" if base else alias.name for alias in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            module = parts[:2] if parts[0] == "tests" else parts[:1]
            if module[-1].startswith("test_"):
                found.append(f"{where}:{node.lineno}: {'.'.join(module)}")
                break
    return found


def test_no_module_imports_a_test_module():
    """Code that several test modules share is in tests/helpers/, their shared fixtures in
    tests/conftest.py; a test module imported by another would run its module-level code there
    and hand its fixtures over by name. Benchmarks import no test module either."""
    paths = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    found = [hit for path in paths for hit in imported_test_modules(path)]
    assert not found, ("imports of a test module (move what they use into tests/helpers/, fixtures into "
                       "tests/conftest.py):\n" + "\n".join(found))


def test_the_test_module_import_search_finds_each_form(tmp_path):
    module = tmp_path / "test_a.py"
    module.write_text(
        "from tests.test_train import ok\n"
        "from tests.helpers.train import run_train\n"
        "import test_b\n"
        "def f():\n"
        "    from .test_c import x\n"
        "    from tests import test_d, helpers\n"
        "    from test_e import y\n"
        "    import tests.test_f as f\n"
        "    from . import test_g\n"
        "    from preprocess.examples import example_rows\n", encoding="utf-8")
    assert imported_test_modules(module, root=tmp_path) == [
        "test_a.py:1: tests.test_train", "test_a.py:3: test_b", "test_a.py:5: test_c", "test_a.py:6: tests.test_d",
        "test_a.py:7: test_e", "test_a.py:8: tests.test_f", "test_a.py:9: test_g"]


def test_every_train_family_implements_its_hooks():
    """A new training-side family module is complete: every attribute the `ModelFamily` base
    documents, every hook without a default implemented, its vision tower a variant of a family
    that defines one, and each of its modules registered."""
    from train.model import families
    from train.model.vision import TowerVariant

    base = families.ModelFamily
    required = [name for name, value in vars(base).items()
                if callable(value) and "raise NotImplementedError" in inspect.getsource(value)]
    assert "weight_mappings" in required and "block_spec" in required
    registered = families.all_families()
    assert sorted(type(f).__module__ for f in registered) == sorted(families.FAMILY_MODULES)
    for family in registered:
        assert families.by_name(family.name) is family
        assert not [a for a in base.__annotations__ if not hasattr(family, a)], family.name
        assert not [m for m in required if getattr(type(family), m) is getattr(base, m)], family.name
        assert isinstance(families.vision_tower(family.vision_family), TowerVariant)
        assert all(families.by_model_type(t) is family for t in family.model_types)
