"""lm-evaluation-harness (`pip install lm_eval`) on a jaxfill Engine, scored by prompt_logprobs.

    import jaxfill.engine.lm_eval_model  # registers model "jaxfill" with lm_eval
    lm_eval.simple_evaluate(model="jaxfill", model_args="config=tiny,max_model_len=1024", tasks=[...])
    lm_eval.simple_evaluate(model=JaxfillLM(engine=my_engine), tasks=[...])  # an engine you have
model_args: config, model_path, engine settings by name (max_num_seqs=32). Tokens as lm_eval's `hf` makes them.
"""

from __future__ import annotations

from jaxfill.engine.config import load_config
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import SamplingParams

try:
    # lm_eval registers its own models ("hf", "vllm", ...) lazily, only when get_model finds
    # the registry empty: registering ours first would hide them. Import their table first.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    MISSING = None
except ImportError as e:  # jaxfill does not depend on lm_eval: this module imports without it
    MISSING, LM = e, object

IGNORED_ARGS = ("batch_size", "max_batch_size", "device")  # simple_evaluate passes these to every model


class JaxfillLM(LM):
    def __init__(self, engine: Engine | None = None, config: str | None = None, model_path: str | None = None,
                 progress: bool = False, **settings):
        if MISSING is not None:
            raise ImportError(f"JaxfillLM needs lm_eval (pip install lm_eval): {MISSING}") from MISSING
        super().__init__()
        for name in IGNORED_ARGS:
            settings.pop(name, None)
        self._owns_engine = engine is None
        if engine is None:
            overrides = {k if "." in k else f"engine.{k}": v for k, v in settings.items()}
            engine = Engine(load_config(config, overrides, model_path), progress=progress)
        elif settings:
            raise TypeError(f"engine settings {sorted(settings)} need config=..., not an engine")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        # What an empty context and rolling windows condition on: BOS, else EOS (as `hf` does).
        bos = getattr(self.tokenizer, "bos_token_id", None)
        self.prefix_token_id = bos if bos is not None else self.tokenizer.eos_token_ids[0]
        self.max_model_len = engine.settings.max_model_len

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm_eval's TemplateLM rule: the context's trailing spaces move to the continuation;
        encode the whole and the context (both with BOS), the continuation is the rest."""
        if not context:
            cont = self.tokenizer.encode(continuation, add_bos=False)
            return ([self.prefix_token_id], cont) if cont[:1] != [self.prefix_token_id] else (cont[:1], cont[1:])
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer.encode(context + continuation)
        ctx = self.tokenizer.encode(context)
        return ctx, whole[len(ctx):]

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether each of its tokens is the argmax) for
        each (context ids, continuation ids), all in one generate. Sequences longer than a
        prompt lose the start of their context, as `hf` truncates them."""
        limit = self.max_model_len - 1  # a prompt plus one generated token must fit
        prompts = [(ctx + cont)[-limit:] for ctx, cont in pairs]
        done = self.engine.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
        out = []
        for (_, cont), completion in zip(pairs, done):
            entries = completion.prompt_logprobs[len(completion.prompt_logprobs) - len(cont):] if cont else []
            assert all(e is not None for e in entries), "a continuation token has no context to score it"
            out.append((sum(e["logprob"] for e in entries),
                        all(e["top"][0][0] == e["token_id"] for e in entries)))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        results = self._score(pairs)
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Every token of the text given the ones before it (the first given BOS), in windows
        of the longest prompt (lm_eval's rolling windows) when it does not fit in one."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, req in enumerate(requests):
            ids = self.tokenizer.encode(req.args[0], add_bos=False)
            for window in get_rolling_token_windows(ids, self.prefix_token_id, self.max_model_len - 2, 1):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._score(windows)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests) -> list[str]:
        """Greedy unless gen_kwargs ask do_sample=True; stops at `until`, EOS or max_gen_toks."""
        prompts, params = [], []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            max_tokens = int(kwargs.get("max_gen_toks", 256))
            sample = bool(kwargs.get("do_sample", False))
            prompts.append(context)
            params.append(SamplingParams(
                max_tokens=max_tokens, stop=(until,) if isinstance(until, str) else tuple(until),
                temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                seed=kwargs.get("seed"),
                # the context's end, as `hf` left-truncates, leaving room for the output
                truncate_prompt_tokens=max(self.max_model_len - max_tokens, 1)))
        texts = [c.text for c in self.engine.generate(prompts, params)]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts


if MISSING is None:
    register_model("jaxfill")(JaxfillLM)
