"""The package's layers (docs/ARCHITECTURE.md): every module sits on a floor, imports point only downward, and no
modules import each other in a circle, counting every import (inside functions and `if TYPE_CHECKING:` too)."""

from __future__ import annotations

import ast
from pathlib import Path

import fsdp_course

ROOT = Path(fsdp_course.__file__).parent

# floor of each top-level module or subpackage of fsdp_course; a module may import only from lower floors
# and from its own subpackage
FLOORS = {
    "data": 0, "models": 0, "claims": 0, "sampler": 0, "memory": 0, "hooks": 0, "holders": 0,  # shared, at the bottom
    "i18n": 0,
    "lora": 1,  # refuses a model an engine holds (holders)
    "runtime": 1,  # the simulated cluster
    "fsdp": 2,  # the course's FSDP
    "engines": 3, "viz": 3,  # DDP, ZeRO, the bridge to torch; figures and widgets
    "classroom": 4,  # checks, exercises, grading, the CLI
    "train": 5, "examples": 5,  # programs: the torchrun entry point, and those the lessons start as processes
    "demos": 6,  # what the lessons run to show an idea (their measurement runs and tables)
}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path) -> bool:
    base = root.parent / Path(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports(path: Path, root: Path) -> set[str]:
    """Every fsdp_course module this file imports (`from fsdp_course.x import y` counts y when it is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fsdp_course")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp_course"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if is_module(f"{node.module}.{a.name}", root)}
    return found


def floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def all_modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in root.rglob("*.py")}


def upward_imports(root: Path) -> list[str]:
    wrong = []
    for module, path in all_modules(root).items():
        if module == "fsdp_course":  # the package's front door re-exports the public names of every floor
            continue
        here, package = floor(module), module.split(".")[1]
        for target in imports(path, root):
            if target == "fsdp_course":
                wrong.append(f"{module} imports the package front door (import from the module that defines it)")
            elif target.split(".")[1] != package and floor(target) >= here:
                wrong.append(f"{module} (floor {here}) imports {target} (floor {floor(target)})")
    return sorted(wrong)


def import_circles(root: Path) -> list[str]:
    """Circles between modules (a subpackage's __init__ only re-exports: not a node)."""
    modules = all_modules(root)
    graph = {m: {t for t in imports(p, root) if t in modules and modules[t].name != "__init__.py"}
             for m, p in modules.items() if p.name != "__init__.py"}
    cycles: list[str] = []
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in done:
                visit(nxt, [*stack, nxt])
        done.add(node)

    for m in sorted(graph):
        if m not in done:
            visit(m, [m])
    return cycles


def test_every_module_has_a_floor() -> None:
    missing = sorted(m for m in all_modules(ROOT) if m != "fsdp_course" and floor(m) is None)
    assert not missing, f"add these to FLOORS (and to docs/ARCHITECTURE.md's picture): {missing}"


def test_imports_point_downward() -> None:
    wrong = upward_imports(ROOT)
    assert not wrong, "\n".join(wrong)


def test_no_import_circles() -> None:
    cycles = import_circles(ROOT)
    assert not cycles, "\n".join(cycles)


def test_the_checks_find_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The two tests above can fail: a planted pair of modules that import each other, one of them upward, one
    only inside a function."""
    pkg = tmp_path / "fsdp_course"
    for sub in ("runtime", "engines"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "a.py").write_text("from fsdp_course.engines.b import x\n")
    (pkg / "engines" / "b.py").write_text("def f():\n    from fsdp_course.runtime import a\n")
    assert upward_imports(pkg) == ["fsdp_course.runtime.a (floor 1) imports fsdp_course.engines.b (floor 3)"]
    assert import_circles(pkg) == ["fsdp_course.engines.b -> fsdp_course.runtime.a -> fsdp_course.engines.b"]


def test_a_program_not_in_examples_is_refused_naming_those_there() -> None:
    import pytest

    import fsdp_course.examples as examples

    assert {"peers", "late_rank", "stale_store"} <= set(examples.PROGRAMS)
    with pytest.raises(ValueError, match="no program 'peer' in fsdp_course.examples: there are .*, peers, "):
        examples.run("peer", workdir=".")


def test_a_job_expected_to_succeed_fails_with_the_end_of_its_errors() -> None:
    import subprocess

    import pytest

    import fsdp_course.examples as examples

    ok = subprocess.CompletedProcess(["x"], 0, "out", "")
    assert examples.finish(ok, "the job") is ok
    with pytest.raises(RuntimeError, match=r"the job failed \(exit code 3\); the end of its output:\n.*Address"):
        examples.finish(subprocess.CompletedProcess(["x"], 3, "", "x" * 5000 + "Address already in use"), "the job")
