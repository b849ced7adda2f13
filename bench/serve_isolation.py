"""How much one client's request disturbs the others' streams (issue 48 item 5): the gaps
between tokens of --streams concurrent greedy streams, with nothing else running, then while
one more request does each of:

  stops-max   streams with the most stop strings the server allows (16 x 256 characters,
              none of them in the text: every token is searched)
  stops-5000  asks for 5,000 stop strings of 200 characters (refused at once since this
              change; before it, served: matched against the whole text every token)
  body-200MB  sends a 200 MB prompt with its Content-Length (413 before it is read, since
              this change)
  chunked     sends a 200 MB prompt with no Content-Length, in 64 KiB chunks
  prompt-2MB  sends a prompt just under the 2 MiB body limit (parsed and tokenized, then
              refused: longer than the context)

Each of the --streams clients streams one request after another, from before the disturbing
request is sent until after its answer. For each phase: the gaps between the clients' tokens
that arrived from when it was sent until 0.5 s after its answer (at least 1 s), as
p50, p99 and max (a request's first token, which waits for its prefill, is not counted); the
disturbing request's answer and how long it took; the server's peak resident memory
(sampled every 10 ms).

    python -m bench.serve_isolation [--config=tiny] [--streams=4] [--max_tokens=200]
    python -m bench.serve_isolation --url=http://HOST:PORT/v1 --model=NAME --pid=PID

Without --url it starts serve_main.py (its own process) on a random checkpoint of --config;
--url benches a running server (another checkout's, for the figures before a change), --pid
its process for the memory column. Each phase runs --repeats times, and every repeat is
printed: on a loaded host the spread shows.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import threading
import time
import urllib.parse

import numpy as np

from bench.serve_throughput import _random_checkpoint, _start_server

PHASES = ("baseline", "stops-max", "stops-5000", "body-200MB", "chunked", "prompt-2MB")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--url", help="bench a running server (its /v1 URL) instead")
    parser.add_argument("--model", help="the served model's name (with --url)")
    parser.add_argument("--pid", type=int, help="the server's process id (with --url)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--phases", default=",".join(PHASES))
    args = parser.parse_args()
    server = None
    if args.url:
        url, model, pid = args.url, args.model, args.pid
    else:
        workdir = _random_checkpoint(args.config)
        server, url, model = _start_server(workdir, 8, 256, 1)
        pid = server.pid
    host, port = urllib.parse.urlsplit(url).netloc.split(":")
    bench = Bench(host, int(port), model, pid, args)
    try:
        bench.stream(8)  # every program warm
        print(
            f"{args.streams} streams of {args.max_tokens} greedy tokens, model {model}; load "
            f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        header = ("phase", "gap p50", "gap p99", "gap max", "its answer", "in", "peak RSS")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for phase in args.phases.split(","):
            for _ in range(args.repeats):
                print(bench.phase(phase), flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)


class Bench:
    def __init__(self, host, port, model, pid, args):
        self.host, self.port, self.model, self.pid, self.args = host, port, model, pid, args

    def _body(self, **fields) -> bytes:
        ask = {"model": self.model, "prompt": "def main(", "temperature": 0, **fields}
        return json.dumps(ask).encode()

    def stream(self, max_tokens, **fields) -> list[float]:
        """The arrival times of a streamed completion's token chunks."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=600)
        body = self._body(max_tokens=max_tokens, stream=True, ignore_eos=True, **fields)
        headers = {"content-type": "application/json"}
        connection.request("POST", "/v1/completions", body, headers)
        response = connection.getresponse()
        times = []
        for line in response:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
        connection.close()
        return times

    def phase(self, name: str) -> str:
        # The disturbing request is built before the streams start: building 200 MB of JSON
        # would hold this process's interpreter, and its stream readers with it.
        action = None if name == "baseline" else getattr(self, "_" + name.replace("-", "_"))()
        done, gaps = threading.Event(), []

        def client():  # streams one request after another until the phase is over
            while not done.is_set():
                times = self.stream(self.args.max_tokens)[1:]  # after the first token
                gaps.extend(zip(times[1:], np.diff(times), strict=True))

        streams = [threading.Thread(target=client) for _ in range(self.args.streams)]
        for thread in streams:
            thread.start()
        memory = _Memory(self.pid)
        time.sleep(0.5)  # the streams are running
        answer, took = "-", 0.0
        start = time.perf_counter()
        if action is not None:
            answer = action()
            took = time.perf_counter() - start
        # A stall's gap ends with the token after it, which may come after the answer.
        end = max(time.perf_counter() + 0.5, start + 1.0)
        time.sleep(max(0.3, end - time.perf_counter()))
        done.set()
        for thread in streams:
            thread.join()
        peak = memory.stop()
        gaps = np.asarray([gap for at, gap in gaps if start <= at <= end])
        p50, p99, most = np.percentile(gaps, 50), np.percentile(gaps, 99), gaps.max()
        return (
            f"| {name} | {p50 * 1e3:.1f} ms | {p99 * 1e3:.1f} ms | {most * 1e3:.1f} ms | "
            f"{answer} | {took:.2f} s | {peak / 2**30:.2f} GiB |"
        )

    def _post(self, body: bytes) -> str:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            headers = {"content-type": "application/json"}
            connection.request("POST", "/v1/completions", body, headers)
            return str(connection.getresponse().status)
        except OSError as e:  # the server closed the connection while the body went out
            return type(e).__name__
        finally:
            connection.close()

    def _stops_max(self):
        stops = [chr(0x4E00 + i) * 256 for i in range(16)]
        return lambda: f"{len(self.stream(self.args.max_tokens, stop=stops)) and 200}"

    def _stops_5000(self):
        stops = [f"{i:05d}" + "z" * 195 for i in range(5000)]
        body = self._body(max_tokens=self.args.max_tokens, ignore_eos=True, stop=stops)
        return lambda: self._post(body)

    def _body_200MB(self):
        body = self._body(prompt="x" * 200_000_000, max_tokens=1)
        return lambda: self._post(body)

    def _chunked(self):
        body = self._body(prompt="x" * 200_000_000, max_tokens=1)
        pieces = [body[at : at + (64 << 10)] for at in range(0, len(body), 64 << 10)]
        chunks = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]
        return lambda: self._send_chunked(chunks)

    def _send_chunked(self, chunks) -> str:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        sent, note = 0, ""
        with socket.create_connection((self.host, self.port), timeout=600) as sock:
            try:
                sock.sendall(head)
                for chunk in chunks:
                    sock.sendall(chunk)
                    sent += len(chunk)
            except OSError as e:
                note = f"{type(e).__name__} after {sent >> 20} MiB; "
            try:
                response = http.client.HTTPResponse(sock)
                response.begin()
                return note + str(response.status)
            except OSError as e:
                return note + type(e).__name__

    def _prompt_2MB(self):
        body = self._body(prompt="x" * ((2 << 20) - 1024), max_tokens=1)
        return lambda: self._post(body)


class _Memory:
    """The peak resident memory of a process, sampled every 10 ms."""

    def __init__(self, pid):
        self.peak, self.done = 0, threading.Event()
        self.thread = None
        if pid:
            import psutil

            process = psutil.Process(pid)

            def sample():
                while not self.done.is_set():
                    self.peak = max(self.peak, process.memory_info().rss)
                    time.sleep(0.01)

            self.thread = threading.Thread(target=sample, daemon=True)
            self.thread.start()

    def stop(self) -> int:
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        return self.peak


if __name__ == "__main__":
    main()
