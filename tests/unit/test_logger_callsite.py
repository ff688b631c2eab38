"""unified.logging's records name the caller's file and line, as Accelerate's do (its
tests/test_logging.py::test_log_stack; issue 24)."""
from __future__ import annotations


def test_the_logger_names_the_callers_line(caplog):
    import logging

    from unified.logging import get_logger

    logger = get_logger(__name__)
    with caplog.at_level(logging.INFO):
        logger.warning("a")
        logger.log(logging.WARNING, "b")
        logger.info("c", main_process_only=False)
    assert ([(r.filename, r.funcName) for r in caplog.records]
            == [("test_logger_callsite.py", "test_the_logger_names_the_callers_line")] * 3)
