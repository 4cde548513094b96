"""Set-up files agree: environment.yml and pyproject.toml list the same dependencies; CI runs make test."""

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def normalize(req: str) -> str:
    return re.sub(r"\s+", "", req).lower()


def conda_pip_requirements(text: str) -> list[str]:
    """The entries of the `- pip:` list in environment.yml."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    indent = len(lines[start]) - len(lines[start].lstrip())
    reqs = []
    for line in lines[start + 1:]:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if len(line) - len(line.lstrip()) <= indent:
            break
        reqs.append(line.strip().removeprefix("- ").strip())
    return reqs


def test_environment_yml_and_pyproject_list_the_same_dependencies() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = {normalize(d) for d in pyproject["project"]["dependencies"]}
    conda = {normalize(d) for d in conda_pip_requirements((ROOT / "environment.yml").read_text())}
    assert deps == conda, f"only in pyproject: {deps - conda}; only in environment.yml: {conda - deps}"
    assert "torch==2.13.0" in deps
    assert pyproject["project"]["requires-python"] == ">=3.10,<3.15"  # torch 2.13's wheels: cp310-cp314
    assert "python>=3.10,<3.15" in (ROOT / "environment.yml").read_text()


def test_students_install_less_than_the_test_suite() -> None:
    """A student's install has no grading, test or website tools; `make test` installs every extra, `make lab` none."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    core = " ".join(pyproject["project"]["dependencies"])
    extras = pyproject["project"]["optional-dependencies"]
    assert set(extras) == {"classroom", "dev", "site"}
    for tool in ("nbgrader", "nbval", "pytest", "ruff", "playwright", "sphinx", "myst-nb"):
        assert tool not in core and any(tool in " ".join(reqs) for reqs in extras.values()), tool
    makefile = (ROOT / "Makefile").read_text()
    assert 'pip install --quiet -e ".[classroom,dev,site]"' in makefile
    assert re.search(r"^lab: \$\(STAMP\)$", makefile, re.M) and re.search(r"^test: \$\(DEV_STAMP\)$", makefile, re.M)
    assert 'pip install -e ".[classroom,dev,site]"' in (ROOT / "environment.yml").read_text()


def test_grading_without_the_classroom_extra_says_what_to_install(monkeypatch, capsys, tmp_path) -> None:
    import builtins

    from fsdp_course.classroom import cli

    real_import = builtins.__import__

    def no_nbgrader(name, *args, **kwargs):
        if name.startswith("nbgrader") or (name == "fsdp_course.classroom" and "grading" in (args[2] or ())):
            raise ModuleNotFoundError("No module named 'nbgrader'", name="nbgrader")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nbgrader)
    assert cli.main(["grade", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "pip install -e '.[classroom]'" in capsys.readouterr().err


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make lab" in readme
    assert "conda env create -f environment.yml" in readme
    assert re.search(r"^make test$", ci, re.M)


def test_gitignore_keeps_environments_and_scratch_out() -> None:
    ignored = (ROOT / ".gitignore").read_text().split()
    for entry in (".venv/", ".ipynb_checkpoints/", "__pycache__/", "checkpoints/", "scratch/"):
        assert entry in ignored


def test_the_repository_stands_alone() -> None:
    """Code, tests and notebooks cite what a reader of this repository has (docs/), not outside notes or issues."""
    outside = re.compile(r"shared[/]DESIGN|\.\./shared|\bissue \d+|\bissue #\d+", re.I)
    files = [*ROOT.glob("fsdp_course/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"),
             *ROOT.glob("lessons/*.ipynb"), *ROOT.glob("solutions/*.ipynb"), ROOT / "README.md"]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files
             for m in [outside.search(p.read_text(encoding="utf-8"))] if m and p.name != "test_packaging.py"]
    assert not found, found


def test_every_file_the_package_reads_that_is_not_python_is_installed() -> None:
    """A wheel carries only .py files unless package-data names the rest: the message catalogues must be named."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    named = {path for package, globs in data.items() for pattern in globs
             for path in (ROOT / package.replace(".", "/")).glob(pattern)}
    files = {p for p in (ROOT / "fsdp_course").rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")}
    assert files and files <= named, f"not installed by a wheel: {sorted(str(p) for p in files - named)}"
