"""This project against transformers + PyTorch (eager) on CPU, side by side, same weights.

    pip install "torch==2.14.*" "transformers==5.23.*"     # not project extras
    python -m bench.vs_transformers                         # small (4x512) and 3.4M (8x256)
    python -m bench.vs_transformers --models=mini --rounds=2

For each model the project builds a Llama with random weights, writes it with
`save_pretrained`, and both stacks load that directory (`zoo.from_pretrained`,
`LlamaForCausalLM.from_pretrained`), float32, one device. Each stack lives in its own worker
process (so neither's thread pool spins while the other runs). Both get the same batch and
AdamW(lr, b1, b2, eps, weight decay on every parameter), and their first losses must agree
(else exit status 1: the models differ and the timings would compare different work).

Timed, per round, stacks alternated (which goes first flips each round):
  train    one optimizer step (forward, backward, AdamW) on a B x T batch;
  forward  the logits of that batch (no gradients);
  generate a 64-token prompt, 64 greedy tokens with the KV cache (batch 1).
Each stack repeats a mode for at least --steps / --forward_reps calls and --round_seconds
per round; the figure is the median over all timed calls. Compilation (JAX) and warm-up
steps (both) come before round 1 and are reported apart. The 1-minute load average is read
before every round: this machine's other users slow both stacks, and a figure is only worth
its load.

JAX runs as train_main does: with the project's XLA CPU flags when ZOO_XLA_CPU_FLAGS=1 asks for
them (nnx_zoo/runtime/xla_cpu.py), and with huge pages for the host allocator when
ZOO_HUGE_PAGES=1 asks for them and the host allows them (nnx_zoo/runtime/cpu_memory.py).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = 'pip install "torch==2.14.*" "transformers==5.23.*"'

# name -> (Llama shape, batch rows, row length). `small` is configs/small.py's model.
MODELS = {
    "small": (
        dict(hidden_dim=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64,
             ffn_dim=3072),
        4,
        512,
    ),
    "mini": (
        dict(hidden_dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
             ffn_dim=768),
        8,
        256,
    ),
}  # fmt: skip
VOCAB = 512
PROMPT, NEW_TOKENS = 64, 64
OPTIMIZER = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
# Same weights, same float32 math in another order: the mean losses agree to ~1e-6 relative;
# 1e-4 is far below what any real difference in the model makes (a wrong RoPE, norm or mask
# moves the first loss by 1e-2 or more).
LOSS_RTOL = 1e-4


# --- the JAX side -------------------------------------------------------------------------


class JaxStack:
    def __init__(self, checkpoint: str, tokens):
        import jax
        import numpy as np
        import optax
        from flax import nnx

        from nnx_zoo.training.loop import Trainer
        from shardings import get_strategy
        from zoo import from_pretrained

        strategy = get_strategy("fsdp_tp")
        self.mesh = strategy.make_mesh()
        self.jax, self.nnx = jax, nnx
        with jax.set_mesh(self.mesh):
            self.model = from_pretrained(checkpoint, strategy, max_seq_len=PROMPT + NEW_TOKENS)
            o = OPTIMIZER
            tx = optax.adamw(o["lr"], o["b1"], o["b2"], o["eps"], weight_decay=o["weight_decay"])
            optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)
            seg = np.ones_like(tokens)
            pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
            spec = strategy.batch_spec()
            self.batch = {
                k: jax.device_put(np.ascontiguousarray(v), spec)
                for k, v in (("tokens", tokens), ("segment_ids", seg), ("positions", pos))
            }
            self.trainer = Trainer(self.model, optimizer, batch_spec=spec)
        self.prompt = [int(t) for t in tokens[0, :PROMPT]]

        # The trainer's state is the live one (its steps donate the buffers they replace).
        def forward(state, batch):
            model, _ = nnx.merge(self.trainer.graphdef, state)
            return model(
                batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
            )

        self._forward = jax.jit(forward)

    def compile(self) -> float:
        with self.jax.set_mesh(self.mesh):
            start = time.perf_counter()
            self.trainer.compile(self.batch)
            self._forward = self._forward.lower(self.trainer.state, self.batch).compile()
            self.generate()  # generation compiles on first call
            return time.perf_counter() - start

    def first_loss(self) -> float:
        from zoo.loss import lm_loss

        with self.jax.set_mesh(self.mesh):
            logits = self._forward(self.trainer.state, self.batch)
            return float(lm_loss(logits, self.batch["tokens"], self.batch["segment_ids"])[0])

    def train(self) -> float:
        with self.jax.set_mesh(self.mesh):
            return float(self.trainer.train_step(self.batch)["loss"])

    def forward(self) -> None:
        with self.jax.set_mesh(self.mesh):
            self.jax.block_until_ready(self._forward(self.trainer.state, self.batch))

    def generate(self) -> list[int]:
        from zoo.generate import generate

        model, _ = self.trainer.sync()
        with self.jax.set_mesh(self.mesh):
            return generate(model, [self.prompt], max_new_tokens=NEW_TOKENS)[0]


# --- the PyTorch side ---------------------------------------------------------------------


class TorchStack:
    def __init__(self, checkpoint: str, tokens, perturb: bool = False):
        import torch
        from transformers import LlamaForCausalLM

        self.torch = torch
        self.model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        if perturb:  # a model that differs a little: the first-loss check must stop the bench
            with torch.no_grad():
                self.model.model.norm.weight.mul_(1.05)
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0
        o = OPTIMIZER
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=o["lr"],
            betas=(o["b1"], o["b2"]),
            eps=o["eps"],
            weight_decay=o["weight_decay"],
        )
        self.tokens = torch.from_numpy(tokens.astype("int64"))
        self.prompt = self.tokens[:1, :PROMPT]

    def compile(self) -> float:
        return 0.0  # eager: nothing to compile

    def first_loss(self) -> float:
        with self.torch.no_grad():
            return float(self.model(self.tokens, labels=self.tokens).loss)

    def train(self) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(self.tokens, labels=self.tokens).loss
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def forward(self) -> None:
        self.model.eval()
        with self.torch.inference_mode():
            self.model(self.tokens).logits.sum()

    def generate(self) -> list[int]:
        self.model.eval()
        with self.torch.inference_mode():
            out = self.model.generate(
                self.prompt,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                attention_mask=self.torch.ones_like(self.prompt),
            )
        return out[0, PROMPT:].tolist()


# --- workers and rounds -------------------------------------------------------------------


def _worker(stack_name: str, checkpoint: str, tokens, conn, perturb: bool) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if stack_name == "jax":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from nnx_zoo.runtime.xla_cpu import set_cpu_flags

        set_cpu_flags()
        stack = JaxStack(checkpoint, tokens)
    else:
        stack = TorchStack(checkpoint, tokens, perturb)
    conn.send(("ok", None))
    while True:
        command, arg = conn.recv()
        if command == "quit":
            return
        try:
            if command == "time":
                mode, reps, min_seconds = arg
                fn = getattr(stack, mode)
                seconds = []
                while len(seconds) < reps or sum(seconds) < min_seconds:
                    start = time.perf_counter()
                    fn()
                    seconds.append(time.perf_counter() - start)
                conn.send(("ok", seconds))
            else:
                conn.send(("ok", getattr(stack, command)()))
        except Exception:  # noqa: BLE001 - handed to the parent, which stops the bench
            conn.send(("error", traceback.format_exc()))


class Worker:
    def __init__(self, ctx, stack_name, checkpoint, tokens, perturb=False):
        self.conn, child = ctx.Pipe()
        self.name = stack_name
        self.process = ctx.Process(
            target=_worker, args=(stack_name, checkpoint, tokens, child, perturb), daemon=True
        )
        # With ZOO_HUGE_PAGES=1 the project's processes run with huge pages for the host
        # allocator (nnx_zoo/runtime/cpu_memory.py: the entry points restart with them); torch's
        # as a user starts it. A spawned worker takes the environment it is started with.
        saved = dict(os.environ)
        if stack_name == "jax":
            from nnx_zoo.runtime.cpu_memory import huge_page_environ

            os.environ.update(huge_page_environ(os.environ)[0] or {})
        try:
            self.process.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self._expect()

    def _expect(self):
        try:
            status, value = self.conn.recv()
        except EOFError:
            sys.exit(f"the {self.name} worker died (exit code {self.process.join(5)})")
        if status == "error":
            sys.exit(f"the {self.name} worker failed:\n{value}")
        return value

    def call(self, command, arg=None):
        self.conn.send((command, arg))
        return self._expect()

    def close(self):
        if self.process.is_alive():
            self.conn.send(("quit", None))
            self.process.join(30)


def _export(shape: dict, directory: str) -> None:
    """Random Llama weights (seed 0) written as a Hugging Face checkpoint directory."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from flax import nnx

    from shardings import get_strategy
    from zoo import create_model, get_config, save_pretrained

    cfg = get_config("tiny", vocab_size=VOCAB, max_seq_len=2048, rope_theta=10_000.0, **shape)
    strategy = get_strategy("fsdp_tp")
    with jax.set_mesh(strategy.make_mesh(config=cfg)):
        save_pretrained(create_model(cfg, strategy, rngs=nnx.Rngs(0)), directory)


def bench_model(name: str, args, ctx) -> list[dict]:
    import numpy as np

    shape, rows, length = MODELS[name]
    checkpoint = os.path.join(tempfile.mkdtemp(), name)
    exporter = ctx.Process(target=_export, args=(shape, checkpoint))
    exporter.start()
    exporter.join()
    if exporter.exitcode:
        sys.exit(f"exporting the {name} checkpoint failed")
    tokens = np.random.default_rng(0).integers(0, VOCAB, (rows, length), dtype=np.int32)
    workers = {s: Worker(ctx, s, checkpoint, tokens, args.perturb_torch) for s in ("jax", "torch")}
    try:
        losses = {s: w.call("first_loss") for s, w in workers.items()}
        gap = abs(losses["jax"] - losses["torch"]) / abs(losses["torch"])
        print(
            f"[{name}] first loss: project {losses['jax']:.6f}, torch {losses['torch']:.6f} "
            f"(relative gap {gap:.1e})",
            flush=True,
        )
        if not gap <= LOSS_RTOL:
            print(
                f"error: first losses differ by {gap:.1e} relative (> {LOSS_RTOL:.0e}): "
                "the two models are not the same; timings would compare different work",
                file=sys.stderr,
            )
            sys.exit(1)
        compile_s = {s: w.call("compile") for s, w in workers.items()}
        gen = {s: w.call("generate") for s, w in workers.items()}
        agree = sum(a == b for a, b in zip(gen["jax"], gen["torch"], strict=True))
        print(
            f"[{name}] compile: project {compile_s['jax']:.1f} s; greedy tokens equal in "
            f"{agree}/{NEW_TOKENS} places (ties in a random model may differ)",
            flush=True,
        )
        for w in workers.values():  # warm-up: one of each, untimed
            w.call("time", ("train", args.warmup, 0.0))
            w.call("time", ("forward", 1, 0.0))

        tokens_per_call = {"train": rows * length, "forward": rows * length, "generate": NEW_TOKENS}
        reps = {"train": args.steps, "forward": args.forward_reps, "generate": 1}
        samples = {(s, m): [] for s in workers for m in reps}
        loads = []
        for r in range(args.rounds):
            order = ["jax", "torch"] if r % 2 == 0 else ["torch", "jax"]
            loads.append(os.getloadavg()[0])
            line = [f"[{name}] round {r + 1} load {loads[-1]:.2f}:"]
            for mode in args.modes:
                for s in order:
                    seconds = workers[s].call("time", (mode, reps[mode], args.round_seconds))
                    rates = [tokens_per_call[mode] / t for t in seconds]
                    samples[(s, mode)] += rates
                    line.append(f"{mode} {s} {statistics.median(rates):.0f}")
            print(" ".join(line), flush=True)
    finally:
        for w in workers.values():
            w.close()
    out = []
    for mode in args.modes:
        ours = statistics.median(samples[("jax", mode)])
        theirs = statistics.median(samples[("torch", mode)])
        out.append(
            dict(
                model=name,
                batch=f"{rows}x{length}" if mode != "generate" else f"1x{PROMPT}+{NEW_TOKENS}",
                mode=mode,
                project=ours,
                torch=theirs,
                ratio=ours / theirs,
                load=f"{min(loads):.1f}-{max(loads):.1f}",
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,mini", help=f"of {','.join(MODELS)}")
    parser.add_argument("--modes", default="train,forward,generate")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="train steps per round")
    parser.add_argument("--forward_reps", type=int, default=2, help="forwards per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed train steps")
    parser.add_argument(
        "--round_seconds",
        type=float,
        default=3.0,
        help="each stack repeats each mode for at least this long per round (more calls "
        "for the fast 3.4M model, so one slow call moves its median less)",
    )
    parser.add_argument(
        "--perturb_torch",
        action="store_true",
        help="scale torch's final norm by 1.05, to see the first-loss check stop the bench",
    )
    args = parser.parse_args()
    args.modes = args.modes.split(",")
    names = args.models.split(",")
    bad = [n for n in names if n not in MODELS] + [
        m for m in args.modes if m not in ("train", "forward", "generate")
    ]
    if bad:
        print(
            f"error: unknown {bad[0]!r}; models are {','.join(MODELS)}, modes are "
            "train,forward,generate",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print(f"error: this bench needs torch and transformers: {INSTALL}", file=sys.stderr)
        sys.exit(2)
    print(f"needs: {INSTALL}")
    print(f"cores: {os.cpu_count()}; XLA_FLAGS for the project: ", end="")
    from nnx_zoo.runtime.xla_cpu import set_cpu_flags

    print(repr(set_cpu_flags(dict(os.environ))), flush=True)
    from nnx_zoo.runtime.cpu_memory import huge_page_environ

    huge, _ = huge_page_environ(os.environ)
    print(
        "GLIBC_TUNABLES for the project: "
        + repr(huge["GLIBC_TUNABLES"] if huge else os.environ.get("GLIBC_TUNABLES", "")),
        flush=True,
    )
    ctx = mp.get_context("spawn")
    rows = []
    for name in names:
        rows += bench_model(name, args, ctx)
    header = f"{'model':6} {'batch':10} {'mode':8} {'project':>9} {'torch':>9} {'ratio':>6}"
    header += f" {'load':>8}"
    print("\ntokens/s, median over every timed call of every round (float32, one device)")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['model']:6} {r['batch']:10} {r['mode']:8} {r['project']:9.1f} "
            f"{r['torch']:9.1f} {r['ratio']:6.2f} {r['load']:>8}"
        )


if __name__ == "__main__":
    main()
