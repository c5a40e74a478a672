"""The replica's gRPC front process: serves the public port so gRPC's Python work runs outside the
process whose engine thread needs the GIL for every torch op.

Why: the tiny model's forward is Python-dispatch bound, so the engine thread wants the GIL nearly
all the time; in one process every gRPC thread wake-up (new call, message received, the result
handed over, status sent: ~7 per unary call, ~0.4 ms of CPU in the sync server) stalls the step
it overlaps. Measured at batch 1 that was +0.4 ms of engine CPU, +0.65 ms of GIL waits and ~0.6 ms
of idle engine per 1.5 ms decode step (replica/server/README.md, "Performance").

```
 client ══gRPC══► front process (this module)                 replica process (main.py)
                   DecodeV2, PrefillV2 NORMAL, Prefill,  ─frames─► hotpath.py ─► engine thread
                   FilterBatch, ClearCache (converted here)  ◄──── reply from the engine thread
                   every other unary call of the service ─frames─► service_channel.py: reader
                   (request bytes, metadata, deadline)       ◄──── thread ─► pool ─► ReplicaServicer
                   health (Check, Watch): forwarded ══gRPC══► internal server on 127.0.0.1
                   reflection: served here
```
A forwarded call's status is the one the servicer's `interceptor.guard` gives in the replica
(code and details passed on as they are); when its caller cancels or its deadline passes, a
"cancel" frame ends the servicer's context there (`is_active()` False, callbacks run). If the
replica closes a socket, the calls waiting on it fail UNAVAILABLE.

Started by `main.py` as `python -m replica.server.frontend --fd N --service-fd M ...` (not a
`pdcluster` command: only the replica starts it). It reports its bound port as its first frame
and exits when the replica closes the hot socket; it ignores SIGINT (the replica handles Ctrl-C
for both).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from protos import generate_pb2 as pb
from replica.errors import CAUSE_KEY, DeadlineExceeded, ReplicaError, ShuttingDown, Status
from replica.server import convert
from replica.server.interceptor import guard
from replica.server.ordering import CallOrder, call_names
from replica.server.wire import BufferedFrameSocket, FrameSocket, decode_batch

SERVICE = pb.DESCRIPTOR.services_by_name["TextGenerationService"].full_name
_MESSAGE_BYTES = 64 * 1024 * 1024
_NO_DEADLINE = 10.0**7


class RemoteError(ReplicaError):
    """A ReplicaError raised in the replica process (its status and message)."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class ForwardedError(ReplicaError):
    """A forwarded call failed in the replica with this gRPC code and cause (passed on as they are)."""

    def __init__(self, code: grpc.StatusCode, details: str, cause: str | None = None) -> None:
        super().__init__(details)
        self.grpc_code = code
        self.cause = cause


class _Slot:
    """One call waiting for its reply.

    `done` is a raw lock, held from the start and released exactly once (under the Backend's lock:
    by the reply, the caller giving up, or the socket closing); the caller waits by acquiring it.
    A C-level acquire / release costs a fraction of a `threading.Event` (a Python Condition).
    """

    __slots__ = ("done", "gone", "op", "reply")

    def __init__(self, op: str) -> None:
        self.op = op
        self.done = threading.Lock()
        self.done.acquire()
        self.reply: tuple[bool, Any] | None = None
        self.gone = False  # the caller gave up: a late reply is for nobody

    def wait(self, timeout: float | None) -> bool:
        """Until the slot is done (True) or `timeout` s passed (False)."""
        return self.done.acquire(True, -1 if timeout is None else timeout)


class Backend:
    """The front's end of one socket pair: send calls, match replies, free orphaned prefills.

    One serves the hot calls (`send` / `wait`), another the service channel (`rpc`). The replica
    answers every call exactly once, so a slot lives until its reply arrives (or the socket closes).
    """

    def __init__(self, wire: FrameSocket) -> None:
        self.wire = wire
        self._ids = itertools.count(1)
        self._slots: dict[int, _Slot] = {}
        self._lock = threading.Lock()
        self._closed = False  # the replica closed its end: every waiting call failed UNAVAILABLE

    def send(self, op: str, args: Any, timeout: float | None) -> tuple[int, _Slot]:
        """Send one call (not started by the replica after `timeout` s); its id and slot for `wait`."""
        call_id, slot = next(self._ids), _Slot(op)
        with self._lock:
            if self._closed:
                raise ShuttingDown("the replica closed the connection")
            self._slots[call_id] = slot
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.wire.send((op, call_id, args, deadline))
        except OSError:
            with self._lock:
                self._slots.pop(call_id, None)
            raise ShuttingDown("the replica closed the connection") from None
        return call_id, slot

    def wait(
        self, sent: tuple[int, _Slot], context: grpc.ServicerContext, timeout: float | None
    ) -> Any:
        """The call's result within `timeout` (DeadlineExceeded after)."""
        slot = sent[1]
        if slot.op == "prefill":  # a caller who cancels leaves a batch behind: see read_replies
            context.add_callback(lambda: self._give_up(slot))  # runs when the RPC ends, however
        ok, payload = self._reply(slot, timeout, "the engine did not finish")
        if not ok:
            raise RemoteError(Status(payload[0]), payload[1])
        return payload

    def rpc(self, method: str, data: bytes, context: grpc.ServicerContext, timeout: float | None) -> bytes:
        """A forwarded unary call over the service channel: the response bytes, or the replica's status.

        When the caller cancels or `timeout` passes, the replica is told ("cancel": the servicer's
        context ends); its reply still comes and is dropped.
        """
        call_id, slot = self.send("rpc", (method, data, _metadata(context)), timeout)
        if not context.add_callback(lambda: self._give_up(slot, call_id)):  # runs when the RPC ends
            self._give_up(slot, call_id)  # it ended already (the caller cancelled)
        ok, payload = self._reply(slot, timeout, "the replica did not answer", call_id)
        if not ok:
            raise ForwardedError(grpc.StatusCode[payload[0]], payload[1], _at(payload, 2))
        return bytes(payload)

    def _reply(
        self, slot: _Slot, timeout: float | None, late: str, cancel: int | None = None
    ) -> tuple[bool, Any]:
        """The slot's (ok, payload) within `timeout`; after it the call is given up (`cancel`: see
        `_give_up`) and DeadlineExceeded says `late`."""
        if not slot.wait(timeout):
            self._give_up(slot, cancel)
        if slot.reply is None:
            raise DeadlineExceeded(f"{late} within the call's deadline ({timeout} s)")
        return slot.reply

    def _give_up(self, slot: _Slot, cancel: int | None = None) -> None:
        """The caller left: a late reply is for nobody; with `cancel`, the replica is told so."""
        with self._lock:
            if slot.reply is not None or slot.gone:
                return  # answered already: the result stands
            slot.gone = True
            slot.done.release()
        if cancel is not None:
            with contextlib.suppress(OSError):  # the replica is gone: nothing runs there any more
                self.wire.send(("cancel", cancel, None, None))

    def read_replies(self) -> None:
        """Deliver replies until the replica closes the socket; then fail the calls still waiting."""
        while (message := self.wire.recv()) is not None:
            call_id, ok, payload = message
            with self._lock:
                slot = self._slots.pop(call_id, None)
                if slot is None:
                    continue  # a call sent by this class itself (an orphan's clear)
                gone = slot.gone
                if not gone:
                    slot.reply = (ok, payload)
                    slot.done.release()
            if gone and ok and slot.op == "prefill" and payload[1] is not None:
                # finished after its caller gave up: nobody will decode the batch; free it
                self.wire.send(("clear", next(self._ids), payload[1][0], None))
        with self._lock:
            self._closed = True
            waiting, self._slots = list(self._slots.values()), {}
            for slot in waiting:
                if slot.reply is None and not slot.gone:
                    slot.reply = (False, (Status.UNAVAILABLE.value, "the replica closed the connection"))
                    slot.done.release()


_Prefilled = TypeVar("_Prefilled", pb.PrefillResponse, pb.PrefillV2Response)


def _at(payload: Sequence[Any], index: int) -> Any:
    """`payload[index]`, or None if it is shorter (error replies made in the channel have no cause)."""
    return payload[index] if len(payload) > index else None


def _deadline(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE else max(remaining, 0.0)


class FrontServicer:
    """The hot calls, converted here and run by the replica's engine thread."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.order = CallOrder()  # pipelined DecodeV2 calls reach the engine in the caller's order

    def _call(self, context: grpc.ServicerContext, op: str, args: Any) -> Any:
        deadline = _deadline(context)
        return self.backend.wait(self.backend.send(op, args, deadline), context, deadline)

    def _prefill(self, batch: pb.Batch, context: grpc.ServicerContext, response: _Prefilled) -> _Prefilled:
        # the step as wire.encode_step's tuples: (generations, batch, forward_ns, decode_ns, total_ns, _)
        step = self._call(context, "prefill", convert.batch_from_pb(batch))
        response.forward_ns, response.decode_ns, response.total_ns = step[2], step[3], step[4]
        convert.fill_encoded_step(response, step)
        return response

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        return self._prefill(request.batch, context, pb.PrefillResponse())

    def PrefillV2(self, request: pb.PrefillV2Request, context: grpc.ServicerContext) -> pb.PrefillV2Response:
        return self._prefill(request.batch, context, pb.PrefillV2Response())

    def DecodeV2(self, request: pb.DecodeV2Request, context: grpc.ServicerContext) -> pb.DecodeV2Response:
        deadline = _deadline(context)
        # A pipelined call (the router keeps several on the wire) is sent after the one it follows;
        # the socket and the replica's reader keep that order up to the engine thread.
        call, after = call_names(context.invocation_metadata())
        if after is not None:
            self.order.follow(after, deadline)
        try:
            inputs = convert.decode_pairs_from_pb(request.batches, request.last_iter_tokens)
            sent = self.backend.send("decode", inputs, deadline)
        finally:
            if call is not None:
                self.order.submitted(call)
        step = self.backend.wait(sent, context, deadline)
        response = pb.DecodeV2Response(total_ns=step[4])
        convert.fill_encoded_step(response, step)
        return response

    def FilterBatch(
        self, request: pb.FilterBatchRequest, context: grpc.ServicerContext
    ) -> pb.FilterBatchResponse:
        info = decode_batch(self._call(context, "filter", (request.batch_id, tuple(request.request_ids))))
        assert info is not None
        return pb.FilterBatchResponse(batch=convert.cached_batch_to_pb(info))

    def ClearCache(
        self, request: pb.ClearCacheRequest, context: grpc.ServicerContext
    ) -> pb.ClearCacheResponse:
        self._call(context, "clear", request.id if request.HasField("id") else None)
        return pb.ClearCacheResponse()


_SERVICE_PREFIX = f"/{SERVICE}/"
_FORWARDED_PREFIXES = (_SERVICE_PREFIX, f"/{health.SERVICE_NAME}/")
_STREAMING = {f"/{health.SERVICE_NAME}/Watch"}
_HOP_BY_HOP = ("grpc-", ":")
_NOT_FORWARDED = {"user-agent", "content-type", "te", "host", "accept-encoding"}


def _metadata(context: grpc.ServicerContext) -> list[tuple[str, Any]]:
    return [
        (key, value)
        for key, value in context.invocation_metadata() or ()
        if key not in _NOT_FORWARDED and not key.startswith(_HOP_BY_HOP)
    ]


class Router(grpc.GenericRpcHandler):
    """Hot calls to `FrontServicer`; the service's other unary calls to the replica over the service
    channel (`services`); health (Check, Watch) to the replica's internal gRPC server (`channel`)."""

    def __init__(self, front: FrontServicer, services: Backend, channel: grpc.Channel) -> None:
        self.services = services
        self.channel = channel
        hot: dict[str, tuple[Callable[..., Any], Any, Any]] = {
            "Prefill": (front.Prefill, pb.PrefillRequest, pb.PrefillResponse),
            "DecodeV2": (front.DecodeV2, pb.DecodeV2Request, pb.DecodeV2Response),
            "FilterBatch": (front.FilterBatch, pb.FilterBatchRequest, pb.FilterBatchResponse),
            "ClearCache": (front.ClearCache, pb.ClearCacheRequest, pb.ClearCacheResponse),
        }
        self.hot = {
            f"/{SERVICE}/{name}": grpc.unary_unary_rpc_method_handler(
                guard(fn), request_deserializer=req.FromString, response_serializer=resp.SerializeToString
            )
            for name, (fn, req, resp) in hot.items()
        }
        self.hot[f"/{SERVICE}/PrefillV2"] = grpc.unary_unary_rpc_method_handler(
            guard(self._prefill_v2(front))
        )

    def _prefill_v2(self, front: FrontServicer) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        forward = self._forward_unary(f"/{SERVICE}/PrefillV2")

        def handler(data: bytes, context: grpc.ServicerContext) -> bytes:
            request = pb.PrefillV2Request.FromString(data)
            if request.forward_case != pb.NORMAL:  # weights / migration cases: the full servicer
                return forward(data, context)
            return front.PrefillV2(request, context).SerializeToString()

        return handler

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method in self.hot:
            return self.hot[method]
        if not method.startswith(_FORWARDED_PREFIXES):
            return None
        if method in _STREAMING:
            return grpc.unary_stream_rpc_method_handler(self._forward_stream(method))
        if method.startswith(_SERVICE_PREFIX):
            return grpc.unary_unary_rpc_method_handler(guard(self._forward_unary(method)))
        return grpc.unary_unary_rpc_method_handler(guard(self._forward_grpc(method)))

    def _forward_unary(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        """A TextGenerationService call, over the service channel (frames, no second gRPC hop)."""

        def handler(data: bytes, context: grpc.ServicerContext) -> bytes:
            return self.services.rpc(method, data, context, _deadline(context))

        return handler

    def _forward_grpc(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        """A health call, over gRPC to the replica's internal server."""
        call = self.channel.unary_unary(method)

        def handler(data: bytes, context: grpc.ServicerContext) -> bytes:
            future = call.future(data, timeout=_deadline(context), metadata=_metadata(context))
            context.add_callback(future.cancel)
            try:
                return future.result()
            except grpc.RpcError as exc:
                cause = dict(exc.trailing_metadata() or ()).get(CAUSE_KEY)
                raise ForwardedError(exc.code(), exc.details() or "", cause) from None

        return handler

    def _forward_stream(self, method: str) -> Callable[[bytes, grpc.ServicerContext], Iterator[bytes]]:
        call = self.channel.unary_stream(method)

        def handler(data: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            responses = call(data, timeout=_deadline(context), metadata=_metadata(context))
            context.add_callback(responses.cancel)
            try:
                yield from responses
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    context.abort(exc.code(), exc.details() or "")

        return handler


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m replica.server.frontend")
    parser.add_argument("--fd", type=int, required=True, help="our end of the hot calls' socket pair")
    parser.add_argument(
        "--service-fd", type=int, required=True, help="our end of the service channel's socket pair"
    )
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True, help="the replica's internal gRPC address")
    parser.add_argument("--workers", type=int, default=16)
    return parser.parse_args(argv)


def serve(args: argparse.Namespace) -> int:
    """Bind, report the port, serve until the replica closes the socket."""
    wire = BufferedFrameSocket(socket.socket(fileno=args.fd))
    backend = Backend(wire)
    services = Backend(BufferedFrameSocket(socket.socket(fileno=args.service_fd)))
    threading.Thread(target=services.read_replies, name="service-replies", daemon=True).start()
    options = [
        ("grpc.max_send_message_length", _MESSAGE_BYTES),
        ("grpc.max_receive_message_length", _MESSAGE_BYTES),
    ]
    channel = grpc.insecure_channel(args.backend, options=options)
    pool = ThreadPoolExecutor(max_workers=args.workers, thread_name_prefix="grpc")
    server = grpc.server(pool, options=options)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    server.add_generic_rpc_handlers((Router(FrontServicer(backend), services, channel),))
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    wire.send(("port", port))
    if port == 0:
        return 1
    server.start()
    backend.read_replies()  # until the replica closes its end
    server.stop(grace=5.0).wait(10.0)
    channel.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the front process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the replica, which stops us
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    return serve(_parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
