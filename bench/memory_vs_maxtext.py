"""Per-chip memory of the Llama 3.1 8B train step against MaxText's, on the same slice.

    python bench/memory_vs_maxtext.py                 # rows/chip 1,4,48,52: about 25 min here
    python bench/memory_vs_maxtext.py --rows=1,4      # about 10 min

The step train_main runs (planning.compile.compile_plan: chunked loss, AdamW, f32 weights and
moments, bf16 compute, splash attention), llama3.1-8b, FSDP over the 8 chips of v5p:2x2x2,
2048 tokens per row, remat full, compiled here for the TPU without one. Per chip, GiB:
argument + output - alias + temp (MaxText's total, as its `train_compile` prints it), and
whether it fits the 95.74 GiB libtpu gives a v5p chip (a step over it fails to compile: "does
not fit").

MaxText's figures (`MAXTEXT`): maxtext 0.2.5 `train_compile`, jax 0.12 with libtpu 0.0.52,
model_name=llama3.1-8b compile_topology=v5p-16 (8 chips) per_device_batch_size=N
max_target_length=2048 remat_policy=full attention=flash (the command the project's JAX notes,
kept outside this repository, record under "Newer versions and peers"), as issue 26 records
them; 52 rows was the largest that fit there. The libtpu under test is printed with the table:
the same step takes less HBM on newer libtpu (issue 26's table), so compare rows from the same
version.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GiB = 2**30
# rows per chip -> MaxText's per-chip total, GiB (jax 0.12, libtpu 0.0.52); None: not given.
MAXTEXT = {1: 17.69, 4: 20.13, 48: 87.18, 52: None}
MAXTEXT_LARGEST = 52


def versions() -> str:
    import jax

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    return f"jax {jax.__version__}, jaxlib {version('jaxlib')}, libtpu {version('libtpu')}"


def plan_rows(rows_per_chip: int) -> dict:
    from planning.cli import Request, build
    from planning.compile import compile_plan

    request = Request(
        topology="v5p:2x2x2",
        model="llama3.1-8b",
        strategies="fsdp",
        batch_size=8 * rows_per_chip,
        seq_len=2048,
        remat=["full"],
        micro_batches=["1"],
        attention_impl="auto",
        dtype="bfloat16",
    )
    run, target, candidates, _ = build(request)
    plan = compile_plan(run, candidates[0], target)
    m = plan.memory
    return {
        "rows_per_chip": rows_per_chip,
        "argument_gib": round(m.argument_bytes / GiB, 2),
        "output_gib": round(m.output_bytes / GiB, 2),
        "alias_gib": round(m.alias_bytes / GiB, 2),
        "temp_gib": round(m.temp_bytes / GiB, 2),
        "total_gib": round(m.live_bytes / GiB, 2),
        "chip_gib": round(target.chip.memory_bytes / GiB, 2),
        "fits": plan.fits,
        "compile_error": plan.compile_error,
        "maxtext_total_gib": MAXTEXT.get(rows_per_chip),
        "kernels": plan.kernels,
        "compile_seconds": round(plan.compile_seconds, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,48,52", help="rows per chip, comma list")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
        if any(r < 1 for r in rows):
            raise ValueError
    except ValueError:
        print(f"--rows={args.rows}: expected positive integers like 1,4,48,52", file=sys.stderr)
        return 2
    from launch.cli import preamble

    preamble(huge_pages=False, cpu_only=True)  # compile-only: the chips are abstract
    print(f"# {versions()}; MaxText: jax 0.12, libtpu 0.0.52", flush=True)
    results = []
    for n in rows:
        r = plan_rows(n)
        results.append(r)
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(
                f"{n} rows/chip: total {r['total_gib']:.2f} GiB (argument {r['argument_gib']:.2f}"
                f" + output {r['output_gib']:.2f} - alias {r['alias_gib']:.2f} + temp "
                f"{r['temp_gib']:.2f}), {'fits' if r['fits'] else 'does not fit'} "
                f"{r['chip_gib']:.2f} ({r['compile_seconds']:.0f} s compile)",
                flush=True,
            )
    if not args.json:
        print()
        print("| rows/chip | MaxText total GiB | ours total GiB | ours / MaxText | fits |")
        print("|---|---|---|---|---|")
        for r in results:
            theirs = r["maxtext_total_gib"]
            ratio = f"{r['total_gib'] / theirs:.3f}" if theirs else "-"
            ours = f"{r['total_gib']:.2f}" if r["fits"] else f"does not fit ({r['total_gib']:.2f})"
            print(
                f"| {r['rows_per_chip']} | {theirs if theirs else '-'} | {ours} | {ratio} | "
                f"{'yes' if r['fits'] else 'no'} |"
            )
        print(f"\nMaxText's largest that fits: {MAXTEXT_LARGEST} rows/chip.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
