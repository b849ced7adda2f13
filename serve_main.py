"""Serve a checkpoint over the OpenAI HTTP API, with continuous batching.

    python serve_main.py --workdir=DIR [--step=N] [--port=8000] [--host=127.0.0.1]
        [--max_batch=8] [--max_seq_len=N] [--max_queue=64] [--max_request_bytes=2097152]
        [--served_model_name=NAME]
        [--sharding_strategy=tp] [--mesh_shape=...] [--lora=merge|apply]
        [--chat_template=FILE]
    python serve_main.py --hf_checkpoint=HF_DIR [--port=8000] ...

Endpoints: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template,
rendered sandboxed as in SFT), GET /v1/models, GET /health. Requests take max_tokens,
temperature, top_p, top_k, seed, stop, n, stream (server-sent events ending with
`data: [DONE]`), and ignore_eos. The model loads as eval_main loads it (any strategy and
mesh without a pipeline or context split; a LoRA run's adapters merged, or applied); the
engine keeps --max_batch decode slots over one KV cache of --max_seq_len tokens each, and
compiles its programs before listening (--nowarmup: on first use). --port=0 picks a free
port. The line `serving NAME on http://HOST:PORT ...` on stdout says it is ready. A bad
flag, path, strategy or port ends with exit status 2 and one line on stderr. Needs the
`serve` extra (FastAPI, uvicorn). Library code: nnx_zoo/serving/.
"""

from __future__ import annotations

from nnx_zoo.launch import cli

cli.preamble()

FLAGS = cli.new_flags()

LOAD = cli.define_load_flags(
    FLAGS,
    workdir_help="Run directory to serve.",
    hf_help="Serve a Hugging Face checkpoint directory instead.",
)
SERVE = cli.define_flags(
    FLAGS,
    (
        "lora",
        ("merge", "apply"),
        "merge",
        "A LoRA run's adapters: merged into the weights (faster), or applied beside them.",
    ),
    ("host", str, "127.0.0.1", "Address to listen on."),
    ("port", int, 8000, "Port to listen on; 0: any free one."),
    (
        "served_model_name",
        str,
        None,
        "The model's name in the API; default: the workdir's (or HF directory's) name.",
    ),
    ("max_batch", int, 8, "Decode slots: requests generating at once."),
    (
        "max_seq_len",
        int,
        None,
        "Tokens per slot (prompt + output); default: the model's, at most 2048.",
    ),
    ("max_queue", int, 64, "Sequences (prompts x n) waiting for a slot; past it: 503."),
    (
        "max_request_bytes",
        int,
        2 << 20,  # nnx_zoo.serving.api.DEFAULT_MAX_REQUEST_BYTES (this module loads without it)
        "A request body past this many bytes is refused (413) before it is read.",
    ),
    ("chat_template", str, None, "A Jinja chat template file; default: the tokenizer directory's."),
    ("warmup", bool, True, "Compile every program before listening."),
)


def _request():
    from nnx_zoo.checkpoint.workdir import expand
    from nnx_zoo.evaluation.model import LoadRequest
    from nnx_zoo.serving.load import ServeRequest

    if bool(LOAD.workdir.value) == bool(LOAD.hf_checkpoint.value):
        cli.usage_error("give one of --workdir (a run directory) or --hf_checkpoint (an HF dir)")
    hf = LOAD.hf_dir()
    load = LoadRequest(
        workdir=hf or expand(LOAD.workdir.value),
        hf_checkpoint=hf,
        step=LOAD.step.value,
        overrides=LOAD.overrides(),
    )
    return ServeRequest(
        load=load,
        **SERVE.values(
            "max_batch",
            "max_seq_len",
            "max_queue",
            "lora",
            "chat_template",
            "served_model_name",
            "warmup",
        ),
    )


@cli.quiet_logging()
def main(argv):
    cli.no_arguments(argv)
    try:
        import uvicorn

        from nnx_zoo.serving.api import create_app
    except ModuleNotFoundError as e:
        cli.usage_error(
            f"serve_main needs the serve extra ({e.name} is not installed): "
            "pip install 'nnx-zoo[serve]'"
        )
    from nnx_zoo.runtime import host
    from nnx_zoo.serving import load

    host.announce()  # the first line: the backend and devices JAX chose

    request = _request()
    if SERVE.max_request_bytes.value < 1:
        cli.usage_error(f"--max_request_bytes={SERVE.max_request_bytes.value} must be >= 1")
    sock = _listen(SERVE.host.value, SERVE.port.value)  # a port in use: said before the model loads
    with sock:
        served = load.build(request)
        app = create_app(
            served.engine,
            served_model=served.name,
            chat_template=served.chat_template,
            chat_template_error=served.chat_template_error,
            max_request_bytes=SERVE.max_request_bytes.value,
        )
        host, port = sock.getsockname()[:2]
        served.engine.start()
        print(
            f"serving {served.name} on http://{host}:{port}/v1 ({served.description})", flush=True
        )
        # On SIGINT / SIGTERM: stop taking requests, give those running a few seconds.
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=5
        )
        server = uvicorn.Server(config)
        try:
            server.run(sockets=[sock])
        finally:
            served.engine.stop()


def _listen(host: str, port: int):
    import socket

    if not 0 <= port < 65536:
        cli.usage_error(f"--port={port} must be in [0, 65535] (0: any free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        cli.usage_error(f"--host={host!r} is not an address of this machine ({e.strerror})")
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        cli.usage_error(f"cannot listen on {host}:{port} ({e.strerror or e})")
    sock.listen(2048)
    return sock


def run(argv: list[str] | None = None) -> None:
    """The `zoo-serve` console script: the same as `python serve_main.py ARGS`."""
    cli.run_main(main, FLAGS, doc=__doc__, argv=argv)


if __name__ == "__main__":
    run()
