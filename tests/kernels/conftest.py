"""Kernel-test fixtures: random inputs from one seed per run, shown in the header."""

import zlib

import pytest

from tests.kernels.helpers import RUN_SEED


def pytest_report_header(config):
    return f"kernel tests: PAGEDSERVE_TEST_SEED={RUN_SEED}"


@pytest.fixture
def seed(request) -> int:
    """A seed for this test's inputs: the run's seed, offset by the test id so that cases differ."""
    return (RUN_SEED + zlib.crc32(request.node.name.encode())) % 2**31
