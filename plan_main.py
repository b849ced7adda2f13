"""Plan a run before paying for it: compile the train step for a TPU / GPU target on this host.

    python plan_main.py --config=configs/llama3_8b.py --topology=v5p:2x2x2 \
        --sharding_strategy=all --batch_size=8 --seq_len=2048 [--json]
    python plan_main.py --model=llama3.2-1b --topology=h100:8 --sharding_strategy=auto

For each candidate (strategy x mesh x remat x micro-batches) it prints per-device memory
(parameters, optimizer state, gradients from the layouts; XLA's argument / temp / peak), whether
it fits the chip, the collectives per step with their bytes and mesh axes, the custom-call
kernels, the compile time and a predicted step time and MFU (planning/estimate.py says how).
`auto` picks the fastest candidate that fits. Bad input, or a model that fits nowhere, exits 2
with one line on stderr.
"""

from __future__ import annotations

import os
import sys

# Before jax is imported: plans never run on this host's accelerator, and the native
# libraries' start-up lines stay off stderr, which carries errors (runtime/host.py).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from runtime.host import import_jax_quietly  # noqa: E402

import_jax_quietly()

from absl import app, flags, logging  # noqa: E402

_CONFIG = flags.DEFINE_string("config", None, "A run config file (configs/*.py).")
_MODEL = flags.DEFINE_string("model", None, "A model preset (zoo.get_config), instead of --config.")
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "Target: v5p:2x2x2, v5p:4x4x4, v6e:4x4, v5e:2x4, h100:8, h100:2x8, cpu:8."
)
_STRATEGY = flags.DEFINE_string(
    "sharding_strategy", "all", "A strategy, a comma list, 'all', or 'auto' (pick the best)."
)
_MESH_SHAPE = flags.DEFINE_string("mesh_shape", None, "e.g. data:4,model:2 (one strategy only).")
_BATCH = flags.DEFINE_integer("batch_size", None, "Global batch (rows); default: the config's.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Tokens per row; default: the config's.")
_REMAT = flags.DEFINE_list(
    "remat",
    None,
    "one or several of none,dots,full,save_qkv_proj,save_out_proj,offload (offload: TPU/GPU "
    "targets); default: the config's, none,dots,full for auto.",
)
_MICRO = flags.DEFINE_list(
    "micro_batches", None, "Micro-batch counts; default: the config's, 1,2,4,8 for auto."
)
_ATTENTION = flags.DEFINE_string("attention_impl", None, "xla | cudnn | splash | auto.")
_DTYPE = flags.DEFINE_string("dtype", None, "Compute dtype; default: the config's.")
_QUANT = flags.DEFINE_string(
    "quantization", None, "Projections in none | fp8 | int8; default: the config's."
)
_MEMORY = flags.DEFINE_float("memory_gib", None, "Pretend the chip has this much memory.")
_MAX_COMPILES = flags.DEFINE_integer("max_compiles", 16, "Most compiles `auto` may spend.")
_JSON = flags.DEFINE_bool("json", False, "One JSON object per candidate on stdout.")


def _usage_error(message) -> None:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _usage_error(e)


def main(argv):
    if len(argv) > 1:
        _usage_error(f"unexpected arguments {argv[1:]}; flags look like --name=value")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # optax notes a constant schedule at INFO
    if not _TOPOLOGY.value:
        _usage_error("--topology is required, e.g. --topology=v5p:2x2x2 or --topology=h100:8")
    if _TOPOLOGY.value.startswith("cpu:") and "jax" not in sys.modules:
        count = _TOPOLOGY.value.split(":", 1)[1]
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
        )
    from planning import cli

    try:
        request = cli.Request(
            config=_CONFIG.value,
            model=_MODEL.value,
            topology=_TOPOLOGY.value,
            strategies=_STRATEGY.value,
            mesh_shape=_MESH_SHAPE.value,
            batch_size=_BATCH.value,
            seq_len=_SEQ_LEN.value,
            remat=_REMAT.value,
            micro_batches=_MICRO.value,
            attention_impl=_ATTENTION.value,
            dtype=_DTYPE.value,
            quantization=_QUANT.value,
            memory_gib=_MEMORY.value,
            max_compiles=_MAX_COMPILES.value,
        )
        output = cli.plan(request, as_json=_JSON.value)
    except ValueError as e:  # bad input, or nothing fits (planning.search.NoFit)
        _usage_error(e)
    print(output, flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
