"""SLURM compressed host-list expansion."""

from __future__ import annotations

import pytest

from slipstream.comm.hostlist import expand_nodelist


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("a[1-2]-b[3,5]", ["a1-b3", "a1-b5", "a2-b3", "a2-b5"]),
        ("x[2],y,z[0-1]suffix", ["x2", "y", "z0suffix", "z1suffix"]),
        ("  host-a , host-b ", ["host-a", "host-b"]),
    ],
)
def test_expand_nodelist(nodelist: str, expected: list[str]) -> None:
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    ("nodelist", "message"),
    [
        ("", "empty"),
        ("gpu[01-03", "unclosed"),
        ("gpu01-03]", "without"),
        ("gpu[[1]]", "nests"),
        ("gpu[3-1]", "ends before it starts"),
        ("gpu[a-b]", "not a number"),
        ("gpu[1,,2]", "empty item"),
        ("a,,b", "empty item"),
    ],
)
def test_expand_nodelist_rejects_malformed(nodelist: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expand_nodelist(nodelist)
