"""Sessions: lint, typecheck, tests. `nox` runs all three; CI runs `nox` too."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.error_on_missing_interpreters = True

CONSTRAINTS = ("-c", "constraints/ci.txt")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, tests, scripts and this file."""
    session.install("ruff")
    session.run("ruff", "check", "datacat", "tests", "scripts", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "--diff", "datacat", "tests", "scripts", "benchmarks", "noxfile.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, with every extra installed so backends are checked against real types."""
    session.install(*CONSTRAINTS, ".[all]", "mypy", "types-PyYAML")
    session.run("mypy")


@nox.session
def tests(session: nox.Session) -> None:
    """pytest against the installed wheel (not the source tree), every extra installed."""
    session.install(*CONSTRAINTS, ".[all,test]")
    # Either torch build passes; say which one this run has (README: the CPU build comes from PyTorch's index).
    session.run("python", "-c", "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)")
    session.run("pytest", *session.posargs)
