"""Plan a run before paying for it: compile its train step for a TPU / GPU target on this host.

    python plan_main.py --config=configs/llama3_8b.py --config.data.global_batch_size=64 \
        --config.model.remat=dots --topology=v5p:2x2x2 [--json]      # train_main's flags
    python plan_main.py --model=llama3.2-1b --topology=h100:8 --sharding_strategy=auto

It takes train_main's command line (config file, `--config.*` overrides, --sharding_strategy,
--mesh_shape, --attention_impl) plus `--topology`, and compiles exactly the step train_main
would run (launch.build). `--model` plans a preset with planning defaults instead; the short
flags (--batch_size, --seq_len, --dtype, --remat) are aliases that may not disagree with the
`--config.*` field they stand for. For each candidate (strategy x mesh x remat x
micro-batches) it prints per-device memory (parameters, optimizer state, gradients from the
layouts; XLA's argument / temp / peak), whether it fits the chip, the collectives per step
with their bytes and mesh axes, the custom-call kernels, the compile time and a predicted
step time and MFU (nnx_zoo/planning/estimate.py says how). `auto` picks the fastest candidate that
fits. Bad input, or a model that fits nowhere, exits 2 with one line on stderr.
"""

from __future__ import annotations

from nnx_zoo.launch import cli

# `--topology=cpu:N` needs N host devices, which XLA creates when jax starts.
cli.simulate_cpu_devices(
    "topology", lambda t: t.partition(":")[2] if t.startswith("cpu:") else None
)
# Plans never run on this host's accelerator; the CPU flags are train_main's, so a `cpu:N`
# plan compiles the very program train_main runs.
cli.preamble(huge_pages=False, cpu_only=True)

FLAGS = cli.new_flags()

from nnx_zoo.planning.targets import EXAMPLES  # noqa: E402
from zoo.layers.remat import POLICIES  # noqa: E402

RUN = cli.define_run_flags(FLAGS, " | a comma list | all | auto (pick the best)", planning=True)
PLAN = cli.define_flags(
    FLAGS,
    ("model", str, None, "A model preset (zoo.get_config), instead of --config."),
    ("topology", str, None, f"Target: {', '.join(EXAMPLES)}, or cpu:N (this host's CPU devices)."),
    ("batch_size", int, None, "Alias of --config.data.global_batch_size."),
    ("seq_len", int, None, "Alias of --config.data.seq_len."),
    (
        "remat",
        list,
        None,
        f"one or several of {','.join(POLICIES)} (offload: TPU/GPU targets); default: "
        "config.model.remat, none,dots,full for auto.",
    ),
    ("micro_batches", list, None, "Micro-batch counts; default: the config's, 1,2,4,8 for auto."),
    ("dtype", str, None, "Alias of --config.model.dtype."),
    ("memory_gib", float, None, "Pretend the chip has this much memory."),
    ("max_compiles", int, 16, "Most compiles `auto` may spend."),
    (
        "moe_load_from",
        str,
        None,
        "MoE: the workdir of a train_main run of the same model (a short CPU run will do); the "
        "plan adds the router's measured load spread over experts and expert shards.",
    ),
    ("json", bool, False, "One JSON object per candidate on stdout."),
)


@cli.quiet_logging()
def main(argv):
    cli.no_arguments(argv)
    if not PLAN.topology.value:
        cli.usage_error("--topology is required, e.g. --topology=v5p:2x2x2 or --topology=h100:8")
    from nnx_zoo.checkpoint.workdir import expand
    from nnx_zoo.planning import cli as planner

    config = None
    if not PLAN.model.value or cli.config_file_given():
        try:  # config_flags defers a failed load of the file to the first use of the config
            config = RUN.config.value.to_dict()
        except Exception as e:  # noqa: BLE001 -- any error in the file: one line, exit 2
            cli.usage_error(cli.config_file_message(e))
    try:
        request = planner.Request(
            config=config,
            explicit=cli.explicit_config_overrides(RUN.config),
            strategies=RUN.sharding_strategy.value,
            mesh_shape=RUN.mesh_shape.value,
            attention_impl=RUN.attention_impl.value,
            init_from=expand(RUN.init_from.value) if RUN.init_from.value else None,
            **PLAN.values(
                "topology",
                "model",
                "batch_size",
                "seq_len",
                "remat",
                "micro_batches",
                "dtype",
                "memory_gib",
                "max_compiles",
                "moe_load_from",
            ),
        )
        output = planner.plan(request, as_json=PLAN.json.value)
    except OSError as e:  # a file the request names (--init_from's config) cannot be read
        cli.usage_error(e)
    print(output, flush=True)


def run(argv: list[str] | None = None) -> None:
    """The `zoo-plan` console script: the same as `python plan_main.py ARGS`."""
    cli.run_main(main, FLAGS, doc=__doc__, argv=argv)


if __name__ == "__main__":
    run()
