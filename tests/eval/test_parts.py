"""The job's pure-Python parts against brute-force checks: perplexity windows, buckets and
length-sorted plans, the results file's repair and resume keys, the progress line."""

import io
import json

import numpy as np
import pytest

from k3jax.eval import batching
from k3jax.eval.output import Done, ResultsWriter, load_records
from k3jax.eval.progress import Progress
from k3jax.eval.requests import encode_pair, windows


@pytest.mark.parametrize("n,window,stride", [(2, 4, 1), (10, 4, 3), (33, 8, 5), (64, 16, 8), (7, 16, 15)])
def test_windows_score_each_token_once_with_the_context_the_window_allows(n, window, stride):
    scored = []
    for begin, end, start in windows(n, window, stride):
        assert 0 <= begin < end <= n and end - begin == min(window, n) and start >= 1
        for t in range(begin + start, end):
            scored.append(t)
            assert t - begin >= (t if t < window else window - stride)  # left context inside the window
    assert scored == list(range(1, n))
    with pytest.raises(ValueError, match="stride"):
        windows(n, window, window)


def test_buckets_and_sorted_plans_pad_less_than_input_order():
    sizes = batching.length_buckets(100)
    assert sizes == (16, 24, 32, 48, 64, 96, 100)
    assert [batching.bucket(n, sizes) for n in (1, 16, 17, 33, 97)] == [16, 16, 24, 48, 100]
    lengths = np.random.default_rng(0).integers(1, 101, 50)
    sorted_plan = batching.plan(lengths, 8, sizes)
    unsorted_plan = batching.plan(lengths, 8, sizes, sort=False)
    for plan in (sorted_plan, unsorted_plan):
        assert sorted(r for b in plan for r in b.rows) == list(range(50))
        assert all(b.length >= max(lengths[list(b.rows)]) for b in plan)
    assert [len(b.rows) for b in sorted_plan] == [8] * 6 + [2]
    assert list(lengths[list(sorted_plan[0].rows)]) == sorted(lengths, reverse=True)[:8]
    waste = batching.padding_waste(lengths, sorted_plan, 8)
    assert waste == pytest.approx(1 - lengths.sum() / sum(8 * b.length for b in sorted_plan))
    assert waste < batching.padding_waste(lengths, unsorted_plan, 8)


def test_results_file_cuts_a_partial_line_and_sorts_by_input_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "b", "line": 2, "loglikelihood": -1.0}\n{"id": 5, "line": 1, "error": "x"}\n'
                    '{"id": "c", "li')
    done = Done(load_records(str(path)))
    assert done.has("b") and not done.has(5) and done.lines == {1, 2}  # errors resume by line
    assert not done.has("c") and Done.from_json(done.to_json()).ids == done.ids
    writer = ResultsWriter(str(path))
    assert path.read_text().endswith("}\n")  # the partial line is gone
    writer.write([{"id": "c", "line": 3, "loglikelihood": -2.0}, {"id": "a", "line": 0, "loglikelihood": -3.0}])
    assert writer.finalize() == 4
    assert [json.loads(line)["line"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]


def test_encode_pair_moves_trailing_spaces_to_the_continuation():
    class Bytes:
        def encode(self, text):
            return list(text.encode())

    assert encode_pair(Bytes(), "ab  ", "c") == ([97, 98], [32, 32, 99])


def test_progress_line_shows_rate_and_eta():
    stream = io.StringIO()
    progress = Progress(10, "loglikelihood", stream=stream)
    progress.update(10)
    progress.close()
    line = stream.getvalue().strip()
    assert line.startswith("loglikelihood: 10/10 (100%)") and "ex/s" in line and "ETA 0:00:00" in line
    assert stream.getvalue().count("\n") == 1  # the final state drawn once
