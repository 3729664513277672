"""The metrics file: strict JSON lines, its readers, and the numbers the start lines print."""

import json
import math

import pytest

from tests.helpers import make_cfg

def test_metrics_records_are_strict_json_with_non_finite_values_as_strings(tmp_path):
    """JSON has no NaN or infinity: a logged NaN, inf or -inf is written as the string
    "nan", "inf", "-inf" (nested too), so every line parses as strict JSON."""
    from stabletrain.metrics import Metrics, _clean, read_records

    assert _clean({"a": math.inf, "b": [math.nan, -math.inf, 1.5], "c": {"d": math.inf}}) == {
        "a": "inf", "b": ["nan", "-inf", 1.5], "c": {"d": "inf"}}
    m = Metrics(tmp_path, make_cfg("logger=none").logger)
    m.log(3, {"loss": math.inf, "grad_norm": math.nan, "lr": 0.5})
    m.close()
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert read_records(tmp_path / "metrics.jsonl") == [{"step": 3, "loss": "inf", "grad_norm": "nan", "lr": 0.5}]


def test_metrics_file_readers_take_the_last_record_and_whole_objects_only(tmp_path):
    """``logged_value`` is the value last logged at the step (a rollback logs a step again);
    ``read_lines`` keeps JSON objects only; ``begin_with`` copies another run's records up to and
    including the step the run resumes from."""
    from stabletrain.metrics import Metrics, logged_value, read_lines

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 3, "loss": 0.5}\n{"step": 4, "loss": 1.0}\n[4, 1.0]\n7\n{"step": 4, "loss": 2.0}\n'
                    '{"step": 5, "lr": 0.1}\n{"step": 6, "lo')  # a list, a number and a torn last line
    assert read_lines(path) == ['{"step": 3, "loss": 0.5}', '{"step": 4, "loss": 1.0}', '{"step": 4, "loss": 2.0}',
                                '{"step": 5, "lr": 0.1}']
    assert logged_value(path, "loss", 4) == 2.0
    assert math.isnan(logged_value(path, "loss", 5))
    run = tmp_path / "resumed"
    run.mkdir()
    m = Metrics(run, make_cfg("logger=none").logger)
    assert m.begin_with(path, 4) == 3
    m.close()
    assert read_lines(run / "metrics.jsonl") == read_lines(path)[:3]


def test_param_count_switches_unit_at_each_thousand():
    """``999``, then ``1.00K`` from 1000 on; ``124.44M``; ``1.00G``."""
    from stabletrain.metrics import param_count

    assert [param_count(n) for n in (999, 1000, 33_730, 124_440_000, 10**9)] == [
        "999", "1.00K", "33.73K", "124.44M", "1.00G"]
