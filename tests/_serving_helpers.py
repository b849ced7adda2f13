"""Shared by the serving tests: a tiny model moved away from its init, so its greedy tokens
are varied and their logits have clear winners (as a trained model's), built in two compiles
(create, perturb) rather than one per parameter."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import jax
from flax import nnx

from zoo import create_model


def perturbed_model(cfg, strategy, mesh, scale: float = 0.1):
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        perturb(model, nnx.Param, scale)
    return model


def perturb(model, kind, scale: float, seed: int = 1) -> None:
    """Add scale * N(0, 1) noise to every variable of `kind`, in one compiled call (under the
    model's mesh)."""

    @nnx.jit
    def move(model):
        leaves, tree = jax.tree.flatten(nnx.state(model, kind))
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        moved = [
            p + scale * jax.random.normal(k, p.shape, out_sharding=jax.typeof(p).sharding)
            for p, k in zip(leaves, keys, strict=True)
        ]
        nnx.update(model, jax.tree.unflatten(tree, moved))

    move(model)


class FailOnce:
    """A compiled serving program that fails once, at its `at`-th call (counted over every
    program sharing this object), as a device error does: after the call took its donated
    KV cache (the program runs; its outputs are dropped)."""

    def __init__(self, at: int = 1):
        self.at, self.calls, self.failed = at, 0, False

    def wrap(self, program):
        def call(*args):
            out = program(*args)
            self.calls += 1
            if self.calls == self.at:
                self.failed = True
                raise RuntimeError("injected: the device call failed")
            return out

        return call


@contextlib.contextmanager
def dying_engine(slots, tokenizer, max_queue: int):
    """A started engine over `slots` whose scheduler raises (a bug escaping its loop) once a
    request is in: yields (engine, reached, go); the thread fails after `go` is set."""
    from nnx_zoo.serving.engine import Engine

    engine = Engine(slots, tokenizer, max_queue=max_queue)
    reached, go = threading.Event(), threading.Event()

    def admit():
        reached.set()
        go.wait(30)
        raise KeyError("injected: a scheduler bug")

    engine.scheduler.admit = admit
    engine.start()
    try:
        yield engine, reached, go
    finally:
        go.set()
        engine.stop()


@contextlib.contextmanager
def http_server(app):
    """uvicorn serving `app` on a thread, on a free port of 127.0.0.1: yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def post_json(port, body, *, timeout=60.0, path="/v1/completions"):
    """(status, JSON body) of a POST."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request("POST", path, payload, {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()
