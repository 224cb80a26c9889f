"""``store.observe``: the instruments record what they should, and cost nothing when off.

The SDK is a test-only dependency: an in-memory metric reader and span exporter, handed to
``Instruments`` as its providers, so that no test sets the process-wide global ones. The
global providers (which can be set only once per process) and a missing API are tested in
fresh interpreters.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from store import StalePassError
from store.errors import ValidationError
from store.observe import COUNTERS, DURATION_BUCKETS, HAVE_OTEL, Instruments

pytestmark = pytest.mark.fake  # needs no server


@dataclass
class Telemetry:
    instruments: Instruments
    reader: InMemoryMetricReader
    exporter: InMemorySpanExporter
    tracer: trace.Tracer

    def metrics(self) -> dict[str, Any]:
        """Metric name -> metric, as the reader collects them now."""
        data = self.reader.get_metrics_data()
        assert data is not None
        return {
            metric.name: metric
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name in (None, s.name)]


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    instruments = Instruments(
        "ns-1", tracer_provider=tracer_provider, meter_provider=meter_provider
    )
    yield Telemetry(instruments, reader, exporter, tracer_provider.get_tracer("caller"))
    meter_provider.shutdown()
    tracer_provider.shutdown()


def test_the_api_is_installed_for_these_tests() -> None:
    assert HAVE_OTEL


def test_an_operation_records_its_duration_with_the_conventions_attributes(
    telemetry: Telemetry,
) -> None:
    for _ in range(3):
        with telemetry.instruments.operation("record_worker_report", "req-1"):
            pass

    histogram = telemetry.metrics()["db.client.operation.duration"]
    assert histogram.unit == "s"
    (point,) = histogram.data.data_points
    assert dict(point.attributes) == {
        "db.system.name": "redis",
        "db.operation.name": "record_worker_report",
        "db.namespace": "ns-1",
    }
    assert point.count == 3
    assert 0 < point.sum < 1
    assert tuple(point.explicit_bounds) == DURATION_BUCKETS


def test_a_failed_operation_carries_error_type_and_still_raises(telemetry: Telemetry) -> None:
    with (
        pytest.raises(StalePassError),
        telemetry.instruments.operation("advance_partition", "req-1"),
    ):
        raise StalePassError(3, 4, request_id="req-1")
    with telemetry.instruments.operation("advance_partition", "req-1"):
        pass

    points = telemetry.metrics()["db.client.operation.duration"].data.data_points
    by_error = {p.attributes.get("error.type"): p.count for p in points}
    assert by_error == {"StalePassError": 1, None: 1}
    failed, succeeded = telemetry.spans("advance_partition")
    assert failed.attributes is not None and failed.attributes["error.type"] == "StalePassError"
    assert failed.status.status_code is trace.StatusCode.ERROR
    assert "forward pass 3 is not current" in (failed.status.description or "")
    assert [e.name for e in failed.events] == ["exception"]
    assert succeeded.attributes is not None and "error.type" not in succeeded.attributes
    assert succeeded.status.status_code is trace.StatusCode.UNSET


def test_operations_are_spans_named_after_them_under_the_callers_span(
    telemetry: Telemetry,
) -> None:
    with telemetry.tracer.start_as_current_span("conductor step") as parent:
        with telemetry.instruments.operation("claim_step", "req-9"):
            inner = trace.get_current_span()
        after = trace.get_current_span()

    (span,) = telemetry.spans("claim_step")
    assert span.kind is trace.SpanKind.CLIENT
    assert span.parent is not None
    assert span.parent.span_id == parent.get_span_context().span_id
    assert span.context.trace_id == parent.get_span_context().trace_id
    assert dict(span.attributes or {}) == {
        "db.system.name": "redis",
        "db.operation.name": "claim_step",
        "db.namespace": "ns-1",
        "mstar.request.id": "req-9",
    }
    # The operation is the current span inside its block (for nested client spans) only.
    assert inner.get_span_context().span_id == span.context.span_id
    assert after is parent


def test_an_operation_without_a_request_has_no_request_attribute(telemetry: Telemetry) -> None:
    with telemetry.instruments.operation("due_steps", None):
        pass
    (span,) = telemetry.spans("due_steps")
    assert span.parent is None  # no caller's span: a root
    assert "mstar.request.id" not in (span.attributes or {})


async def test_spans_follow_each_asyncio_task(telemetry: Telemetry) -> None:
    async def step(rid: str) -> int:
        with telemetry.tracer.start_as_current_span(f"drive {rid}") as parent:
            with telemetry.instruments.operation("record_worker_report", rid):
                await asyncio.sleep(0.01)  # the other task runs its operation meanwhile
            return parent.get_span_context().span_id

    parents = await asyncio.gather(step("req-a"), step("req-b"))

    spans = {
        (s.attributes or {})["mstar.request.id"]: s for s in telemetry.spans("record_worker_report")
    }
    assert {rid: s.parent.span_id for rid, s in spans.items() if s.parent} == {
        "req-a": parents[0],
        "req-b": parents[1],
    }


def test_counters_count_under_their_names(telemetry: Telemetry) -> None:
    telemetry.instruments.count("retries", 3)
    telemetry.instruments.count("retries")
    telemetry.instruments.count("takeovers")

    metrics = telemetry.metrics()
    retries = metrics["mstar.store.retries"]
    (point,) = retries.data.data_points
    assert point.value == 4
    assert dict(point.attributes) == {"db.system.name": "redis", "db.namespace": "ns-1"}
    assert retries.data.is_monotonic
    assert metrics["mstar.store.takeovers"].data.data_points[0].value == 1
    assert telemetry.instruments.totals() == {**dict.fromkeys(COUNTERS, 0), "retries": 4,
                                              "takeovers": 1}  # fmt: skip


def test_every_counter_has_its_otel_name() -> None:
    assert {name for name, _, _ in COUNTERS.values()} == {
        f"mstar.store.{short}" for short in COUNTERS
    }
    assert set(COUNTERS) >= {"retries", "conflicts", "duplicates", "fenced", "takeovers", "passes"}


@pytest.mark.parametrize(("counter", "n", "message"), [
    ("retry", 1, "unknown counter 'retry'; known: retries, "),
    ("retries", -1, "cannot go down"),
])  # fmt: skip
def test_bad_counter_calls_are_typed_errors(
    telemetry: Telemetry, counter: str, n: int, message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        telemetry.instruments.count(counter, n)
    assert set(telemetry.instruments.totals().values()) == {0}


def test_with_the_api_and_no_provider_nothing_records_and_totals_still_count() -> None:
    # This process never sets a global provider, so the API's are its proxies.
    instruments = Instruments("ns-2")
    with instruments.operation("load_request", "r") as entered:
        pass
    with pytest.raises(KeyError), instruments.operation("load_request", "r"):
        raise KeyError("goes through")
    instruments.count("duplicates", 2)

    assert entered is None
    assert type(instruments.operation("x")).__name__ == "_NoOperation"
    assert instruments.totals()["duplicates"] == 2


def _run_python(source: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_without_the_api_installed_everything_is_a_no_op() -> None:
    out = _run_python(
        """
        import sys
        sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
        from store import observe
        instruments = observe.Instruments("ns")
        with instruments.operation("record_worker_report", "r"):
            pass
        try:
            with instruments.operation("record_worker_report", "r"):
                raise ValueError("still raised")
        except ValueError as e:
            print("raised", e)
        instruments.count("passes", 5)
        print(observe.HAVE_OTEL, instruments.totals()["passes"])
        """
    )
    assert out.splitlines() == ["raised still raised", "False 5"]


def test_global_providers_set_after_start_up_are_picked_up() -> None:
    out = _run_python(
        """
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )
        from store import observe

        instruments = observe.Instruments("ns")
        with instruments.operation("before", "r"):
            pass
        exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        with instruments.operation("unseen yet", "r"):  # checked at most once a second
            pass
        instruments.refresh()
        with instruments.operation("after", "r"):
            pass
        instruments.count("fenced")
        names = [m.name for rm in reader.get_metrics_data().resource_metrics
                 for sm in rm.scope_metrics for m in sm.metrics]
        print([s.name for s in exporter.get_finished_spans()], sorted(names))
        """
    )
    assert out.strip() == "['after'] ['db.client.operation.duration', 'mstar.store.fenced']"
