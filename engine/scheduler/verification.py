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
    hold_spec_slot / state_before_verify / settle, for linear-attention hybrids: a
                     recurrent state cannot drop rows, so the state before a verification
                     is copied into the request's second slot (spec_slot) before the step;
                     after a rejection the slots swap and num_computed goes back to the
                     chunk's start, so the next step replays the known token and the
                     accepted proposals from that state (docs/speculative.md)
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
        if self.snapshots is not None and self.snapshots.boundary(req.num_computed, 1, req.num_tokens) is not None:
            return []  # a hybrid's decode that ends on a state snapshot boundary takes its snapshot first
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

    def hold_spec_slot(self, req: Request) -> bool:
        """A hybrid's request that proposes holds a second state slot until it leaves (the
        pool has two per running request then: engine/config.py hybrid_settings); False
        when none is free. Always True for a model without recurrent state."""
        if not self.slots_used or req.spec_slot is not None:
            return True
        if not self.free_slots:
            return False
        req.spec_slot = self.free_slots.pop()
        return True

    def state_before_verify(self, seqs) -> list[tuple[int, int]]:
        """(working slot, spec slot) copies to run before the step: each verifying hybrid
        request's state before its rows, which a rejection resumes from."""
        return [(s.req.state_slot, s.req.spec_slot) for s in seqs if s.draft and s.req.spec_slot is not None]

    def settle(self, sch, num_emitted: int) -> None:
        """After the emitted tokens are recorded: K/V is valid for the chunk's known token
        and the accepted proposals, i.e. up to the newest token (not yet computed). A
        hybrid's state is past that after a rejection: it goes back to the copy taken
        before the step, and the known token and accepted proposals are computed again."""
        req = sch.req
        if req.finished or req.status != Status.RUNNING:
            return
        valid = min(sch.start + num_emitted, req.num_tokens - 1)
        req.num_computed = valid
        if req.spec_slot is not None and sch.draft and num_emitted <= len(sch.draft):
            req.state_slot, req.spec_slot = req.spec_slot, req.state_slot
            req.num_computed = sch.start  # the replay's rows reach the prefix cache when it runs
            self.spec.record_replay(valid - sch.start)
        self.prefix.publish(req, req.num_computed, sch.start)
        keep = self.bm.pages_for(valid)
        if len(req.pages) > keep:
            self.bm.free(req.pages[keep:])
            del req.pages[keep:]

    def spec_finished(self, req: Request) -> None:
        """Suffix decoding: what the request generated is proposed to later requests; its own
        history goes with it."""
        if self.suffix is not None and req.pooling is None:
            self.suffix.finished(req.output_ids)
        req.spec_suffix = None
