"""AdminServer: a shard's control plane on the admin port (ShardAdmin,
grpc.health.v1, reflection), served by an asyncio gRPC server on a thread
of its own.

The event loop reads every call's metadata and request message, checks the
auth token, and answers health checks and reflection itself. ShardAdmin's
methods (synchronous code: saves, loads, Stats ...) run on a pool of worker
threads, and only once their request message has arrived. A peer that opens
streams and sends nothing holds no thread: with a synchronous gRPC server,
each such stream held one of its threads waiting for a message, and 8 of
them left health checks and Stats unanswered."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent import futures
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from tf_dlt import grpc_util, tls
from tf_dlt.proto import dlt_pb2

log = logging.getLogger("tf_dlt.server")

# Calls refused for their token: one log line at most this often.
REFUSAL_LOG_SECONDS = 10.0

_SERVICE = dlt_pb2.DESCRIPTOR.services_by_name["ShardAdmin"]
SERVICE_NAME = _SERVICE.full_name
# A call with another token than the shard's (or none): how to give it
# (the data plane's Hello says the same).
WRONG_TOKEN = (
    "wrong or missing auth token (a client takes it as auth_token= or from the file "
    "TF_DLT_AUTH_TOKEN_FILE names; tf-dlt commands as --auth-token-file)"
)
# A request's bytes at most: the longest a Save or Load may list is 16,000
# tables of the longest names. Health checks take a request without a
# token, and a connection may send each stream's in full: this bounds what
# such a peer makes the shard hold. Replies (Stats, ListTables) may be larger.
_REQUEST_BYTES = 4 << 20
_REPLY_BYTES = 64 << 20
# A control-plane connection with no call for this long is closed (its
# client reconnects at its next call): see AdminServer's connection cap.
IDLE_CLOSE_S = 10.0
# Control-plane calls served at once; more wait for a thread (health checks
# and reflection take none).
WORKER_THREADS = 8
# After a stop's grace (or once no call is left in hand), calls that never
# sent their request are cut within this long.
_CUT_AFTER_S = 1.0
# Health Watch streams open at once. Health takes no token (Kubernetes probes
# send none, and use Check), and a Watch holds its stream's memory for as
# long as it stays open: 5,000 of them held 74 MB.
MAX_HEALTH_WATCHES = 128
_LOOP_TIMEOUT_S = 30.0


class _Abort(Exception):  # noqa: N818 - a control-flow signal, not an error type
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class CallContext:
    """What a ShardAdmin method sees of its call: the parts of
    grpc.ServicerContext the servicer uses, safe to use from its worker
    thread."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._left = threading.Event()
        self._metadata = dict(context.invocation_metadata() or ())

    def metadata(self, key: str) -> str | None:
        """The value the caller's metadata gives `key`, or None."""
        value = self._metadata.get(key)
        return None if value is None else str(value)

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """Ends the call with `code` and `details` (raises, as grpc's does)."""
        raise _Abort(code, details)

    def is_active(self) -> bool:
        """False once the caller gave up (cancelled, or its deadline passed)."""
        remaining = self._context.time_remaining()
        return not self._left.is_set() and (remaining is None or remaining > 0)


class _AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Requires ``authorization: Bearer <token>`` on every control-plane call
    except the health service (Kubernetes probes send no metadata). Compared
    in constant time; the token is never logged. A call refused is answered
    from its metadata alone: its request message is never waited for."""

    def __init__(self, token: str, count_error: Callable[[str], None]) -> None:
        # Compared as digests: equal lengths, so the time says nothing of
        # the token's length either.
        self._expected = hashlib.sha256(f"Bearer {token}".encode()).digest()

        # At most one line per REFUSAL_LOG_SECONDS: a client sending a
        # wrong token in a loop wrote a line per call, and filled the disk
        # of the shard's logs (every refusal is counted in the metrics).
        last, unlogged = float("-inf"), 0  # (monotonic may be under 10 s after a boot)

        async def deny(requests: Any, context: grpc.aio.ServicerContext) -> None:
            nonlocal last, unlogged
            count_error("UNAUTHENTICATED")
            now = time.monotonic()
            if now - last < REFUSAL_LOG_SECONDS:
                unlogged += 1
            else:  # who, never the token presented
                log.warning(
                    "refused a control-plane call from %s: wrong or missing auth token%s",
                    context.peer(),
                    f" ({unlogged} more refused since the last such line)" if unlogged else "",
                )
                last, unlogged = now, 0
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, WRONG_TOKEN)

        # Taken as a stream of requests, so that none has to arrive first.
        self._deny = grpc.stream_unary_rpc_method_handler(deny)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == grpc_util.AUTH_METADATA_KEY and hmac.compare_digest(
                hashlib.sha256(str(value).encode()).digest(), self._expected
            ):
                return await continuation(details)
        return self._deny


class _HealthServicer(health.aio.HealthServicer):  # type: ignore[misc]
    """grpc.health.v1 with at most `max_watches` Watch streams at once (one
    more is refused RESOURCE_EXHAUSTED; Check always answers). Runs on the
    server's event loop only."""

    def __init__(self, max_watches: int) -> None:
        super().__init__()
        self._watches = 0
        self._max_watches = max_watches

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        if self._watches >= self._max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self._max_watches} health Watch streams at once; Check answers",
            )
        self._watches += 1
        try:
            await super().Watch(request, context)
        finally:
            self._watches -= 1


class AdminServer:
    """Serves `servicer` (a ShardAdmin servicer whose methods take a request
    and a CallContext) on `address`: `bind()` takes the port, `start()`
    serves, `stop()` ends both."""

    def __init__(
        self,
        servicer: Any,
        address: str,
        *,
        auth_token: str,
        count_error: Callable[[str], None],
        tls_files: tuple[str, str, str | None] | None,
        max_connections: int,
        handshake_timeout_s: float,
    ) -> None:
        self._servicer = servicer
        # Connections at once; gRPC closes any past it as it comes. Each is
        # a file descriptor the data plane's share leaves out (ShardServer).
        # A connection must finish gRPC's handshake within
        # handshake_timeout_s and is closed once IDLE_CLOSE_S passed without
        # a call (a health call, which takes no token, gets its request
        # within handshake_timeout_s or ends), so a peer without the token
        # holds the cap only by reconnecting all the time (clients
        # reconnect by themselves).
        self._max_connections = max_connections
        self._handshake_timeout_ms = max(1, int(handshake_timeout_s * 1000))
        self._address = address
        self._auth_token = auth_token
        self._count_error = count_error
        self._tls_files = tls_files
        self._pool = futures.ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="dlt-admin")
        # A Watch (no token) keeps its connection busy for as long as it
        # stays open: a quarter of the connections at most, so Watches
        # alone never fill the cap (8 did at a cap of 8, for good).
        self._health = _HealthServicer(min(MAX_HEALTH_WATCHES, max(1, max_connections // 4)))
        self._statuses: dict[str, Any] = {}  # set before the loop runs
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._serving = False
        self._stopping_health = False  # health says NOT_SERVING for good
        self._stop_lock = threading.Lock()
        self._in_hand = 0  # ShardAdmin calls on a worker thread or waiting for one
        self._stopping = False

    # -- the loop's thread ---------------------------------------------------

    def _on_loop(self, coroutine: Awaitable[Any], timeout: float = _LOOP_TIMEOUT_S) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)  # type: ignore[arg-type]

    def bind(self) -> int:
        """Binds; returns the port. Raises OSError naming the address when
        it cannot bind."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="dlt-admin-loop", daemon=True)
        self._thread.start()
        ready.wait()
        try:
            port = int(self._on_loop(self._bind()))
        except BaseException:
            self._end_loop()
            raise
        return port

    async def _bind(self) -> int:
        server = grpc.aio.server(
            interceptors=(
                [_AuthInterceptor(self._auth_token, self._count_error)] if self._auth_token else []
            ),
            options=[
                ("grpc.max_receive_message_length", _REQUEST_BYTES),
                ("grpc.max_send_message_length", _REPLY_BYTES),
                ("grpc.so_reuseport", 0),
                ("grpc.max_allowed_incoming_connections", self._max_connections),
                ("grpc.server_handshake_timeout_ms", self._handshake_timeout_ms),
                ("grpc.max_connection_idle_ms", int(IDLE_CLOSE_S * 1000)),
            ],
        )
        handlers = self._on_threads()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )
        server.add_registered_method_handlers(SERVICE_NAME, handlers)
        self._add_health(server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        try:
            if self._tls_files is not None:
                port = server.add_secure_port(
                    self._address, tls.server_credentials(*self._tls_files)
                )
            else:
                port = server.add_insecure_port(self._address)
        except RuntimeError:  # grpc's "Failed to bind": in use, or not an address here
            port = 0
        if port == 0:
            raise OSError(
                f"cannot bind the admin port {self._address}: in use by another process, or "
                "not an address of this host (--admin-port, --bind)"
            )
        self._server = server
        return int(port)

    def _add_health(self, server: grpc.aio.Server) -> None:
        """grpc.health.v1 on `server`, each call's request awaited at most the
        handshake timeout. Health takes no token, and a Check whose request
        never came was a call in progress: its connection was never idle,
        so a peer kept the connection cap full with one batch of them."""
        wait_s = self._handshake_timeout_ms / 1000

        async def request(context: grpc.aio.ServicerContext) -> Any:
            try:
                got = await asyncio.wait_for(context.read(), wait_s)
            except TimeoutError:
                got = grpc.aio.EOF
            if got is grpc.aio.EOF:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no health request within {wait_s:g} s"
                )
            return got

        async def check(_: Any, context: grpc.aio.ServicerContext) -> Any:
            return await self._health.Check(await request(context), context)

        async def list_all(_: Any, context: grpc.aio.ServicerContext) -> Any:
            return await self._health.List(await request(context), context)

        async def watch(_: Any, context: grpc.aio.ServicerContext) -> None:
            await self._health.Watch(await request(context), context)

        check_request = health_pb2.HealthCheckRequest.FromString
        check_reply = health_pb2.HealthCheckResponse.SerializeToString
        handlers = {
            "Check": grpc.stream_unary_rpc_method_handler(
                check, request_deserializer=check_request, response_serializer=check_reply
            ),
            "List": grpc.stream_unary_rpc_method_handler(
                list_all,
                request_deserializer=health_pb2.HealthListRequest.FromString,
                response_serializer=health_pb2.HealthListResponse.SerializeToString,
            ),
            "Watch": grpc.stream_stream_rpc_method_handler(
                watch, request_deserializer=check_request, response_serializer=check_reply
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(health.SERVICE_NAME, handlers),)
        )
        server.add_registered_method_handlers(health.SERVICE_NAME, handlers)

    def start(self) -> None:
        """Serves on the port bound."""
        self._on_loop(self._start())

    async def _start(self) -> None:
        assert self._server is not None
        with self._lock:
            statuses = dict(self._statuses)
            self._serving = True
        for name, status in statuses.items():
            await self._health.set(name, status)
        await self._server.start()

    def _on_threads(self) -> dict[str, grpc.RpcMethodHandler]:
        """ShardAdmin's methods as coroutines that hand each call, its
        request in hand and decoded, to a worker thread."""
        return {
            m.name: grpc.unary_unary_rpc_method_handler(
                self._method(getattr(self._servicer, m.name), getattr(dlt_pb2, m.input_type.name)),
                response_serializer=getattr(dlt_pb2, m.output_type.name).SerializeToString,
            )
            for m in _SERVICE.methods
        }

    def _method(self, method: Callable[[Any, CallContext], Any], request_type: Any) -> Any:
        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            if self._stopping:
                await context.abort(grpc.StatusCode.UNAVAILABLE, grpc_util.STOPPING)
            try:  # decoded here: gRPC reports a request it cannot decode as UNKNOWN
                request = request_type.FromString(raw)
            except DecodeError as e:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"not a {request_type.DESCRIPTOR.full_name}: {e}"[:500],
                )
            mine = CallContext(context)
            self._in_hand += 1
            try:
                assert self._loop is not None
                return await self._loop.run_in_executor(self._pool, method, request, mine)
            except _Abort as e:
                await context.abort(e.code, e.details)
            except asyncio.CancelledError:
                mine._left.set()  # the caller gave up: a method that waits leaves
                raise
            except BaseException as e:  # noqa: BLE001 - SystemExit from a method ends its call, not the loop
                log.exception("%s failed", method.__name__)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"[:500])
            finally:
                self._in_hand -= 1

        return call

    # -- health --------------------------------------------------------------

    def set_health(self, service: str, status: Any) -> None:
        """Sets `service`'s health status (before or after start)."""
        with self._lock:
            self._statuses[service] = status
            running = self._serving and not self._stopping_health
        if running and threading.current_thread() is not self._thread:
            self._on_loop(self._health.set(service, status))

    # -- stop ----------------------------------------------------------------

    def begin_stop(self) -> None:
        """Health says NOT_SERVING from now on, whatever is set later (a
        stop's first step: probes and load balancers turn away first)."""
        with self._lock:
            self._stopping_health = True
            serving = self._serving and self._loop is not None
        if serving and threading.current_thread() is not self._thread:
            self._on_loop(self._health.enter_graceful_shutdown())

    def stop(self, grace_s: float) -> None:
        """Health says NOT_SERVING and new calls are refused (UNAVAILABLE);
        the calls in hand get `grace_s` to finish, then every call left is
        cancelled. Streams that never sent a request do not hold the stop
        up. Idempotent; a second caller waits for the first."""
        with self._stop_lock:
            if self._loop is None:
                return
            try:
                self.begin_stop()
                self._stopping = True
                if self._server is not None:  # bound, and maybe serving
                    grace = grace_s if self._serving else 0.0
                    self._on_loop(self._stop(grace), timeout=grace + _LOOP_TIMEOUT_S)
            finally:
                self._end_loop()
                self._pool.shutdown(wait=False, cancel_futures=True)

    async def _stop(self, grace_s: float) -> None:
        assert self._loop is not None and self._server is not None
        if not self._serving:  # bound only: grpc releases a port only by a stop once started
            await self._server.start()
        deadline = self._loop.time() + grace_s
        while self._in_hand and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self._server.stop(_CUT_AFTER_S if not self._in_hand and grace_s else 0)

    def _end_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # already closed
            loop.call_soon_threadsafe(loop.stop)
        thread.join(_LOOP_TIMEOUT_S)
        self._loop = None
