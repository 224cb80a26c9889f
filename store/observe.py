"""What the store tells operators: logger names, and OpenTelemetry instruments.

Logging
-------
Every module logs to its own logger, ``logger = logging.getLogger(__name__)``, so all of them
sit under the ``store`` hierarchy (``store.store``, ``store.io.sync``, ...) and one
``logging.getLogger("store").setLevel(...)`` tunes them all. The library adds no handler:
the application configures logging; without any configuration Python prints WARNING and
above to stderr (``logging.lastResort``), which is where the server warnings belong.

Which event goes at which level:

=========  ==================================================================================
DEBUG      retries of an optimistic transaction, conflicts, duplicates absorbed: normal
           under contention, interesting only when chasing a problem
INFO       takeovers (a step claimed from a replica whose lease ran out), fenced refusals
           (a write of a replica that lost its lease), upgrades of old records, requests
           reaped: rare events that change who drives what
WARNING    server settings that put data at risk: an evicting ``maxmemory-policy``, no AOF
=========  ==================================================================================

Nothing is logged at INFO or above per hot-path call (a report, a merge, a load). Use
``%``-style arguments (``logger.debug("retry %d of %s", n, rid)``) so that a disabled level
costs one call, never an f-string.

OpenTelemetry
-------------
``Instruments(namespace)`` follows the database-client semantic conventions: a histogram
``db.client.operation.duration`` (seconds) per store operation with ``db.system.name``
``"redis"``, ``db.operation.name`` (the store operation, e.g. ``record_worker_report``),
``db.namespace`` (the key namespace) and, on failure, ``error.type`` (the exception's class
name: a ``StalePassError`` or ``FencedError`` shows as one); a span per operation named after
it, of kind CLIENT, carrying the same attributes and ``mstar.request.id``, a child of the
caller's current span (contextvars, so asyncio tasks too); and the counters of
``COUNTERS`` as ``mstar.store.<name>``.

Only ``opentelemetry-api`` is needed (the ``otel`` extra); the application installs the SDK
and sets its providers. The cost is kept off the hot path:

- without the API installed, an operation is a shared no-op context manager;
- with the API but no provider set (the API's global providers start as proxies), nothing is
  timed, no span or attribute dict is built; whether a real provider has been set is checked
  at most once per ``RECHECK_INTERVAL`` seconds (``refresh()`` checks at once), and no more
  once both are real, since the API lets a global provider be set only once;
- with real providers, attribute dicts are built once per operation name.

``benchmarks/observe_overhead.py`` measures the cost per call in each of these cases.
Whatever is installed, ``Instruments`` keeps in-process cumulative totals of the counters
(``totals()``), which the replica runtime flushes to Redis with its heartbeat
(``store.stats``).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from types import TracebackType
from typing import Any, Final

from store.errors import ValidationError

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics as otel_metrics
    from opentelemetry import trace as otel_trace
except ImportError:  # the `otel` extra is not installed: every instrument is a no-op
    HAVE_OTEL = False
else:
    HAVE_OTEL = True

logger = logging.getLogger(__name__)

SCOPE = "mstar-conductor-store"  # the instrumentation scope: this distribution
DURATION = "db.client.operation.duration"
RECHECK_INTERVAL = 1.0  # seconds between checks for a provider set after start-up

# Short name -> (OpenTelemetry name, unit, description). Totals are kept for each.
COUNTERS: Final[dict[str, tuple[str, str, str]]] = {
    "retries": (
        "mstar.store.retries", "{retry}", "optimistic transactions retried after a conflict",
    ),
    "conflicts": (
        "mstar.store.conflicts", "{operation}", "operations that ran out of tries and gave up",
    ),
    "duplicates": (
        "mstar.store.duplicates", "{operation}",
        "redelivered operations recognised and absorbed (they changed nothing)",
    ),
    "fenced": (
        "mstar.store.fenced", "{write}", "writes refused because their lease was superseded",
    ),
    "takeovers": (
        "mstar.store.takeovers", "{step}", "steps claimed after their driver's lease ran out",
    ),
    "passes": ("mstar.store.passes", "{pass}", "forward passes advanced"),
    "reports": ("mstar.store.reports", "{report}", "worker reports applied (not duplicates)"),
    "finished": ("mstar.store.finished", "{request}", "requests finished"),
}  # fmt: skip

# Store operations last about 100 us on a LAN; the conventions' advice starts at 1 ms, which
# would put every sample in its first bucket. An advisory only: a View overrides it.
DURATION_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip

_SYSTEM = {"db.system.name": "redis"}


class _NoOperation:
    """What ``operation`` returns when nothing records: enter and exit do nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


_NO_OPERATION: Final = _NoOperation()


class Instruments:
    """The OpenTelemetry instruments and counter totals of one store (one namespace).

    ``tracer_provider`` / ``meter_provider`` default to the API's global ones (as
    OpenTelemetry's own instrumentations do); pass them to use others, e.g. in tests.
    """

    def __init__(
        self,
        namespace: str,
        *,
        tracer_provider: Any = None,
        meter_provider: Any = None,
    ) -> None:
        self.namespace = namespace
        self._attributes: dict[str, str] = {**_SYSTEM, "db.namespace": namespace}
        self._operation_attributes: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(COUNTERS, 0)
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._tracer: Any = None
        self._histogram: Any = None
        self._counters: dict[str, Any] = {}
        # Nothing to look for without the API; else look at the first call.
        self._settled = not HAVE_OTEL
        self._live = False
        self._recheck_at = -math.inf

    def operation(self, name: str, request_id: str | None = None) -> _Operation | _NoOperation:
        """A context manager around one store operation: times it, records it, traces it.

        A plain sync context manager, for sync code and inside ``async def`` alike. When the
        block raises, the duration and the span carry ``error.type``; the exception goes on.
        """
        if self.recording():
            return _Operation(self, name, request_id)
        return _NO_OPERATION

    def recording(self) -> bool:
        """Whether operations are recorded (a tracer or a meter is set): when not, a store
        skips ``operation`` and what it would be given."""
        if not self._settled and time.monotonic() >= self._recheck_at:
            self.refresh()
        return self._live

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to a counter of ``COUNTERS`` (by short name, e.g. ``"retries"``)."""
        if n < 0:
            raise ValidationError(f"counter {counter!r} cannot go down by {-n}")
        with self._lock:
            try:
                self._totals[counter] += n
            except KeyError:
                raise ValidationError(
                    f"unknown counter {counter!r}; known: {', '.join(COUNTERS)}"
                ) from None
        if not self._settled and time.monotonic() >= self._recheck_at:
            self.refresh()
        if self._counters:
            self._counters[counter].add(n, self._attributes)

    def totals(self) -> dict[str, int]:
        """Cumulative in-process totals of every counter since this object was made."""
        with self._lock:
            return dict(self._totals)

    def refresh(self) -> None:
        """Look for real providers now (else it happens within ``RECHECK_INTERVAL``)."""
        if self._settled:
            return
        self._recheck_at = time.monotonic() + RECHECK_INTERVAL
        if self._tracer is None:
            provider = self._tracer_provider or otel_trace.get_tracer_provider()
            if not isinstance(provider, _NO_OP_TRACER_PROVIDERS):
                self._tracer = provider.get_tracer(SCOPE, _version())
                logger.debug("tracing store operations of %r", self.namespace)
        if self._histogram is None:
            provider = self._meter_provider or otel_metrics.get_meter_provider()
            if not isinstance(provider, _NO_OP_METER_PROVIDERS):
                self._start_metering(provider.get_meter(SCOPE, _version()))
        self._live = self._tracer is not None or self._histogram is not None
        # A global provider is set once at most, so two real ones never change again.
        self._settled = self._tracer is not None and self._histogram is not None

    def _start_metering(self, meter: Any) -> None:
        self._counters = {
            short: meter.create_counter(name, unit=unit, description=description)
            for short, (name, unit, description) in COUNTERS.items()
        }
        self._histogram = meter.create_histogram(
            DURATION,
            unit="s",
            description="Duration of store operations",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        logger.debug("metering store operations of %r", self.namespace)

    def _attributes_of(self, operation: str) -> dict[str, str]:
        attributes = self._operation_attributes.get(operation)
        if attributes is None:
            attributes = {**self._attributes, "db.operation.name": operation}
            self._operation_attributes[operation] = attributes
        return attributes


class _Operation:
    """One traced and timed operation (only made when a real provider is set)."""

    __slots__ = ("_instruments", "_name", "_request_id", "_span", "_start", "_token")

    def __init__(self, instruments: Instruments, name: str, request_id: str | None) -> None:
        self._instruments = instruments
        self._name = name
        self._request_id = request_id
        self._span: Any = None
        self._token: Any = None
        self._start = 0.0

    def __enter__(self) -> None:
        tracer = self._instruments._tracer
        if tracer is not None:
            attributes: dict[str, str] = self._instruments._attributes_of(self._name)
            if self._request_id is not None:
                attributes = {**attributes, "mstar.request.id": self._request_id}
            self._span = tracer.start_span(
                self._name, kind=otel_trace.SpanKind.CLIENT, attributes=attributes
            )
            self._token = otel_context.attach(otel_trace.set_span_in_context(self._span))
        self._start = time.perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        elapsed = time.perf_counter() - self._start
        instruments = self._instruments
        error = exc_type.__qualname__ if exc_type is not None else None
        if instruments._histogram is not None:
            attributes = instruments._attributes_of(self._name)
            if error is not None:
                attributes = {**attributes, "error.type": error}
            instruments._histogram.record(elapsed, attributes)
        span = self._span
        if span is not None:
            otel_context.detach(self._token)
            if error is not None:
                span.set_attribute("error.type", error)
                span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, str(exc)))
                if exc is not None:
                    span.record_exception(exc)
            span.end()


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(SCOPE)
    except PackageNotFoundError:  # running from a source tree that was not installed
        return ""


def _no_op_providers() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """The provider types that record nothing: the API's proxies (no provider set yet)
    and its no-op providers."""
    if not HAVE_OTEL:
        return (), ()
    tracer = (otel_trace.ProxyTracerProvider, otel_trace.NoOpTracerProvider)
    meter: tuple[type, ...] = (otel_metrics.NoOpMeterProvider,)
    # The proxy meter provider is not public; without it a proxy just counts as real, which
    # is correct (proxies forward) and only slower.
    proxy = getattr(otel_metrics, "_internal", None)
    proxy_type = getattr(proxy, "_ProxyMeterProvider", None)
    if isinstance(proxy_type, type):
        meter += (proxy_type,)
    return tracer, meter


_NO_OP_TRACER_PROVIDERS, _NO_OP_METER_PROVIDERS = _no_op_providers()
