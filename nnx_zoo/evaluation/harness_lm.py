"""This project's model as an lm-evaluation-harness backend (`lm_eval.api.model.LM`).

    lm = ZooLM(model, mesh, tokenizer, rows=8)
    lm_eval.simple_evaluate(model=lm, tasks=["zoo_facts"], task_manager=...)

The model is one already laid out on its mesh (any strategy: nnx_zoo/evaluation/model.py loads a
run's checkpoint or a Hugging Face directory). Strings become ids by the harness's Hugging Face
backend conventions (nnx_zoo/evaluation/harness_tokens.py). `loglikelihood` and
`loglikelihood_rolling` requests are packed into rows and scored many per call
(nnx_zoo/evaluation/harness_batch.py); `generate_until` runs batches of prompts through the KV cache
(zoo/generate.py), then cuts each text at the first stop sequence.

Lengths follow the hf backend too: a request longer than `max_length` + 1 ids keeps its last
`max_length` + 1 (the first conditions only), a generation prompt its last
`max_length - max_gen_toks`, and rolling windows hold `max_length` inputs.
"""

from __future__ import annotations

import json
import logging

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from nnx_zoo.errors import UsageError
from nnx_zoo.evaluation.harness_batch import score
from nnx_zoo.evaluation.harness_tokens import HarnessTokens, rolling_windows

_log = logging.getLogger(__name__)
DEFAULT_MAX_GEN_TOKS = 256  # the hf backend's


class ZooLM(TemplateLM):
    """`model` (on `mesh`) with the project `tokenizer`, for the harness.

    `rows`: rows per model call (rounded up to the mesh's batch split); `max_length`: the
    context the harness may use (default: the model's `max_seq_len`, as the hf backend reads
    `max_position_embeddings`); `pack=False` gives every request a padded row of its own;
    `seed`: the draws of sampled `generate_until` requests (`top_k`, `top_p` and
    `temperature` as the task's generation kwargs give them).
    """

    def __init__(
        self,
        model,
        mesh,
        tokenizer,
        *,
        rows: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        pack: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        if model.cfg.vocab_size < tokenizer.vocab_size:
            raise UsageError(
                f"model vocab_size={model.cfg.vocab_size} is smaller than the tokenizer's "
                f"{tokenizer.vocab_size} ids"
            )
        self.model, self.mesh = model, mesh
        self.tokens = HarnessTokens(tokenizer)
        self.rows = rows
        self._max_length = min(max_length or model.cfg.max_seq_len, model.cfg.max_seq_len)
        self._max_gen_toks = max_gen_toks
        self.pack = pack
        self.seed = seed
        self.calls = 0  # requests lists handed to the model (for tests and figures)

    # -- what the harness reads ------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokens.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokens.prefix_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return repr(self.tokens.tokenizer)

    def get_model_info(self) -> dict:
        cfg = self.model.cfg
        return {
            "model_type": type(cfg).__name__,
            "model_num_parameters": int(cfg.num_params()) if hasattr(cfg, "num_params") else None,
            "mesh_shape": dict(self.mesh.shape),
            # Which draws the sampled generate_until tasks made: the same seed, the same text.
            "sampling_seed": self.seed,
        }

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        return self.tokens.encode(string, add_special_tokens)

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tokens.decode(tokens)

    # -- requests --------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        encoded = [
            ((context, continuation), *self.tokens.encode_pair(context, continuation))
            for context, continuation in (r.args for r in requests)
        ]
        return self._loglikelihood_tokens(encoded)

    def _score(self, pairs):
        """(log p, greedy) of each (context ids, continuation ids), truncated on the left
        to max_length + 1 ids like the hf backend."""
        seqs = []
        for ctx, cont in pairs:
            if not cont:
                raise UsageError("a loglikelihood request with an empty continuation")
            if len(cont) > self.max_length:
                raise UsageError(
                    f"a continuation of {len(cont)} tokens exceeds max_length={self.max_length}"
                )
            seqs.append(((list(ctx) + list(cont))[-(self.max_length + 1) :], len(cont)))
        self.calls += 1
        return score(
            self.model,
            self.mesh,
            seqs,
            rows=self.rows,
            max_row=self.max_length + 1,
            pack_rows=self.pack,
        )

    def _loglikelihood_tokens(self, requests, **kwargs):
        scored = self._score([(ctx, cont) for _, ctx, cont in requests])
        out = []
        for (key, _, _), s in zip(requests, scored, strict=True):
            answer = (s.logprob, s.greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for w in rolling_windows(
                self.tokens.encode(text), self.prefix_token_id, self.max_length
            ):
                windows.append(w)
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, s in zip(owner, self._score(windows), strict=True):
            totals[i] += s.logprob
        for r, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        from zoo.generate import generate

        eos_text = self.tokens._token_text(self.eot_token_id)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str | None] = [None] * len(requests)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            budget = int(kwargs.pop("max_gen_toks"))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            if not kwargs.pop("do_sample", False):
                temperature = 0.0
            top_k = kwargs.pop("top_k", None)
            top_p = kwargs.pop("top_p", None)
            if kwargs:
                _log.warning("generate_until: ignoring generation kwargs %s", sorted(kwargs))
            max_ctx = self.max_length - budget
            if max_ctx < 1:
                raise UsageError(
                    f"max_gen_toks={budget} leaves no room for a prompt in max_length="
                    f"{self.max_length}"
                )
            contexts = [requests[i].args[0] for i in members]
            lengths = [len(self.tokens.encode(c)) for c in contexts]
            order = sorted(range(len(members)), key=lambda j: -lengths[j])
            for start in range(0, len(order), self.rows):
                chunk = order[start : start + self.rows]
                prompts = self.tokens.encode_batch_start([contexts[j] for j in chunk])
                prompts = [p[-max_ctx:] or [self.prefix_token_id] for p in prompts]
                # One shape for every batch of this group: rows filled up (by repeating a
                # prompt, then dropped), prompt columns a power of two (left padding).
                longest = max(len(p) for p in prompts)
                columns = min(max(16, 1 << (longest - 1).bit_length()), max_ctx)
                filled = prompts + [prompts[-1]] * (self.rows - len(prompts))
                self.calls += 1
                with_mesh = generate(
                    self.model,
                    filled,
                    prompt_len=columns,
                    max_new_tokens=budget,
                    temperature=temperature,
                    top_k=int(top_k) if top_k else None,
                    top_p=float(top_p) if top_p is not None else None,
                    eos_id=self.eot_token_id,
                    # Draws depend on the seed and the batch, not on earlier calls.
                    seed=self.seed + start,
                )
                for j, ids in zip(chunk, with_mesh[: len(chunk)], strict=True):
                    text = postprocess_generated_text(self.tokens.decode(ids), until, None)
                    out[members[j]] = text
                    self.cache_hook.add_partial("generate_until", requests[members[j]].args, text)
        return out
