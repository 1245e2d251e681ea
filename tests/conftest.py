from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests._dist import DistPool  # noqa: E402

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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
