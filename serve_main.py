"""Serve a checkpoint over the OpenAI HTTP API, with continuous batching.

    python serve_main.py --workdir=DIR [--step=N] [--port=8000] [--host=127.0.0.1]
        [--max_batch=8] [--max_seq_len=N] [--max_queue=64] [--served_model_name=NAME]
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

from absl import flags  # noqa: E402

FLAGS = cli.new_flags()

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory to serve.", flag_values=FLAGS)
_HF_CHECKPOINT = flags.DEFINE_string(
    "hf_checkpoint", None, "Serve a Hugging Face checkpoint directory instead.", flag_values=FLAGS
)
_STEP = flags.DEFINE_integer(
    "step", None, "Checkpoint step; default: the latest complete one.", flag_values=FLAGS
)
_STRATEGY = cli.strategy_flag(FLAGS, "; default: the run's.")
_MESH_SHAPE = cli.mesh_shape_flag(FLAGS, "the strategy's rule")
_ATTENTION = cli.attention_flag(FLAGS, "the run's")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer",
    None,
    "'byte', tokenizer.json or .model; default: the run's (or the HF dir's).",
    flag_values=FLAGS,
)
_LORA = flags.DEFINE_enum(
    "lora",
    "merge",
    ["merge", "apply"],
    "A LoRA run's adapters: merged into the weights (faster), or applied beside them.",
    flag_values=FLAGS,
)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.", flag_values=FLAGS)
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on; 0: any free one.", flag_values=FLAGS)
_NAME = flags.DEFINE_string(
    "served_model_name",
    None,
    "The model's name in the API; default: the workdir's (or HF directory's) name.",
    flag_values=FLAGS,
)
_MAX_BATCH = flags.DEFINE_integer(
    "max_batch", 8, "Decode slots: requests generating at once.", flag_values=FLAGS
)
_MAX_SEQ_LEN = flags.DEFINE_integer(
    "max_seq_len",
    None,
    "Tokens per slot (prompt + output); default: the model's, at most 2048.",
    flag_values=FLAGS,
)
_MAX_QUEUE = flags.DEFINE_integer(
    "max_queue", 64, "Requests waiting for a slot; past it: 503.", flag_values=FLAGS
)
_CHAT_TEMPLATE = flags.DEFINE_string(
    "chat_template",
    None,
    "A Jinja chat template file; default: the tokenizer directory's.",
    flag_values=FLAGS,
)
_WARMUP = flags.DEFINE_bool(
    "warmup", True, "Compile every program before listening.", flag_values=FLAGS
)


def _request():
    from nnx_zoo.checkpoint.workdir import expand
    from nnx_zoo.evaluation.run import EvalRequest
    from nnx_zoo.serving.load import ServeRequest

    if bool(_WORKDIR.value) == bool(_HF_CHECKPOINT.value):
        cli.usage_error("give one of --workdir (a run directory) or --hf_checkpoint (an HF dir)")
    hf = expand(_HF_CHECKPOINT.value) if _HF_CHECKPOINT.value else None
    load = EvalRequest(
        workdir=hf or expand(_WORKDIR.value),
        hf_checkpoint=hf,
        step=_STEP.value,
        evaluate=False,
        overrides=dict(
            mesh_shape=_MESH_SHAPE.value,
            attention_impl=_ATTENTION.value,
            strategy=_STRATEGY.value,
            tokenizer=_TOKENIZER.value,
        ),
    )
    return ServeRequest(
        load=load,
        max_batch=_MAX_BATCH.value,
        max_seq_len=_MAX_SEQ_LEN.value,
        max_queue=_MAX_QUEUE.value,
        lora=_LORA.value,
        chat_template=_CHAT_TEMPLATE.value,
        served_model_name=_NAME.value,
        warmup=_WARMUP.value,
    )


def main(argv):
    cli.no_arguments(argv)
    cli.quiet_logging()
    try:
        import uvicorn

        from nnx_zoo.serving.api import create_app
    except ModuleNotFoundError as e:
        cli.usage_error(
            f"serve_main needs the serve extra ({e.name} is not installed): "
            "pip install 'nnx-zoo[serve]'"
        )
    from nnx_zoo.serving import load

    request = _request()
    sock = _listen(_HOST.value, _PORT.value)  # a port in use: said before the model loads
    with sock:
        try:
            served = load.build(request)
        except (ValueError, FileNotFoundError, NotADirectoryError) as e:
            cli.usage_error(cli.device_hint(e))
        app = create_app(
            served.engine,
            served_model=served.name,
            chat_template=served.chat_template,
            chat_template_error=served.chat_template_error,
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
