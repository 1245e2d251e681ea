from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# bitsandbytes wraps ops in torch.compile at import, which imports inductor, which starts a pool of
# compile workers (a process importing torch, ~2 s of CPU) in every process that imports it: every
# pool worker and launched rank of the suite. Nothing here compiles; one thread starts no pool.
# Children (spawned workers, torchrun ranks, CLI subprocesses) inherit the setting.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# NCCL's rules on every collective dist_optim issues (dist_optim/comm/rules.py): each gloo group is
# treated as an NCCL group on a simulated accelerator, so a host tensor handed to a collective, or
# sizes and dtypes that differ across ranks, fail here as they would on a GPU cluster. Before
# dist_optim is imported (the mode is read at import), and inherited by every child process.
os.environ.setdefault("DIST_OPTIM_COLLECTIVE_RULES", "nccl")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dist_optim.testing import DistPool  # noqa: E402
from tests.helpers import support  # noqa: E402

_POOLS: dict[int, DistPool] = {}


def _pool(n: int) -> DistPool:
    if n not in _POOLS:
        _POOLS[n] = DistPool(n)
    return _POOLS[n]


@pytest.fixture(scope="session")
def pool4() -> Iterator[DistPool]:
    yield _pool(4)


@pytest.fixture(scope="session")
def pool2() -> Iterator[DistPool]:
    yield _pool(2)


# The outcomes of this session, by JUnit test key: a run that executed every test backing the
# README's support table checks the README's copy against the table built from them.
_OUTCOMES = support.OutcomeRecorder()
_TABLE_PROBLEM: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _OUTCOMES.add(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
    with open(support.README) as f:
        problem = support.check_readme(_OUTCOMES.outcomes, f.read())
    if problem:
        _TABLE_PROBLEM.append(problem)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for problem in _TABLE_PROBLEM:
        terminalreporter.section("README support table", red=True)
        terminalreporter.write_line(problem)
