"""Requests per second of the lm-eval backend's `loglikelihood` on the example multiple-choice
task (144 requests), tiny model on CPU: packed batches against one request per model call.

    PYTHONPATH=. python -m bench.harness_throughput [--rows=8] [--repeats=3]

The model is the tests' tiny random Llama (vocab 512, 2 layers, 64 wide) on one CPU device
(dp). Each mode runs once to compile, then `--repeats` timed passes over all requests.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax
    from lm_eval.api.instance import Instance

    from bench.fixtures import TASKS, write_tiny_llama
    from nnx_zoo.data.tokenizers import make_tokenizer
    from nnx_zoo.evaluation.harness_lm import ZooLM
    from shardings import get_strategy
    from zoo import from_pretrained

    hf_dir = os.path.join(tempfile.mkdtemp(), "tiny")
    write_tiny_llama(hf_dir, "llama", max_seq_len=256)
    strategy = get_strategy("dp")
    mesh = strategy.make_mesh(devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = from_pretrained(hf_dir, strategy)
    with open(os.path.join(TASKS, "zoo_facts.jsonl")) as f:
        docs = [json.loads(line) for line in f]
    requests = [
        Instance("loglikelihood", d, (f"Question: {d['question']}\nAnswer:", f" {c}"), i)
        for d in docs
        for i, c in enumerate(d["choices"])
    ]
    tokenizer = make_tokenizer(hf_dir)
    modes = {
        f"packed, {args.rows} rows per call": lambda: ZooLM(
            model, mesh, tokenizer, rows=args.rows
        ).loglikelihood(requests),
        "one request per call": lambda: [
            ZooLM(model, mesh, tokenizer, rows=1, pack=False).loglikelihood([r]) for r in requests
        ],
    }
    print(f"{len(requests)} loglikelihood requests (zoo_facts), {jax.devices()[0].platform}")
    for name, run in modes.items():
        run()  # compile
        start = time.perf_counter()
        for _ in range(args.repeats):
            run()
        seconds = (time.perf_counter() - start) / args.repeats
        print(f"  {name}: {len(requests) / seconds:.1f} requests/s ({seconds:.3f} s per pass)")


if __name__ == "__main__":
    main()
