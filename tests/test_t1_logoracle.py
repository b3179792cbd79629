"""Tier 1: the log oracle of every tier (conftest.log_oracle) fails a test on what the core
logs unexpectedly, and lets what the test allows pass."""

from __future__ import annotations

import logging
from pathlib import Path

from dlcachefs.testing.mounting import SMALL_CGROUP, record_problems

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def _record(level: int, msg: str, name: str = "dlcachefs.cache.reader", exc=None):
    return logging.LogRecord(name, level, __file__, 1, msg, None, exc)


def test_record_problems_keeps_what_no_regex_allows():
    try:
        raise ValueError("boom")
    except ValueError as e:
        exc = (type(e), e, e.__traceback__)
    records = [_record(logging.INFO, "fine"), _record(logging.WARNING, "chunk 3 unreadable"),
               _record(logging.ERROR, "failed", exc=exc),
               _record(logging.WARNING, "memory cgroup limit 512 MiB leaves 100 MiB",
                       name="dlcachefs.session")]
    problems = record_problems(records)
    assert len(problems) == 2  # INFO is no problem, a small cgroup's warning is allowed
    assert "WARNING dlcachefs.cache.reader: chunk 3 unreadable" in problems[0]
    assert "Traceback (most recent call last)" in problems[1] and "ValueError: boom" in problems[1]
    assert record_problems(records, [r"chunk \d+ unreadable", r"ValueError: boom"]) == []
    assert SMALL_CGROUP


def test_the_fixture_fails_a_test_on_an_unexpected_warning_or_traceback(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner='''
import logging
import pytest

log = logging.getLogger("dlcachefs.cache.fetch")

def test_quiet():
    log.info("nothing to see")

def test_warns():
    log.warning("the source failed")

def test_raises_in_a_task():
    try:
        1 / 0
    except ZeroDivisionError:
        log.exception("a background step failed")

@pytest.mark.daemon_log_allows(r"WARNING dlcachefs\\.cache\\.fetch: the source failed")
def test_warns_as_allowed():
    log.warning("the source failed")

def test_other_loggers_are_not_watched():
    logging.getLogger("somebody.else").error("not ours")
''')
    # (in a subprocess: the inner tests' records must not reach this test's own oracle)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5, errors=2)
    out = result.stdout.str()
    assert "ERROR at teardown of test_warns " in out or "test_warns -" in out
    assert "ZeroDivisionError" in out
