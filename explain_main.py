"""Print how each strategy lays out a model's parameters, and the collectives XLA inserts.

    python explain_main.py --model=tiny                      # 8 simulated CPU devices
    python explain_main.py --model=llama3.1-8b --strategies=fsdp,fsdp_tp --devices=64
    python explain_main.py --config=configs/tiny.py          # the model train_main would build
    python explain_main.py --write_golden=tests/golden     # regenerate the golden layouts

`--model` names a zoo preset; `--config` takes a run config file as train_main.py does
(with its `--config.model.<field>=value` overrides), whose model section may change the
preset's sizes (configs/tiny.py trains a larger model than the `tiny` preset).

Layouts come from the declarations alone (nothing is allocated), so real sizes are fine on a
laptop; `--collectives` also compiles train_main's step (launch.build, from abstract state) on
the simulated devices and counts the collectives in it (a large model compiles slowly).
"""

from __future__ import annotations

import dataclasses
import pathlib

from nnx_zoo.launch import cli

# Simulated devices must be asked for before jax starts.
cli.simulate_cpu_devices("devices", default="8")
cli.preamble(huge_pages=False, cpu_flags=False, cpu_only=True)

FLAGS = cli.new_flags()

_CONFIG = cli.define_config_flag(
    FLAGS, None, "A run config file (as train_main.py's); its model section wins over --model."
)
EXPLAIN = cli.define_flags(
    FLAGS,
    ("model", str, "tiny", "model preset (zoo.get_config name)"),
    ("strategies", list, None, "strategies; default: all of them"),
    ("devices", int, 8, "simulated devices, when running on CPU"),
    (
        "write_golden",
        str,
        None,
        "write DIR/<strategy>.txt, the layout report tests/golden pins, and stop",
    ),
    (
        "slices",
        int,
        1,
        "slices the devices stand for (the default `replica` size of hsdp / hsdp_tp)",
    ),
    ("collectives", bool, False, "also compile train_main's step and count its collectives"),
)


@cli.quiet_logging()
def main(argv):
    cli.no_arguments(argv)
    import jax

    from nnx_zoo.launch.build import model_config
    from nnx_zoo.training.config import RunConfig
    from shardings import STRATEGIES, get_strategy
    from shardings.explain import (
        count_collectives,
        count_collectives_by_link,
        layout_report,
        layout_table,
    )
    from shardings.hlo import dot_dtypes
    from zoo import get_config, param_layouts

    try:
        if _CONFIG.value is not None:
            run = cli.load_config(_CONFIG, notes=[])  # its notes are about training
            cfg = model_config(run)
        else:
            run = RunConfig.from_config_dict({})
            cfg = get_config(EXPLAIN.model.value)
        strategies = [get_strategy(s) for s in EXPLAIN.strategies.value or STRATEGIES]
    except OSError as e:  # a file the request names cannot be read
        cli.usage_error(e)
    if EXPLAIN.write_golden.value:
        out = pathlib.Path(EXPLAIN.write_golden.value)
        out.mkdir(parents=True, exist_ok=True)
        for s in strategies:
            text = layout_report(s.name, param_layouts(cfg, s), s.lm_sharding())
            (out / f"{s.name}.txt").write_text(text)
            print(f"wrote {out / f'{s.name}.txt'}")
        return
    print(cfg.describe())
    from zoo.layers.quant import describe as describe_quantization

    print(f"quantization: {describe_quantization(cfg.quantization)}")
    print(f"{jax.device_count()} devices; default meshes:")
    for s in strategies:
        shape = s.default_mesh_shape(jax.device_count(), cfg, num_slices=EXPLAIN.slices.value)
        print(f"  {s.name}: " + ", ".join(f"{a}={n}" for a, n in zip(s.axes, shape, strict=True)))
    print()
    print(layout_table({s.name: param_layouts(cfg, s) for s in strategies}))
    if EXPLAIN.collectives.value:
        print()
        print("collectives of one train step (dcn: crosses slices)")
        for s in strategies:
            text, slice_of = _compiled_text(run, cfg, s)
            by_link = count_collectives_by_link(text, slice_of)
            dcn = {op: n for (op, link), n in by_link.items() if link == "dcn"}
            total = {k: v for k, v in count_collectives(text).items() if v}
            print(f"{s.name}: {total}" + (f"; over dcn: {dcn}" if dcn else ""))
            print(f"  matmuls by operand dtypes: {dict(sorted(dot_dtypes(text).items()))}")


def _compiled_text(run, cfg, strategy):
    """(optimized HLO, slice of each device) of train_main's step (launch.build, abstract:
    nothing allocated) for `cfg` under `strategy` on its default mesh, two rows per batch
    shard of 64 tokens, no micro-batches."""
    import jax

    from nnx_zoo.launch.build import build
    from shardings.hybrid import partition_slices
    from shardings.specs import split_size

    shape = strategy.default_mesh_shape(jax.device_count(), cfg, num_slices=EXPLAIN.slices.value)
    mesh = strategy.make_mesh(shape=shape, config=cfg)
    rows = split_size(strategy.batch_spec(), 0, mesh.shape) * 2
    replace = dataclasses.replace
    run = replace(
        run,
        training=replace(run.training, sharding_strategy=strategy.name, mesh_shape=""),
        data=replace(run.data, global_batch_size=rows, seq_len=64),
        optimizer=replace(run.optimizer, micro_batches=1),
    )
    compiled, _ = build(run, mesh, abstract=True, model_cfg=cfg).compile()
    return compiled.as_text(), partition_slices(mesh)


def run(argv: list[str] | None = None) -> None:
    """The `zoo-explain` console script: the same as `python explain_main.py ARGS`."""
    cli.run_main(main, FLAGS, doc=__doc__, argv=argv)


if __name__ == "__main__":
    run()
