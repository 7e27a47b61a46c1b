"""Whether the server can take its address, asked before the model loads: socket calls only, so
that `serve` can check it before the rest of the server imports (ember_cupy/cli/serve.py)."""
from __future__ import annotations

import socket


class ListenError(ValueError):
    """The server cannot take its address (in use, not this host's, not permitted)."""


def listen_error(host: str, port: int, exc: OSError) -> ListenError:
    return ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}")


def check_can_listen(host: str, port: int) -> None:
    """Bind (host, port) as the server will (SO_REUSEADDR) and let go: a busy port fails here,
    before the model loads. The server's own bind can still lose a race; serve() reports that too."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise listen_error(host, port, exc) from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise listen_error(host, port, exc) from None
