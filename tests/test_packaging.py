"""What `pip install .` gets: every package, and the files the code reads from its own folders.

pyproject.toml maps the user's top-level folders to their import names (package-dir:
drafters/ -> specdec.drafters, ...) and lists every package: the first tests read the source tree (instant, and they name what is missing: a module outside any
package, a data file nobody decided on); the last builds a wheel from a copy of the sources and
reads its file list.
That wheel has no compiled kernels (``SPECDEC_NO_NATIVE=1``: the C build alone takes ~15 s):
.ci/run builds the real wheel, installs it into a fresh venv and generates with it.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR = SETUPTOOLS["package-dir"]  # package -> its folder
# files in the package folders that are not shipped, and why (anything else must be package data)
NOT_SHIPPED = {"specdec/native/*.c": "compiled by setup.py at install",
               "specdec/native/*.h": "compiled by setup.py at install"}
USER_FOLDERS = ("drafters", "verifiers", "controllers", "training")
# build outputs and hidden files (an editor's swap file): never in a clean checkout
BUILD_LEFTOVERS = ("__pycache__", "*.pyc", "*.so", "*.egg-info", ".*")


def _files(root: Path):
    """Files under ``root`` as a source checkout has them (no caches, no built kernels)."""
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not any(fnmatch.fnmatch(part, pattern) for part in rel.parts
                                      for pattern in BUILD_LEFTOVERS):
            yield path


@functools.cache
def _source_files() -> dict[str, Path]:
    """Installed path (e.g. ``specdec/drafters/ngram.py``) -> the file in this checkout, for
    every file under the package folders."""
    out = {}
    for package, folder in PACKAGE_DIR.items():
        root = REPO / folder
        for path in _files(root):
            out["/".join([*package.split("."), *path.relative_to(root).parts])] = path
    return out


def _tree_packages() -> set[str]:
    """Every folder with an __init__.py under the roots, as the package it installs as."""
    return {name.rpartition("/")[0].replace("/", ".")
            for name in _source_files() if name.endswith("/__init__.py")}


def _matches(name: str, table: str) -> bool:
    """Whether installed path ``name`` matches a pattern of pyproject's ``table``
    (package-data or exclude-package-data)."""
    return any(name.startswith(package.replace(".", "/") + "/")
               and fnmatch.fnmatch(name[len(package) + 1:], pattern)
               for package, patterns in SETUPTOOLS.get(table, {}).items()
               for pattern in patterns)


def _package_data(name: str) -> bool:
    return _matches(name, "package-data") and not _matches(name, "exclude-package-data")


def test_the_user_folders_are_mapped_into_one_namespace():
    """The design card's top level: drafters/, verifiers/, controllers/, training/ beside
    specdec/, imported as specdec.drafters, ... (no second copy under specdec/)."""
    assert PACKAGE_DIR == {"specdec": "specdec", **{f"specdec.{d}": d for d in USER_FOLDERS}}
    for folder in USER_FOLDERS:
        assert (REPO / folder / "__init__.py").is_file(), folder
        assert not (REPO / "specdec" / folder).exists(), f"a second {folder}/ under specdec/"


def test_every_package_is_listed():
    """package-dir's mapping is one automatic discovery cannot follow: the list is by hand."""
    listed, found = set(SETUPTOOLS["packages"]), _tree_packages()
    assert found - listed == set(), f"packages not in pyproject's packages: {found - listed}"
    assert listed - found == set(), f"listed packages with no folder: {listed - found}"


def test_every_module_is_in_a_package():
    """A .py file in a folder without __init__.py is in no listed package: it never ships."""
    packages = {p.replace(".", "/") for p in _tree_packages()}
    stray = sorted(n for n in _source_files()
                   if n.endswith(".py") and n.rpartition("/")[0] not in packages)
    assert not stray, f"modules outside any package (add an __init__.py beside them): {stray}"


def test_every_other_file_is_package_data_or_said_why_not():
    """A file beside the code is there to be read at run time (shipped drafters) unless
    NOT_SHIPPED says otherwise; a new one must be added to one of the two."""
    undecided = sorted(n for n in _source_files() if not n.endswith(".py")
                       and not _package_data(n)
                       and not any(fnmatch.fnmatch(n, p) for p in NOT_SHIPPED))
    assert not undecided, (f"files in the package folders neither in pyproject's package-data "
                           f"nor in NOT_SHIPPED here: {undecided}")
    # setuptools ships every file its build lists in a package folder (the extension's C
    # sources among them) unless exclude-package-data says not to
    included = sorted(n for n in _source_files() if any(fnmatch.fnmatch(n, p) for p in NOT_SHIPPED)
                      and not _matches(n, "exclude-package-data"))
    assert not included, f"not in pyproject's exclude-package-data: {included}"


def test_shipped_drafters_are_package_data():
    from specdec.drafters.catalog import SHIPPED

    for kind, by_alias in SHIPPED.items():
        for variants in by_alias.values():
            for folder in variants.values():
                for name in ("config.json", "model.safetensors"):
                    path = f"specdec/drafters/shipped/{folder}/{name}"
                    assert path in _source_files(), f"{kind}: {path} is not in the checkout"
                    assert _package_data(path), f"{kind}: {path} is not package data"


def test_the_default_bench_prompts_are_package_data():
    """The bench commands' --dataset default (#52: they needed a file nobody shipped)."""
    from specdec.bench.data import DEFAULT_DATASET, load_questions

    path = "specdec/bench/" + DEFAULT_DATASET.name
    assert _source_files().get(path) == DEFAULT_DATASET and _package_data(path)
    questions = load_questions(DEFAULT_DATASET, None)
    assert len(questions) >= 32 and all(len(q.turns) == 2 for q in questions)
    assert len({q.category for q in questions}) >= 8


def _copy_or_stub(source: str, target: str) -> None:
    """Weights become empty files of the same name: the wheel's file list is what is checked,
    and zipping the shipped drafters' ~90 MB would take most of this test's time."""
    if source.endswith(".safetensors"):
        Path(target).touch()
    else:
        shutil.copy2(source, target)


def test_the_wheel_holds_every_module_and_data_file(tmp_path):
    src = tmp_path / "src"
    for folder in {*PACKAGE_DIR.values()}:
        shutil.copytree(REPO / folder, src / folder, copy_function=_copy_or_stub,
                        ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    env = {**os.environ, "SPECDEC_NO_NATIVE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (wheel,) = (tmp_path / "dist").glob("specdec-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
    expected = {n for n in _source_files() if n.endswith(".py") or _package_data(n)}
    missing = sorted(expected - names)
    assert not missing, f"{wheel.name} leaves out {len(missing)} files: {missing[:20]}"
    not_shipped = sorted(n for n in names if any(fnmatch.fnmatch(n, p) for p in NOT_SHIPPED))
    assert not not_shipped, f"{wheel.name} ships {not_shipped}"
    assert "specdec = specdec.cli:main" in entry_points
