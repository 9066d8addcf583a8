import pytest

from agentkv.server.engine._connector._worker import omp_bind_cores


@pytest.mark.parametrize(
    ("value", "cores"),
    [
        ("3", {3}),
        ("0-3,6", {0, 1, 2, 3, 6}),
        ("1,1", {1}),
        # vLLM's own settings, one list per rank, and what this does not read: the thread stays where it is.
        ("auto", None),
        ("nobind", None),
        ("", None),
        ("0|1", None),
        ("0-", None),
        ("-1", None),
        ("1,,2", None),
        ("3-1", None),
    ],
)
def test_omp_bind_cores_reads_one_ranks_list(value: str, cores: set[int] | None) -> None:
    assert omp_bind_cores(value) == cores
