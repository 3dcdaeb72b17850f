"""Speculative decoding's side of the scheduler: proposals scheduled, verifications settled.

    proposing()      whether a step may carry proposals at all (the batch-size switch,
                     engine/speculative/policy.py)
    draft_for()      a running decode's proposals this step (engine/speculative/ngram.py,
                     suffix.py, or the MTP layer's guess the last step made: mtp_step.py),
                     cut to the token budget, max_tokens and max_model_len; none while the
                     request backs off
    verify()         the step's sampled rows decide how many proposals are accepted
    record_verified  each emitted token recorded as one step would (EOS, stop ids, lengths)
    settle()         the rows of rejected proposals roll back: num_computed covers the
                     accepted ones only, pages past them go back to the pool, and only
                     accepted tokens reach the prefix cache
    spec_finished()  a finished request's output joins suffix decoding's global cache

Rejected proposals' K/V rows stay in the pages the request keeps until its next chunk
overwrites them; no page whose rows include one is ever published (publish covers full
pages of accepted tokens only).
"""

from __future__ import annotations

from jaxfill.engine.request import Request, Status
from jaxfill.engine.scheduler.step_plan import total_tokens
from jaxfill.engine.speculative.acceptance import SpecCounters, accept_prefix
from jaxfill.engine.speculative.ngram import propose_ngram
from jaxfill.engine.speculative.policy import SpecPolicy
from jaxfill.engine.speculative.suffix import History, SuffixProposer


class Verification:
    """Mixin of Scheduler (batching.py): `speculative` is the config's SpeculativeSettings."""

    def init_speculative(self, speculative) -> None:
        self.speculative = speculative
        self.spec = SpecCounters(speculative.num_tokens if speculative is not None else 0)
        self.spec_policy = SpecPolicy(speculative) if speculative is not None and speculative.enabled else None
        self.suffix = SuffixProposer(speculative) if speculative is not None and speculative.method == "suffix" else None

    def proposing(self, num_decodes: int) -> bool:
        """Whether this step's decodes may propose: off at speculative.disable_by_batch_size."""
        return self.spec_policy is not None and self.spec_policy.step_allows(num_decodes)

    def wants_proposals(self) -> bool:
        """Whether a step planned now could carry proposals, if every token were known: the
        engine then takes the step in flight first (async scheduling, engine/core.py); else
        it keeps overlapping steps. Changes nothing."""
        if self.spec_policy is None:
            return False
        return self.spec_policy.would_propose([r for r in self.running if r.matcher is None and r.pooling is None])

    def draft_for(self, req: Request, room: int) -> list[int]:
        """Proposals for a one-token decode given `room` extra rows of the step's budget.
        None for a constrained request (its grammar masks need each token first) or a
        token still in flight (async scheduling)."""
        sp = self.speculative
        if sp is None or not sp.enabled or req.matcher is not None:
            return []
        if not self.spec_policy.may_propose(req):
            return []  # backing off (counts its decode steps, in flight or not)
        if room <= 0 or req.in_flight:
            return []
        k = min(sp.num_tokens, room, req.params.max_tokens - len(req.output_ids) - 1,
                self.max_model_len - total_tokens(req))
        if k <= 0:
            return []
        if sp.method == "mtp":  # the MTP layer's guess from the step that brought the newest token
            guess = req.mtp_draft
            return [guess[0]] if guess is not None and guess[1] == req.num_tokens else []
        if self.suffix is not None:
            if req.spec_suffix is None:
                req.spec_suffix = History()
            draft = self.suffix.propose(req.spec_suffix, req.prompt_ids, req.output_ids, k)
        else:
            draft = propose_ngram(req.prompt_ids + req.output_ids, k, sp.ngram_max, sp.ngram_min)
        if not draft:
            self.spec_policy.record_miss(req, k)  # no match: as useless as k rejected proposals
        return draft

    def verify(self, sch, targets: list[int]) -> list[int]:
        """The tokens the verification emits (accepted proposals, then the target's own);
        [] when the request finished meanwhile."""
        req = sch.req
        if req.finished:
            return []
        emitted = accept_prefix(sch.draft, targets)
        self.spec.record(len(sch.draft), len(emitted) - 1)
        self.spec_policy.record(req, len(sch.draft), len(emitted) - 1)
        req.in_flight -= 1
        return emitted

    def record_verified(self, sch, token: int, now: float):
        from jaxfill.engine.scheduler.transitions import Sampled

        return Sampled(token, self._record_token(sch.req, token, now))

    def settle(self, sch, num_emitted: int) -> None:
        """After the emitted tokens are recorded: K/V is valid for the chunk's known token
        and the accepted proposals, i.e. up to the newest token (not yet computed)."""
        req = sch.req
        if req.finished or req.status != Status.RUNNING:
            return
        req.num_computed = min(sch.start + num_emitted, req.num_tokens - 1)
        self.prefix.publish(req, req.num_computed, sch.start)
        keep = self.bm.pages_for(req.num_computed)
        if len(req.pages) > keep:
            self.bm.free(req.pages[keep:])
            del req.pages[keep:]

    def spec_finished(self, req: Request) -> None:
        """Suffix decoding: what the request generated is proposed to later requests; its own
        history goes with it."""
        if self.suffix is not None and req.pooling is None:
            self.suffix.finished(req.output_ids)
        req.spec_suffix = None
