"""Per-chip memory of the Llama 3.1 8B train step against MaxText's, on the same slice.

    python -m bench.memory_vs_maxtext                 # rows/chip 1,4,48,52
    python -m bench.memory_vs_maxtext --rows=1,4
    python -m bench.memory_vs_maxtext --rows=1 --remat=full,dots,save_qkv_proj,save_out_proj
    python -m bench.memory_vs_maxtext --rows=1 --copies   # + the vocab-sized copies in the HLO

The step train_main runs (`launch.build`, the assembly plan_main and train_main share:
chunked loss, AdamW, f32 weights and moments, bf16 compute, splash attention), llama3.1-8b,
FSDP over the 8 chips of v5p:2x2x2, 2048 tokens per row, compiled here for the TPU without
one (82-143 s per compile on 2 quiet cores; 4-22 min on 2 cores shared with test runs).
Per chip, GiB: argument + output - alias + temp (MaxText's total, as its
`train_compile` prints it), and whether it fits the 95.74 GiB libtpu gives a v5p chip (a step
over it fails to compile: "does not fit").

`--remat` compiles each policy and prints, per rows/chip, every policy's total and what it
keeps over `full`, beside MaxText's policy of the same role (`REMAT_PEERS`): our `dots` and
its `minimal` both keep q, k, v, the attention output projection and the MLP's gate and up
(`minimal` also names the down projection, which no backward op reads). `--copies` lists the
top-level `copy` instructions of the compiled step whose shape has the vocab's size (layout
copies of logits or of the LM head; a chunk of logits is `[rows, C, V]`).

MaxText's figures (`MAXTEXT`): maxtext 0.2.5 `train_compile`, jax 0.12.0.1 with libtpu
0.0.52, model_name=llama3.1-8b compile_topology=v5p-16 (8 chips) per_device_batch_size=N
max_target_length=2048 remat_policy=P attention=flash (the command the project's JAX notes,
kept outside this repository, record under "MaxText as a side-by-side peer"); 52 rows was the
largest that fit
there. The 1-row policy rows come from a venv with `maxtext[tpu]==0.2.5` (it resolves
jax 0.12.0.1 and libtpu 0.0.52), the venv that also ran ours with this checkout on
PYTHONPATH. The libtpu under test is printed with the table: the same step takes less HBM
on newer libtpu (issue 26's table), so compare rows from the same version.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GiB = 2**30
VOCAB = 128256  # llama3.1-8b
# (rows per chip, MaxText policy) -> MaxText's per-chip total, GiB (jax 0.12.0.1, libtpu
# 0.0.52); None: not measured.
MAXTEXT = {
    (1, "full"): 17.686,
    (1, "minimal"): 21.972,
    (1, "save_qkv_proj"): 18.253,
    (1, "save_out_proj"): 17.900,
    (4, "full"): 20.13,
    (48, "full"): 87.18,
}
MAXTEXT_LARGEST = 52
# Our policy -> MaxText's of the same role (maxtext/layers/nnx_decoders.py, get_remat_policy).
REMAT_PEERS = {
    "full": "full",
    "dots": "minimal",
    "save_qkv_proj": "save_qkv_proj",
    "save_out_proj": "save_out_proj",
}


def versions() -> str:
    import jax

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    return f"jax {jax.__version__}, jaxlib {version('jaxlib')}, libtpu {version('libtpu')}"


def compile_step(rows_per_chip: int, remat: str):
    """(StepMemory, compile error or None, HLO text or '', seconds, chip bytes): the step
    planning.compile.compile_plan compiles for this request, kept with its program text."""
    from nnx_zoo.launch.build import build as build_run
    from nnx_zoo.planning.cli import Request, build
    from nnx_zoo.planning.compile import compile_or_oom, make_mesh, run_for
    from nnx_zoo.training.step_memory import StepMemory, step_memory

    request = Request(
        topology="v5p:2x2x2",
        model="llama3.1-8b",
        strategies="fsdp",
        batch_size=8 * rows_per_chip,
        seq_len=2048,
        remat=[remat],
        micro_batches=["1"],
        attention_impl="auto",
        dtype="bfloat16",
    )
    run, target, candidates, _ = build(request)
    candidate = candidates[0]
    built = build_run(run_for(run, candidate), make_mesh(target, candidate), abstract=True)
    outcome = compile_or_oom(built)
    if outcome.program is None:
        temp = outcome.oom_temp_bytes
        memory = StepMemory(0, 0, 0, temp, temp, 0)
        return memory, outcome.oom_line, "", outcome.seconds, target.chip
    compiled = outcome.program
    return step_memory(compiled), None, compiled.as_text(), outcome.seconds, target.chip


# A top-level instruction: `%name = dtype[dims]{layout} op(operands), ...`.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ([a-z0-9]+)\[([0-9,]*)\]\S* ([\w\-]+)\(")


def vocab_copies(hlo_text: str, vocab: int = VOCAB) -> list[str]:
    """`name dtype[dims]` of each copy / copy-start outside fused computations whose shape
    has a dim of `vocab` (or of a vocab shard, vocab/8): a materialised layout change of
    logits or of the LM head weight."""
    out, fused = [], False
    sizes = {vocab, vocab // 8}
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            # A computation header: fusion bodies are never materialised on their own.
            fused = "fused_computation" in line or line.startswith("%fused")
            continue
        match = _INSTRUCTION.match(line)
        if fused or match is None:
            continue
        name, dtype, dims, op = match.groups()
        if op not in ("copy", "copy-start"):
            continue
        if sizes & {int(d) for d in dims.split(",") if d}:
            out.append(f"{name} {dtype}[{dims}]")
    return out


def measure(rows_per_chip: int, remat: str, copies: bool, hlo_dir: str | None) -> dict:
    memory, error, text, seconds, chip = compile_step(rows_per_chip, remat)
    if hlo_dir and text:
        with open(os.path.join(hlo_dir, f"ours_{remat}_{rows_per_chip}.hlo"), "w") as f:
            f.write(text)
    out = {
        "rows_per_chip": rows_per_chip,
        "remat": remat,
        "argument_gib": round(memory.argument_bytes / GiB, 2),
        "output_gib": round(memory.output_bytes / GiB, 2),
        "alias_gib": round(memory.alias_bytes / GiB, 2),
        "temp_gib": round(memory.temp_bytes / GiB, 2),
        "total_gib": round(memory.live_bytes / GiB, 2),
        "chip_gib": round(chip.memory_bytes / GiB, 2),
        "fits": error is None and memory.required_bytes <= chip.memory_bytes,
        "compile_error": error,
        "maxtext_policy": REMAT_PEERS.get(remat),
        "maxtext_total_gib": MAXTEXT.get((rows_per_chip, REMAT_PEERS.get(remat))),
        "compile_seconds": round(seconds, 1),
    }
    if copies:
        out["vocab_copies"] = vocab_copies(text) if text else None
    return out


def print_rows(results: list[dict]) -> None:
    print("| rows/chip | MaxText total GiB | ours total GiB | ours / MaxText | fits |")
    print("|---|---|---|---|---|")
    for r in results:
        theirs = r["maxtext_total_gib"]
        ratio = f"{r['total_gib'] / theirs:.3f}" if theirs else "-"
        ours = f"{r['total_gib']:.2f}" if r["fits"] else f"does not fit ({r['total_gib']:.2f})"
        print(
            f"| {r['rows_per_chip']} | {f'{theirs:.2f}' if theirs else '-'} | {ours} | {ratio} | "
            f"{'yes' if r['fits'] else 'no'} |"
        )


def print_policies(results: list[dict], rows_per_chip: int) -> None:
    """Each policy's total and its excess over `full`, ours against MaxText's peer."""
    by = {r["remat"]: r for r in results if r["rows_per_chip"] == rows_per_chip}
    ours_full = by.get("full", {}).get("total_gib")
    theirs_full = MAXTEXT.get((rows_per_chip, "full"))
    print(f"\n{rows_per_chip} rows/chip, GiB per chip:")
    print("| ours | total | over full | MaxText | total | over full |")
    print("|---|---|---|---|---|---|")
    for name, r in by.items():
        peer, theirs = r["maxtext_policy"], r["maxtext_total_gib"]
        over = f"{r['total_gib'] - ours_full:.2f}" if ours_full is not None else "-"
        their_over = f"{theirs - theirs_full:.2f}" if theirs and theirs_full else "-"
        print(
            f"| {name} | {r['total_gib']:.2f} | {over} | {peer or '-'} | "
            f"{f'{theirs:.2f}' if theirs else '-'} | {their_over} |"
        )


def main(argv=None) -> int:
    policies = ("none", *REMAT_PEERS)  # zoo.layers.remat's, less offload (host memory)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,48,52", help="rows per chip, comma list")
    parser.add_argument(
        "--remat", default="full", help=f"our remat policies, comma list ({', '.join(policies)})"
    )
    parser.add_argument(
        "--copies", action="store_true", help="list the vocab-sized copies in each compiled step"
    )
    parser.add_argument("--hlo_dir", help="write each compiled step's HLO text here")
    parser.add_argument("--json", action="store_true", help="one JSON object per compile")
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
        if any(r < 1 for r in rows):
            raise ValueError
    except ValueError:
        print(f"--rows={args.rows}: expected positive integers like 1,4,48,52", file=sys.stderr)
        return 2
    remats = [r.strip() for r in args.remat.split(",") if r.strip()]
    if not remats or any(r not in policies for r in remats):
        valid = ", ".join(policies)
        print(f"--remat={args.remat}: expected policies from {valid}", file=sys.stderr)
        return 2
    if args.hlo_dir and not os.path.isdir(args.hlo_dir):
        print(f"--hlo_dir={args.hlo_dir}: not a directory", file=sys.stderr)
        return 2
    from nnx_zoo.launch.cli import preamble

    preamble(huge_pages=False, cpu_only=True)  # compile-only: the chips are abstract
    print(f"# {versions()}; MaxText: jax 0.12.0.1, libtpu 0.0.52", flush=True)
    results = []
    for n in rows:
        for remat in remats:
            r = measure(n, remat, args.copies, args.hlo_dir)
            results.append(r)
            if args.json:
                print(json.dumps(r), flush=True)
                continue
            print(
                f"{n} rows/chip remat={remat}: total {r['total_gib']:.2f} GiB (argument "
                f"{r['argument_gib']:.2f} + output {r['output_gib']:.2f} - alias "
                f"{r['alias_gib']:.2f} + temp {r['temp_gib']:.2f}), "
                f"{'fits' if r['fits'] else 'does not fit'} {r['chip_gib']:.2f} "
                f"({r['compile_seconds']:.0f} s compile)",
                flush=True,
            )
            if args.copies:
                found = r["vocab_copies"]
                print(f"  vocab-sized copies: {', '.join(found) if found else 'none'}", flush=True)
    if args.json:
        return 0
    full = [r for r in results if r["remat"] == "full"]
    if full:
        print()
        print_rows(full)
        print(f"\nMaxText's largest that fits: {MAXTEXT_LARGEST} rows/chip.")
    if len(remats) > 1:
        for n in rows:
            print_policies(results, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
