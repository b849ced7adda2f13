"""Per-request difference between our lm-eval backend and the harness's own `hf` backend (torch,
CPU, float32) on the example tasks, all items: the tests' tiny random Llama, one device.

    PYTHONPATH=. python -m bench.harness_vs_hf [--style=llama|gpt2]

Needs torch and transformers (`pip install torch==2.13.0 "lm-eval[hf]==0.4.13"`). Prints, per
task, the largest |log-likelihood difference|, how many is-greedy flags / generations differ,
and both backends' metrics and wall times (compiles included).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_NAMES = ["zoo_facts", "zoo_prose", "zoo_facts_gen"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--style", choices=["llama", "gpt2"], default="llama")
    args = parser.parse_args()

    import jax
    import lm_eval

    from bench.fixtures import TASKS, write_tiny_llama
    from nnx_zoo.data.tokenizers import make_tokenizer
    from nnx_zoo.evaluation.harness import run_tasks, task_manager
    from nnx_zoo.evaluation.harness_lm import ZooLM
    from shardings import get_strategy
    from zoo import from_pretrained

    hf_dir = os.path.join(tempfile.mkdtemp(), "tiny")
    write_tiny_llama(hf_dir, args.style, max_seq_len=64)
    strategy = get_strategy("dp")
    mesh = strategy.make_mesh(devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = from_pretrained(hf_dir, strategy)
    start = time.perf_counter()
    lm = ZooLM(model, mesh, make_tokenizer(hf_dir), rows=8)
    ours = run_tasks(lm, TASK_NAMES, include_path=TASKS, log_samples=True)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    ref = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir},dtype=float32",
        device="cpu",
        batch_size=8,
        tasks=TASK_NAMES,
        task_manager=task_manager(TASK_NAMES, TASKS),
        log_samples=True,
    )
    ref_s = time.perf_counter() - start
    print(f"{args.style} tokenizer; ours {ours_s:.1f} s, hf backend {ref_s:.1f} s")
    for task in TASK_NAMES:
        worst, differ, n = 0.0, 0, 0
        for a, b in zip(ours["samples"][task], ref["samples"][task], strict=True):
            assert a["arguments"] == b["arguments"], task
            for x, y in zip(a["resps"], b["resps"], strict=True):
                x, y = x[0], y[0]
                n += 1
                if isinstance(x, tuple):
                    worst = max(worst, abs(x[0] - y[0]))
                    differ += x[1] != y[1]
                elif isinstance(x, float):
                    worst = max(worst, abs(x - y))
                else:
                    differ += x != y
        metrics = {
            k: (round(v, 6), round(ref["results"][task][k], 6))
            for k, v in ours["results"][task].items()
            if isinstance(v, float)
        }
        print(
            f"  {task}: {n} requests, max |diff| {worst:.2e}, {differ} differ; "
            f"(ours, hf): {metrics}"
        )


if __name__ == "__main__":
    main()
