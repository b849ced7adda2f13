"""Several processes: when one is lost, every other one exits within
`training.peer_timeout_seconds`, with one line naming it, instead of waiting on it.

What JAX's runtime does alone (measured before this module: tiny fsdp run, 2 processes x 4
CPU devices, one SIGKILLed): a collective the dead process was part of fails at once on CPU
(gloo: "Connection reset by peer"; NCCL would block); a process exiting after that waits in
JAX's shutdown barrier for the dead one; the coordination service notices the silence after
its heartbeat timeout (`heartbeat_timeout_seconds`, 100 s by default) and then every other
process LOG(FATAL)s: SIGABRT (exit -6) 51-99 s after the death in the kills measured, with a
fatal-error dump of 74-154 lines on stderr (the README gives each figure's source). JAX has
no public hook on that failure (its client's missed-heartbeat callback is not exposed), so
this module watches the peers itself and leaves before JAX aborts; nnx_zoo/runtime/distributed.py
sets JAX's heartbeat and shutdown timeouts to twice the bound, as the backstop.

The watch: every process keeps a TCP connection to process 0 (a star: process 0 relays what
it sees) and sends a heartbeat on it every `timeout / 10` seconds from a daemon thread (XLA's
compiles, collectives and Orbax's writes release the GIL, so the thread runs while the main
thread is blocked in any of them). A process is lost when
  - its connection closes without a goodbye: killed, crashed, or its host's kernel closed
    it; seen at once; or
  - nothing has come from it for `timeout` seconds: a frozen host, a network partition.
Every other process then prints one line (the lost process, what this one was doing, and
the newest complete checkpoint from `describe`) and leaves with `os._exit(1)`, not through
JAX's exit handlers, whose shutdown barrier would wait for the lost process and abort. A
save cut short stays Orbax's temporary directory, never taken as a checkpoint.

What it cannot stop: native code that sees the same closed socket at the same instant and
writes before aborting. When process 0, the host of JAX's coordination service, is lost,
JAX's client in every survivor fails its poll of the service at once and LOG(FATAL)s (an E
line, then an F line with two lines of gRPC detail, then the abort). The exit here has come
first in every kill measured (exit 1), but those 4 lines may already be out, before the one
line or around it (3 of 8 kills in the README).

Messages, one per line: `hello <id>` (a process joins), `beat`, `done` (its run finished; a
connection closed after it is no loss), `quit` (it stops on an error of its own and says
which: the others wait `QUIT_GRACE_S`, so that a failure every process meets at the same step,
a diverged loss, is reported by each in its own words, then exit naming it), and from
process 0, `peer <id> <why>` (a relay).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable

from nnx_zoo.errors import UsageError, report_internal

# How long the others wait after a `quit` before naming the process that sent it.
QUIT_GRACE_S = 5.0
# Heartbeats per timeout: a live peer that misses a few still stays far inside the bound.
BEATS_PER_TIMEOUT = 10
_ADDRESS_BYTES = 256  # process 0's host:port, as broadcast to the others

_HOW = {
    "closed": "was lost (its connection closed: killed, crashed, or its host went down)",
    "silent": "was lost (silent for {timeout:g} s)",
    "quit": "stopped with an error (its own output says which)",
}

_current: PeerWatch | None = None  # this process's watch, once started


class _Peer:
    """One connection: to process 0 (from the others), or to one of the others (on 0)."""

    def __init__(self, sock: socket.socket, index: int, buffer: bytes = b""):
        self.sock, self.index = sock, index
        self.buffer = buffer  # what came after the `hello` line, on process 0
        self.heard = time.monotonic()
        self.done = False


class PeerWatch:
    """The watch of one process over the others (see the module doc); `start` (or `join`)
    makes one and runs it.

    `phase` says what this process is doing ("during step 7"), `describe()` what is saved
    ("; the last complete checkpoint is step 5; ..."): both end up in the one line.
    """

    def __init__(self, peers: list[_Peer], *, index: int, count: int, timeout_s):
        self.index, self.count, self.timeout_s = index, count, float(timeout_s)
        self.phase = "while starting"
        self.describe: Callable[[], str] = lambda: ""
        self._peers = {peer.index: peer for peer in peers}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._verdict: tuple[int, str] | None = None
        self._report_at: float | None = None
        self._finished = False  # this process's run is complete (`done`)
        self._leaving = False  # this process is exiting on its own error (`leave`)
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)

    # -- the main thread's side ---------------------------------------------------------

    def done(self) -> None:
        """This process's run is complete: the others' closing connections are no loss."""
        self._finished = True
        self._send_all(b"done\n")

    def leave(self) -> None:
        """This process is about to exit on an error it reports itself: no line from here,
        and the others learn it is going (`quit`)."""
        with self._lock:
            self._leaving = True
        self._send_all(b"quit\n")

    def await_verdict(self, seconds: float) -> None:
        """Give a lost peer (which would explain an error the main thread just got) up to
        `seconds` to be noticed; the thread then exits the process, else this returns."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.05)
            if self._report_at is not None:  # a `quit` being waited out: see it through
                end = max(end, self._report_at + 1.0)

    # -- the thread ---------------------------------------------------------------------

    def _send_all(self, message: bytes, *, but: int | None = None) -> None:
        with self._send_lock:
            for peer in list(self._peers.values()):
                if peer.index == but:
                    continue
                # A full buffer (a frozen peer) or a closed connection: the reads tell.
                with contextlib.suppress(OSError):
                    peer.sock.send(message)

    def _run(self) -> None:
        interval = self.timeout_s / BEATS_PER_TIMEOUT
        selector = selectors.DefaultSelector()
        for peer in list(self._peers.values()):
            peer.sock.setblocking(False)
            selector.register(peer.sock, selectors.EVENT_READ, peer)
            self._consume(peer)
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self._send_all(b"beat\n")
                next_beat = now + interval
            wait = next_beat - now
            if self._report_at is not None:
                wait = min(wait, max(0.0, self._report_at - now))
            for key, _ in selector.select(timeout=wait):
                self._read(key.data, selector)
            now = time.monotonic()
            for peer in list(self._peers.values()):
                if not peer.done and now - peer.heard > self.timeout_s:
                    self._lost(peer.index, "silent")
            if self._report_at is not None and time.monotonic() >= self._report_at:
                self._report()

    def _read(self, peer: _Peer, selector) -> None:
        try:
            data = peer.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            selector.unregister(peer.sock)
            peer.sock.close()
            with self._send_lock:
                self._peers.pop(peer.index, None)
            if not peer.done:
                self._lost(peer.index, "closed")
            return
        peer.heard = time.monotonic()
        peer.buffer += data
        self._consume(peer)

    def _consume(self, peer: _Peer) -> None:
        while b"\n" in peer.buffer:
            line, peer.buffer = peer.buffer.split(b"\n", 1)
            words = line.decode(errors="replace").split()
            if words == ["done"]:
                peer.done = True
            elif words == ["quit"]:
                self._lost(peer.index, "quit")
            elif len(words) == 3 and words[0] == "peer" and words[1].isdigit():
                self._lost(int(words[1]), words[2])  # process 0's relay

    def _lost(self, index: int, why: str) -> None:
        with self._lock:
            if self._verdict is not None:
                return  # the first loss is the one reported
            self._verdict = (index, why)
        if self.index == 0:
            self._send_all(f"peer {index} {why}\n".encode(), but=index)
        if self._finished:
            # Every step this process had to take part in is saved; JAX's exit barrier
            # would only wait for the lost process and abort.
            self._write(
                f"warning: process {index} of {self.count} {self._how(why)} after the run "
                "finished; nothing was lost"
            )
            os._exit(0)
        grace = min(QUIT_GRACE_S, self.timeout_s) if why == "quit" else 0.0
        self._report_at = time.monotonic() + grace
        if not grace:
            self._report()

    def _how(self, why: str) -> str:
        return _HOW.get(why, _HOW["closed"]).format(timeout=self.timeout_s)

    def _report(self) -> None:
        index, why = self._verdict
        with self._lock:  # held to the end: `leave` cannot slip a second line in
            if self._leaving:
                self._report_at = None
                return
            try:
                saved = self.describe()
            except Exception:  # noqa: BLE001 -- the line goes out whatever describe() does
                saved = ""
            self._write(
                f"error: process {index} of {self.count} {self._how(why)} {self.phase}{saved}"
            )
            os._exit(1)

    @staticmethod
    def _write(line: str) -> None:
        # os.write, not print: the main thread may hold sys.stderr's lock, and os._exit
        # follows (Python's buffers are not flushed).
        os.write(2, (" ".join(line.split()) + "\n").encode())


# ----------------------------------------------------------------------------- module API


def start(timeout_s: float, coordinator_host: str | None = None) -> PeerWatch | None:
    """Connect this process to the others' watch (a collective: every process calls it
    right after `jax.distributed.initialize`). None with one process or `timeout_s == 0`.

    ValueError (one line) when the connections cannot be made within `timeout_s`.
    """
    import jax

    count, index = jax.process_count(), jax.process_index()
    if count == 1 or not timeout_s:
        return None
    server = listen() if index == 0 else None
    address = ""
    if index == 0:
        # Where the others already reach process 0 (the coordinator), else its host name.
        host = coordinator_host or os.environ.get("JAX_COORDINATOR_ADDRESS", "").rsplit(":", 1)[0]
        address = f"{host.strip('[]') or socket.gethostname()}:{server.getsockname()[1]}"
    return join(index, count, _broadcast(address), timeout_s, server=server)


def listen(port: int = 0) -> socket.socket:
    """Process 0's end: every interface, IPv6 and IPv4 (the others may name it either way)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def join(
    index: int, count: int, address: str, timeout_s: float, *, server: socket.socket | None = None
) -> PeerWatch:
    """This process's watch, connected and running: process 0 accepts the others on
    `server` (`listen`), the others connect to `address` ('host:port')."""
    global _current
    deadline = time.monotonic() + timeout_s
    if index == 0:
        peers = _accept(server, count, deadline, address)
    else:
        peers = [_Peer(_connect(address, index, deadline), 0)]
    _current = PeerWatch(peers, index=index, count=count, timeout_s=timeout_s)
    _current._thread.start()
    return _current


def _broadcast(text: str) -> str:
    import numpy as np
    from jax.experimental import multihost_utils

    raw = text.encode().ljust(_ADDRESS_BYTES, b"\0")[:_ADDRESS_BYTES]
    out = multihost_utils.broadcast_one_to_all(np.frombuffer(raw, np.uint8))
    return bytes(np.asarray(out, np.uint8)).rstrip(b"\0").decode()


_FIX = (
    "the processes must reach process 0 on any TCP port; or set "
    "--config.training.peer_timeout_seconds=0 to rely on JAX's heartbeat alone"
)


def _accept(server: socket.socket, count: int, deadline: float, address: str) -> list[_Peer]:
    peers: dict[int, _Peer] = {}
    while len(peers) < count - 1:
        server.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            conn, _ = server.accept()
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            received = b""
            while b"\n" not in received:
                chunk = conn.recv(64)
                if not chunk:
                    break
                received += chunk
        except OSError:
            missing = sorted(set(range(1, count)) - set(peers))
            raise ValueError(
                f"processes {missing} did not reach the peer watch at {address} in time; {_FIX}"
            ) from None
        # The hello, and what the peer's watch sent right after it (a beat, a quit).
        hello, _, rest = received.partition(b"\n")
        words = hello.decode(errors="replace").split()
        if len(words) == 2 and words[0] == "hello" and words[1].isdigit():
            peers[int(words[1])] = _Peer(conn, int(words[1]), rest)
        else:
            conn.close()  # not one of ours
    server.close()
    return list(peers.values())


def _connect(address: str, index: int, deadline: float) -> socket.socket:
    host, port = address.rsplit(":", 1)
    while True:
        try:
            conn = socket.create_connection(
                (host, int(port)), timeout=max(0.01, deadline - time.monotonic())
            )
            conn.sendall(f"hello {index}\n".encode())
            return conn
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"process {index} could not reach the peer watch of process 0 at "
                    f"{address} ({e.strerror or e}); {_FIX}"
                ) from None
            time.sleep(0.1)


def note(phase: str) -> None:
    """What this process is doing now, for the line a lost peer prints ("during step 7")."""
    if _current is not None:
        _current.phase = phase


def leave() -> None:
    """This process exits on an error it reports itself (see PeerWatch.leave)."""
    if _current is not None:
        _current.leave()


def done() -> None:
    """This process's run is complete (see PeerWatch.done)."""
    if _current is not None:
        _current.done()


def exit_after(error: BaseException) -> None:
    """With a watch running, end this process after `error` without JAX's exit handlers
    (their shutdown barrier would wait for peers that exit the same way, then abort): the
    exit status of a SystemExit, a UsageError's one line and 2, else the traceback and 1.
    An unexpected error first waits a little for the watch: a peer lost a moment ago
    explains it in one line. Returns
    (the caller re-raises) when no watch runs."""
    watch = _current
    if watch is None or watch._finished:
        return
    if not isinstance(error, SystemExit):
        watch.await_verdict(min(QUIT_GRACE_S, watch.timeout_s))
    watch.leave()
    if isinstance(error, SystemExit):
        code = error.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
    elif isinstance(error, UsageError):  # as launch.cli's guard: one line, exit 2
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        code = 2
    else:
        report_internal(error)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
