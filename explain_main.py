"""Print how each strategy lays out a model's parameters, and the collectives XLA inserts.

    python explain_main.py --model=tiny                      # 8 simulated CPU devices
    python explain_main.py --model=llama3.1-8b --strategies=fsdp,fsdp_tp --devices=64
    python explain_main.py --config=configs/tiny.py          # the model train_main would build
    python explain_main.py --write_golden=tests/golden     # regenerate the golden layouts

`--model` names a zoo preset; `--config` takes a run config file as train_main.py does
(with its `--config.model.<field>=value` overrides), whose model section may change the
preset's sizes (configs/tiny.py trains a larger model than the `tiny` preset).

Layouts come from the declarations alone (nothing is allocated), so real sizes are fine on a
laptop; `--collectives` also compiles one forward+backward pass on the simulated devices
(small models only).
"""

from __future__ import annotations

import os
import pathlib
import sys

from launch import cli


def _simulate_devices() -> None:
    # Simulated devices must be requested before jax starts, and a --config file imports jax
    # while the flags are parsed: read --devices from the command line first.
    count = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--devices=")), "8")
    if count.isdigit():
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
        )


_simulate_devices()
cli.preamble(huge_pages=False, cpu_flags=False, cpu_only=True)

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs.locate import resolve_argv  # noqa: E402

# config_flags loads the file while defining the flag: a shipped config by name (`tiny`) or
# by its checkout path from any directory (configs/locate.py), as train_main takes it.
sys.argv[1:] = resolve_argv(sys.argv[1:])
_MODEL = flags.DEFINE_string("model", "tiny", "model preset (zoo.get_config name)")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A run config file (as train_main.py's); its model section wins over --model."
)
_STRATEGIES = flags.DEFINE_list("strategies", None, "strategies; default: all of them")
_DEVICES = flags.DEFINE_integer("devices", 8, "simulated devices, when running on CPU")
_WRITE_GOLDEN = flags.DEFINE_string(
    "write_golden", None, "write DIR/<strategy>.txt, the layout report tests/golden pins, and stop"
)
_SLICES = flags.DEFINE_integer(
    "slices", 1, "slices the devices stand for (the default `replica` size of hsdp / hsdp_tp)"
)
_COLLECTIVES = flags.DEFINE_bool(
    "collectives", False, "also compile forward+backward and count collectives"
)


def main(argv):
    cli.no_arguments(argv)
    import jax

    from shardings import STRATEGIES, get_strategy
    from shardings.explain import (
        count_collectives,
        count_collectives_by_link,
        layout_report,
        layout_table,
    )
    from shardings.hlo import dot_dtypes
    from zoo import get_config, param_layouts

    config = None
    if _CONFIG.value is not None:
        try:
            config = _CONFIG.value
            hasattr(config, "to_dict")  # a file that failed to load raises at the first use
        except Exception as e:  # noqa: BLE001 -- any error in the file: one line, exit 2
            cli.usage_error(cli.config_file_message(e))
    try:
        if config is not None:
            from training.config import RunConfig

            cfg = RunConfig.from_config_dict(config).model.decoder_config()
        else:
            cfg = get_config(_MODEL.value)
        strategies = [get_strategy(s) for s in _STRATEGIES.value or STRATEGIES]
    except (ValueError, OSError) as e:
        cli.usage_error(e)
    if _WRITE_GOLDEN.value:
        out = pathlib.Path(_WRITE_GOLDEN.value)
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
        shape = s.default_mesh_shape(jax.device_count(), cfg, num_slices=_SLICES.value)
        print(f"  {s.name}: " + ", ".join(f"{a}={n}" for a, n in zip(s.axes, shape, strict=True)))
    print()
    print(layout_table({s.name: param_layouts(cfg, s) for s in strategies}))
    if _COLLECTIVES.value:
        print()
        print("collectives of one forward+backward pass (dcn: crosses slices)")
        for s in strategies:
            text, slice_of = _compiled_text(cfg, s)
            by_link = count_collectives_by_link(text, slice_of)
            dcn = {op: n for (op, link), n in by_link.items() if link == "dcn"}
            total = {k: v for k, v in count_collectives(text).items() if v}
            print(f"{s.name}: {total}" + (f"; over dcn: {dcn}" if dcn else ""))
            print(f"  matmuls by operand dtypes: {dict(sorted(dot_dtypes(text).items()))}")


def _compiled_text(cfg, strategy):
    import jax
    import numpy as np
    from flax import nnx

    from shardings.hybrid import partition_slices
    from shardings.specs import split_size
    from zoo import create_model
    from zoo.loss import lm_loss

    shape = strategy.default_mesh_shape(jax.device_count(), cfg, num_slices=_SLICES.value)
    mesh = strategy.make_mesh(shape=shape, config=cfg)
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        B = split_size(strategy.batch_spec(), 0, mesh.shape) * 2
        tokens = jax.device_put(np.zeros((B, 64), np.int32), strategy.batch_spec())

        def loss(model, tokens):
            logits = model(tokens, segment_ids=tokens + 1, positions=tokens)
            return lm_loss(logits, tokens, tokens + 1)[0]

        graphdef, state = nnx.split(model)
        fn = jax.jit(lambda s, t: jax.grad(lambda s: loss(nnx.merge(graphdef, s), t))(s))
        return fn.lower(state, tokens).compile().as_text(), partition_slices(mesh)


if __name__ == "__main__":
    cli.run_main(main)
