"""Sessions: lint, tests (mypy and pytest in one venv, installed once) and docs (the site, --strict). `nox` runs all three; CI runs `nox`.

`nox -s quick` is the fast subset: lint and the tests that start no process
(no worker, no subprocess, no emulator), about a minute once its venv exists
(`nox -r -s quick` reuses it).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests", "docs"]
nox.options.error_on_missing_interpreters = True

CONSTRAINTS = ("-c", "constraints/ci.txt")
LINTED = ("datacat", "tests", "scripts", "benchmarks", "noxfile.py")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, tests, scripts and this file; import-linter's layers contract over datacat/."""
    session.install(*CONSTRAINTS, "ruff", "import-linter", "-e", ".")
    session.run("ruff", "check", *LINTED)
    session.run("ruff", "format", "--check", "--diff", *LINTED)
    session.run("lint-imports")


@nox.session
def tests(session: nox.Session) -> None:
    """mypy --strict, then pytest, against the installed package with every extra (one install for both)."""
    session.install(*CONSTRAINTS, ".[all,test]", "mypy", "types-PyYAML")
    session.install("--no-deps", "./tests/plugin")  # a format from outside datacat, found by its entry point
    # Either torch build passes; say which one this run has (README: the CPU build comes from PyTorch's index).
    session.run("python", "-c", "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)")
    session.run("mypy")
    # Two pytest processes: most slow tests wait on worker processes starting or an emulator answering,
    # so two share the cores well. `nox -s tests -- -n 0` runs one.
    session.run("pytest", "-n", "2", "--dist", "worksteal", *session.posargs)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict alone (the tests session runs it too)."""
    session.install(*CONSTRAINTS, ".[all]", "mypy", "types-PyYAML")
    session.run("mypy")


@nox.session
def quick(session: nox.Session) -> None:
    """Lint and the tests marked not slow: the catalog, formats and transforms, in one process."""
    session.install("ruff", *CONSTRAINTS, ".[all,test]")
    session.install("--no-deps", "./tests/plugin")
    session.run("ruff", "check", *LINTED)
    session.run("pytest", "-m", "not slow", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site, built with --strict: a broken link or reference fails."""
    session.install(*CONSTRAINTS, ".[docs,images]")
    session.run("mkdocs", "build", "--strict", "--site-dir", session.create_tmp() + "/site")
