"""`with_replica`: every sample of an exposition gains the `replica` label, however its
label values are written, and what Prometheus parses back is the original plus it."""

from __future__ import annotations

import pytest
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics_labels import with_replica


def samples(exposition: bytes) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(exposition.decode())
        for s in family.samples
    ]


def test_plain_and_labelled_samples_gain_the_label_and_comments_stay():
    text = b'# HELP x_total things\n# TYPE x_total counter\nx_total 3.0\ny{a="b"} 1.0\n'
    assert with_replica(text, "7") == (
        b'# HELP x_total things\n# TYPE x_total counter\nx_total{replica="7"} 3.0\n'
        b'y{a="b",replica="7"} 1.0\n'
    )


@pytest.mark.parametrize(
    "value",
    ["}", ",", "a,b=c", 'say "hi"', "back\\slash", 'x"},{replica="1', "line\nbreak", " ", ""],
)
def test_tricky_label_values_survive_and_the_label_is_added_once(value):
    registry = CollectorRegistry()
    gauge = Gauge(
        "custody_tricky", "values that break a naive split", ["k", "m"], registry=registry
    )
    gauge.labels(value, "z").set(2)
    Histogram("custody_h_seconds", "a histogram", ["k"], registry=registry).labels(value).observe(1)
    raw = generate_latest(registry)
    relabelled = with_replica(raw, "r-1.x")
    expected = [(n, labels | {"replica": "r-1.x"}, v) for n, labels, v in samples(raw)]
    assert samples(relabelled) == expected
    assert relabelled.count(b'replica="r-1.x"') == len(expected)


def test_spacing_a_trailing_comma_empty_braces_and_timestamps():
    text = b'a{ x = "1" , } 1 1700000000\nb{} 2\nc{x="1",y="}"} NaN\n'
    assert with_replica(text, "0") == (
        b'a{ x = "1",replica="0"} 1 1700000000\nb{replica="0"} 2\nc{x="1",y="}",replica="0"} NaN\n'
    )


def test_a_sample_that_names_its_replica_keeps_it():
    text = b'ledger{kind="gap",replica="3"} 1.0\nother{note="replica=\\"9\\""} 0.0\n'
    assert with_replica(text, "0") == (
        b'ledger{kind="gap",replica="3"} 1.0\nother{note="replica=\\"9\\"",replica="0"} 0.0\n'
    )


def test_a_line_that_is_not_a_sample_is_refused():
    for line in (b'x{a="1} 2\n', b"x{a=1} 2\n", b"x\n", b"{a} 1\n"):
        with pytest.raises(ValueError, match="not a sample line"):
            with_replica(line, "0")


def test_library_metrics_all_carry_the_label():
    registry = CollectorRegistry()
    Counter("custody_c", "c", registry=registry).inc()
    for raw in (generate_latest(registry), generate_latest(REGISTRY)):
        for _, labels, _ in samples(with_replica(raw, "0")):
            assert labels["replica"] == "0"
