"""The replica's gRPC front process: serves the public port so gRPC's Python work runs outside the
process whose engine thread needs the GIL for every torch op.

Why: the tiny model's forward is Python-dispatch bound, so the engine thread wants the GIL nearly
all the time; in one process every gRPC thread wake-up (new call, message received, the result
handed over, status sent: ~7 per unary call) stalls the step it overlaps (replica/server/README.md,
"Performance").

```
 client ══gRPC══► front process (this module)                 replica process
                   GrpcServer: the same edge (rpcs.py) as in  ─ENGINE calls─► engine thread (lanes.py)
                   the replica process, over RemoteCore       ─SERVICE calls─► service threads
                   grpc.health.v1: published from Serving     ◄── replies, Serving(bool)
                   frames; reflection: served here
```
Started by `front_process.py` as `python -m replica.server.frontend --fd N --service-fd M ...`
(not a `pdcluster` command: only the replica starts it). It reports its bound port as its first
frame and exits when the replica closes the hot socket; it ignores SIGINT (the replica handles
Ctrl-C for both). It imports no torch.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from replica.server.frames import BufferedFrameSocket, Hello, ToFront
from replica.server.grpc_server import GrpcServer
from replica.server.messages import Lane
from replica.server.remote import RemoteCore
from replica.server.rpcs import Edge


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m replica.server.frontend")
    parser.add_argument("--fd", type=int, required=True, help="our end of the hot calls' socket pair")
    parser.add_argument("--service-fd", type=int, required=True, help="our end of the service socket pair")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=16)
    return parser.parse_args(argv)


def serve(args: argparse.Namespace) -> int:
    """Bind, report the port, serve until the replica closes the hot socket."""
    hot = BufferedFrameSocket(socket.socket(fileno=args.fd), ToFront)
    service = BufferedFrameSocket(socket.socket(fileno=args.service_fd), ToFront)
    servers: list[GrpcServer] = []
    client = RemoteCore(hot, service, lambda serving: servers[0].set_serving(serving))
    try:
        server = GrpcServer(f"{args.host}:{args.port}", args.workers, Edge(client))
    except OSError:
        logging.getLogger(__name__).exception("cannot listen on %s:%s", args.host, args.port)
        hot.send(Hello(0))
        return 1
    servers.append(server)
    hot.send(Hello(server.port))
    replies = threading.Thread(target=client.read_replies, args=(Lane.SERVICE,), name="service-replies")
    replies.daemon = True
    replies.start()
    client.read_replies(Lane.ENGINE)  # until the replica closes its end
    server.stop()
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
