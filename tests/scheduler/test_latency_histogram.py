"""The step-at-a-time histogram reads as prometheus_client's own would for the same
values: buckets cumulative, a value on a bound counted in that bound's bucket."""

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from services.scheduler.runtime.latency_histogram import StepHistogram

BUCKETS = (0.001, 0.01, 0.1, 1)


def test_a_batch_observed_at_once_exposes_what_one_by_one_observation_does() -> None:
    values = [0.0005, 0.001, 0.0011, 0.01, 0.5, 1.0, 3.0, 0.05]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batched = StepHistogram("lat_seconds", "a latency", BUCKETS, ours)
    reference = Histogram("lat_seconds", "a latency", buckets=BUCKETS, registry=theirs)
    batched.observe_many(values[:5])
    batched.observe_many([])
    batched.observe(values[5])
    batched.observe_many(values[6:])
    for v in values:
        reference.observe(v)

    def samples(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return sorted(line for line in text.splitlines() if "_created" not in line)

    assert samples(ours) == samples(theirs)
    assert 'lat_seconds_bucket{le="0.001"} 2.0' in samples(ours)  # 0.0005 and 0.001
