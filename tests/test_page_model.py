"""tools/page_model.py: the idealized page model the README quotes (issue 15)."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import page_model  # noqa: E402

MiB = 1 << 20


def test_stitching_uses_the_free_ends_of_pages_that_rounding_leaves():
    # 3 MiB then two 1.5 MiB: page by page each request ends in a page of its own (4 pages
    # for 6 MiB); stitched, the second starts in the first's last page and the third fits
    # in the rest of the second's (3 pages)
    ops = [["a", 0, 3 * MiB], ["a", 1, 3 * MiB // 2], ["a", 2, 3 * MiB // 2]]
    assert page_model.run(ops, "pages") == 8 / 6
    assert page_model.run(ops, "stitch") == 1.0


def test_small_requests_share_large_pages_only_in_the_mixed_model():
    ops = [["a", 0, 3 * MiB], ["a", 1, 4096], ["f", 0]]
    assert page_model.run(ops, "stitch") == 3 * 2 * MiB / (3 * MiB + 4096)
    assert page_model.run(ops, "mixed") == 2 * 2 * MiB / (3 * MiB + 4096)


def test_pages_are_released_when_empty_and_the_report_lists_every_trace(capsys, tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text('{"name": "t", "ops": [["a", 0, 5000000], ["f", 0], ["a", 1, 1000], ["f", 1]]}')
    assert page_model.main([str(trace)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[0] == "t" and out[-1].split()[0] == "worst"


def test_offline_planner_reuses_a_gap_only_for_blocks_that_never_meet():
    # A and B (4 MiB each) live together; C (4 MiB) comes after A is freed: the planner puts C
    # where A was, so 4 pages cover peaks of 8 MiB live
    ops = [["a", 0, 4 * MiB], ["a", 1, 4 * MiB], ["f", 0], ["a", 2, 4 * MiB], ["f", 1], ["f", 2]]
    assert page_model.offline(ops) == 1.0
    # C meets A: it cannot go where A is, and takes a fifth page
    ops = [["a", 0, 4 * MiB], ["a", 1, 4 * MiB], ["a", 2, MiB], ["f", 0], ["f", 1], ["f", 2]]
    assert page_model.offline(ops) == 5 * 2 * MiB / (9 * MiB)


def test_help_prints_usage_and_a_missing_trace_is_a_clear_error(capsys):
    """--help is an option, not a trace path (it raised FileNotFoundError: '--help')."""
    import pytest
    with pytest.raises(SystemExit) as exc:
        page_model.main(["--help"])
    assert exc.value.code == 0
    assert "--offline" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        page_model.main(["no_such_trace.json"])
    assert exc.value.code == 2
    assert "no_such_trace.json" in capsys.readouterr().err
