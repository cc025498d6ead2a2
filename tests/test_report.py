"""blockpad report padding: seed 000's Appendix A chain run for real under every policy."""

import json

import pytest

from blockpad.report import padding
from blockpad.vocabulary import POLICIES


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    return padding.main(json_path=str(out / "rows.json"), png_path=str(out / "plot.png"),
                        iterations=1, hw=6, build_root=str(out / "build")), out


def test_every_policy_gives_the_numpy_answer(rows):
    rows, _ = rows
    assert [r.policy for r in rows] == list(POLICIES)
    assert all(r.results_match for r in rows)


def test_counts_follow_from_the_code(rows):
    rows, _ = rows
    by = {r.policy: r for r in rows}
    n = by["on_handle"].zero_pad_calls
    assert n > 0 and by["on_handle"].blocking_calls == n          # every wrap, on the caller
    assert by["dst_fused"].zero_pad_calls == 0 and by["dst_fused"].bytes_zeroed == 0
    assert by["tracked"].zero_pad_calls == 0                      # clean producers all the way
    assert 0 < by["user"].zero_pad_calls < n and by["user"].blocking_calls == 0   # on a stream
    assert by["dst_stage"].zero_pad_calls == 5                    # conv, relu, conv, sigmoid, softmax
    assert not by["dst_stage"].as_seed_predicted                  # and the table says it differs


def test_json_and_plot_are_written(rows):
    _, out = rows
    data = json.loads((out / "rows.json").read_text())
    assert {"policy", "zero_pad_calls", "bytes_zeroed", "time_share", "blocking_calls",
            "results_match"} <= set(data[0])
    assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"
