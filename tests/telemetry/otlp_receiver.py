"""A minimal OTLP receiver for tests: opentelemetry-proto's Trace and Metrics services over gRPC,
and ``/v1/traces`` / ``/v1/metrics`` protobuf posts over HTTP, both on 127.0.0.1 port 0."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def value_of(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: value_of(kv.value) for kv in kvs if isinstance(kv, KeyValue)}


@dataclass
class Received:
    traces: list[trace_service_pb2.ExportTraceServiceRequest] = field(default_factory=list)
    metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received):
        self._received = received

    def Export(self, request, context):
        with self._received.lock:
            self._received.traces.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, received: Received):
        self._received = received

    def Export(self, request, context):
        with self._received.lock:
            self._received.metrics.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _http_handler(received: Received) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            encoding = self.headers.get("Content-Encoding", "")
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            response: Any
            if self.path == "/v1/traces":
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with received.lock:
                    received.traces.append(request)
                response = trace_service_pb2.ExportTraceServiceResponse()
            elif self.path == "/v1/metrics":
                metrics_request = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
                with received.lock:
                    received.metrics.append(metrics_request)
                response = metrics_service_pb2.ExportMetricsServiceResponse()
            else:
                self.send_error(404)
                return
            payload = response.SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    return Handler


class OtlpReceiver:
    def __init__(self) -> None:
        self.received = Received()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _TraceService(self.received), self._grpc
        )
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _MetricsService(self.received), self._grpc
        )
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _http_handler(self.received))
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def start(self) -> OtlpReceiver:
        self._grpc.start()
        self._http_thread.start()
        return self

    def stop(self) -> None:
        self._grpc.stop(grace=None)
        self._http.shutdown()
        self._http.server_close()

    def endpoint(self, protocol: str) -> str:
        port = self.grpc_port if protocol == "grpc" else self.http_port
        return f"http://127.0.0.1:{port}"

    def spans(self, service_name: str) -> list[Span]:
        with self.received.lock:
            requests = list(self.received.traces)
        return [
            span
            for request in requests
            for rs in request.resource_spans
            if attributes(rs.resource.attributes).get("service.name") == service_name
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def metrics(self, service_name: str) -> dict[str, Metric]:
        """The latest export of each metric under the service (exports are cumulative)."""
        with self.received.lock:
            requests = list(self.received.metrics)
        return {
            metric.name: metric
            for request in requests
            for rm in request.resource_metrics
            if attributes(rm.resource.attributes).get("service.name") == service_name
            for sm in rm.scope_metrics
            for metric in sm.metrics
        }

    def wait_for(self, condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.05)
        return condition()
