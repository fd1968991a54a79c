"""The request lifecycle: who runs each step, and what happens to requests after it.

`schedule()` decides the step (token budget, chunked prefill, admission with a safety margin, preemption) and hands
the model runner one StepPlan; `update(plan, sampled)` takes the sampled tokens back: it appends them, applies the
stop rule, forks n-sample groups off their shared prefill, finishes requests and returns their outputs. Every queue
edit happens here, so the engine around it is just schedule -> run -> sample -> update.

Every running request has `num_pending` tokens whose KV is not yet in the cache (a whole prompt, a chunk of it, the
one token sampled last step, or prompt + generated after preemption). A step gives each scheduled request up to that
many tokens within the `max_batch_tokens` budget. Policies differ only in order: `fifo` serves decodes first (steady
inter-token latency), `prefill_first` admits and prefills first (faster time to first token).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence

from rollout.engine.core.block_pool import BlockPool
from rollout.engine.core.kv_manager import CopyBlock, KVManager
from rollout.engine.core.request import ErrorKind, Request, RequestOutput, RequestStatus
from rollout.engine.core.sequence_group import SequenceGroup
from rollout.engine.core.step import StepPlan
from rollout.engine.core.stopping import StopChecker
from rollout.engine.core.swap_space import SwapSpace
from rollout.engine.sample.prompt_logprobs import PromptLogprobs
from rollout.engine.sample.rows import SampleResult

logger = logging.getLogger(__name__)


def _prefill_key(request: Request) -> tuple:
    """Requests may share one prefill when this matches: the same prompt, both sampling or both prefill-only
    (max_new_tokens=0), and the same prompt logprobs asked for (the leader's are copied to the others)."""
    s = request.sampling
    wanted = None if s.prompt_logprobs is None else (s.prompt_logprobs, max(1, s.prompt_logprobs_start),
                                                     s.prompt_logprobs_temperature)
    return tuple(request.prompt_ids), s.max_new_tokens == 0, wanted


class Scheduler:
    """Owns every live request, the waiting queue and the running list; their blocks are the KVManager's.

    Sequences of one prompt share its prefill: the queued leader runs the prompt and the others (`_forks`) fork off it
    when its first token is sampled. Identical prompts queued by other requests join a leader that has not started yet
    (`_open`), so TRL's repeated prompts and per-sample requests are prefilled once too.
    """

    def __init__(self, pool: BlockPool, page_size: int, max_batch_tokens: int, max_requests_per_batch: int,
                 policy: str = "fifo", safety_margin: float = 0.0, stop: StopChecker | None = None,
                 copy_block: CopyBlock | None = None, share_prefills: bool = True,
                 windows: Sequence[int | None] = (None,), swap: SwapSpace | None = None) -> None:
        self.kv = KVManager(pool, page_size, copy_block, windows, swap)
        self.pool = pool
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.policy = policy
        self.safety_margin = safety_margin
        self.stop = stop or StopChecker()
        self.share_prefills = share_prefills
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # live sequences by id
        self.groups: dict[str, SequenceGroup] = {}  # live requests by request id
        self._group_of: dict[Request, SequenceGroup] = {}
        # leader -> sequences that fork off its prefill (an ordered set), and the way back: a sequence leaves a fork
        # set in O(1), so cancelling an n-sample request costs O(n), not O(n^2)
        self._forks: dict[Request, dict[Request, None]] = {}
        self._leader_of: dict[Request, Request] = {}
        self._open: dict[tuple[int, ...], Request] = {}  # prompt -> queued leader identical prompts may join
        self._outbox: list[RequestOutput] = []  # outputs produced between two updates (failures, cancels)
        self.weight_version = 0
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # prefill entries cut short by the budget or memory
        self.counters = dict(prompt_tokens=0, generated_tokens=0, prefill_tokens=0, decode_tokens=0,
                             prefix_hit_tokens=0)

    # ------------------------------------------------------------------ queues
    def check_ids_free(self, request_id: str, sequence_ids: Iterable[str]) -> None:
        """ValueError if a live request already uses the new request's id or one of its sequences' ids."""
        taken = request_id if request_id in self.groups else next(
            (rid for rid in sequence_ids if rid in self.requests or rid in self.groups), None)
        if taken is not None:
            raise ValueError(f"request id {taken!r} is already in use; pass a unique request_id or None")

    def add(self, group: SequenceGroup, continues: str | None = None) -> None:
        """Queue a request's sequences: one prefill for the group (or none, if an identical prompt is queued).

        `continues`: the id of a kept sequence (see `kept_kv`) whose tokens the prompt extends; the group's prefill
        then starts from its KV. A continuation never shares its prefill with identical prompts.
        """
        self.check_ids_free(group.request_id, group.ids)
        self.groups[group.request_id] = group
        for member in group.members:
            self.requests[member.request_id] = member
            self._group_of[member] = group
        self.counters["prompt_tokens"] += len(group.leader.prompt_ids)
        continued = continues is not None and self.kv.adopt_kept(group.leader, continues)
        key = None if continued else _prefill_key(group.leader)
        leader = self._open.get(key) if key is not None else None
        if leader is not None:
            self._add_forks(leader, group.members)
            return
        self._forks[group.leader] = {}
        self._add_forks(group.leader, group.members[1:])
        self.waiting.append(group.leader)
        if self.share_prefills and key is not None:
            self._open[key] = group.leader

    def _add_forks(self, leader: Request, followers: Iterable[Request]) -> None:
        forks = self._forks[leader]
        for follower in followers:
            forks[follower] = None
            self._leader_of[follower] = leader

    def reject(self, outputs: Iterable[RequestOutput]) -> None:
        """Outputs of requests that failed before they were queued, returned with the next update."""
        self._outbox.extend(outputs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._outbox)

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self._outbox = self._outbox, []
        return outputs

    # --------------------------------------------------------------- the step
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = [self.max_batch_tokens]
        failed = len(self._outbox)
        if self.policy == "fifo":
            self._schedule_running(plan, budget, decode=True)
            self._schedule_running(plan, budget, decode=False)
            self._admit_waiting(plan, budget)
        else:
            self._schedule_running(plan, budget, decode=False)
            self._admit_waiting(plan, budget)
            self._schedule_running(plan, budget, decode=True)
        if not plan.requests and self.running and len(self._outbox) == failed:
            self._fail_unschedulable()
        for row, entry in enumerate(plan.sample_rows):
            leader = plan.requests[entry]
            for member in [leader, *self._forks.get(leader, ())]:
                plan.sampled.append(member)
                plan.logit_rows.append(row)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: list[int], decode: bool) -> None:
        scheduled = {id(r) for r in plan.requests}
        for request in list(self.running):
            if id(request) in scheduled or request.status == RequestStatus.PENDING:
                continue  # already in the plan, or preempted earlier in this loop
            if (request.num_pending == 1) != decode:
                continue
            if budget[0] <= 0 or len(plan) >= self.max_requests_per_batch:
                return
            num = min(request.num_pending, budget[0])
            num = self._reserve(request, num, scheduled)
            if num == 0:
                continue
            self._plan_add(plan, request, num)
            scheduled.add(id(request))
            budget[0] -= num

    def _reserve(self, request: Request, num: int, scheduled: set[int]) -> int:
        """Make room for `num` more tokens of `request`, shrinking a prefill chunk to what fits or preempting
        later arrivals; returns the tokens it may run (0 if impossible)."""
        while True:
            fits = self.kv.fit(request, num)
            if fits == num or (fits > 0 and request.num_pending > 1):  # a prefill chunk can shrink to what fits
                self.kv.allocate(request, fits)
                return fits
            victim = self._pick_victim(exclude=scheduled | {id(request)})
            if victim is None:
                return 0
            self._preempt(victim)

    def _pick_victim(self, exclude: set[int]) -> Request | None:
        for request in reversed(self.running):  # lowest priority = latest arrival = end of the list
            if id(request) not in exclude:
                return request
        return None

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks for others: its KV waits in the swap space, or it recomputes later."""
        self._requeue(request, swap=True)
        self.num_preemptions += 1
        logger.debug("preempted %s to free KV blocks (swapped: %s)", request.request_id, bool(request.host_blocks))

    def _requeue(self, request: Request, swap: bool = False) -> None:
        """Send a running request back to the front of the queue with its KV swapped out (`swap`, where the swap
        space takes it and that is cheaper) or dropped."""
        self.running.remove(request)
        if not (swap and self.kv.swap_out(request)):
            self.kv.free(request)
        request.status = RequestStatus.PENDING
        self.waiting.appendleft(request)

    def _admit_waiting(self, plan: StepPlan, budget: list[int]) -> None:
        reserve = self.safety_margin * self.pool.num_blocks
        while self.waiting and budget[0] > 0 and len(plan) < self.max_requests_per_batch:
            request = self.waiting[0]
            if self.running:
                self.kv.free_kept_for(reserve)
                if self.pool.num_free < reserve:
                    return
            if not self.kv.fits_ever(len(request.tokens) + 1):
                error = (f"needs {self.kv.blocks_needed(len(request.tokens) + 1)} KV blocks of {self.page_size} tokens "
                         f"but the cache has only {self.pool.num_blocks}; raise num_blocks (or page_size) in "
                         "ContinuousBatchingConfig or shorten the prompt")
                self._fail_with_forks(request, error, ErrorKind.CAPACITY)
                continue
            self.kv.attach_prefix(request, self.weight_version)
            num = min(request.num_pending, budget[0])
            fits = self.kv.fit(request, num)
            if fits < num and (fits == 0 or (self.running and fits < request.num_pending and fits < budget[0])):
                # Wait for memory rather than start a prefill we would soon have to preempt.
                self.kv.detach(request)
                return
            num = fits
            self.kv.allocate(request, num)
            self.waiting.popleft()
            self._close(request)  # it starts now: identical prompts arriving later queue a prefill of their own
            request.status = RequestStatus.PREFILLING
            self.running.append(request)
            self._plan_add(plan, request, num)
            budget[0] -= num

    def _fail_unschedulable(self) -> None:
        """Nothing could run: the oldest running request cannot fit even alone. Fail it rather than spin."""
        request = self.running[0]
        error = (f"ran out of KV cache at {len(request.tokens)} tokens with {self.pool.num_blocks} blocks of "
                 f"{self.page_size}; raise num_blocks in ContinuousBatchingConfig or lower max_new_tokens")
        self._fail_with_forks(request, error, ErrorKind.CAPACITY)

    # ---------------------------------------------------------------- lifecycle
    def update(self, plan: StepPlan, sampled: SampleResult, weight_version: int,
               prompt_records: Sequence[PromptLogprobs] = ()) -> list[RequestOutput]:
        """Take a finished forward back: count the computed tokens, record the prompt logprobs it gave, append each
        sampled token with its logprobs, fork groups off their prefill, stop what is done. The one writer of every
        per-token record. Returns the outputs of this step (finished requests and streaming partials, plus anything
        that failed or was cancelled since the last update)."""
        for record in prompt_records:
            _record_prompt_logprobs(plan.requests[record.entry], record)
        for req, num in zip(plan.requests, plan.query_lens):
            req.num_computed += num
            self.counters["decode_tokens" if num == 1 and req.num_generated else "prefill_tokens"] += num
        failed: dict[Request, str] = {}
        for i, req in enumerate(plan.sampled):
            error = self._accept(req, i, sampled)
            if error is not None:
                failed[req] = error
                continue
            req.tokens.append(sampled.tokens[i])
            req.logprobs.append(sampled.logprobs[i])
            req.policy_logprobs.append(sampled.policy_logprobs[i])
            req.kept_logmass.append(sampled.kept_logmass[i])
            req.weight_versions.append(weight_version)
            if i in sampled.alternatives:
                alternatives = sampled.alternatives[i]
                req.raw_logprobs.append(alternatives.raw_logprob)
                req.top_logprobs.append(alternatives.top)
                req.policy_top_logprobs.append(alternatives.policy_top)
                req.raw_top_logprobs.append(alternatives.raw_top)
            req.status = RequestStatus.DECODING
        self.counters["generated_tokens"] += len(plan.sampled) - len(failed)
        for entry in plan.prefilled:  # max_new_tokens=0: done once the prompt is in, with its group
            leader = plan.requests[entry]
            for member in [leader, *self._pop_forks(leader)]:
                member.take_prompt_logprobs(leader)
                self._finish(member, RequestStatus.FINISHED, "length", queued=member is leader)
        for entry in plan.sample_rows:
            self._fork_all(plan.requests[entry])
        for req, error in failed.items():  # after forking: a failed leader's prefill still serves its group
            self._finish(req, RequestStatus.FAILED, "error", error, ErrorKind.INVALID_REQUEST)
        for req in plan.sampled:
            if req in failed:
                continue
            reason = self.stop(req)
            if reason is not None:
                self._finish(req, RequestStatus.FINISHED, reason)
            elif req.streaming:
                self._outbox.append(req.to_output())
        return self.take_outputs()

    @staticmethod
    def _accept(req: Request, row: int, sampled: SampleResult) -> str | None:
        """Why the token sampled for `req` cannot be appended (its processors failed, or its grammar refuses the
        token), or None; a structured output's matcher advances past an accepted token here."""
        error = sampled.errors.get(row)
        if error is None and req.grammar is not None and not req.grammar.accept(sampled.tokens[row]):
            error = f"the structured-output grammar does not allow the sampled token {sampled.tokens[row]}"
        return error

    def fail_step(self, plan: StepPlan, error: str) -> list[RequestOutput]:
        """The forward of `plan` raised: unpublish its blocks and fail its requests (sequences waiting to fork off a
        failed prefill get a prefill of their own)."""
        self.kv.unpublish(plan.registered_blocks)
        for req in plan.requests:
            self._hand_over(req)
            self._finish(req, RequestStatus.FAILED, "error", f"model forward failed: {error}", ErrorKind.FORWARD)
        return self.take_outputs()

    def cancel(self, request_id: str) -> list[RequestOutput]:
        """Cancel a sequence, or every live sequence of a request, and free the blocks now; [] if none is live."""
        if request_id in self.requests:
            targets = [self.requests[request_id]]
        else:
            group = self.groups.get(request_id)
            targets = group.live() if group is not None else []
        # Sequences waiting to fork leave first, so a cancelled leader has no siblings left to hand its place to.
        for req in sorted(targets, key=lambda r: r not in self._leader_of):
            leader = self._leader_of.pop(req, None)
            if leader is not None:
                del self._forks[leader][req]
            else:
                self._hand_over(req)
            self._finish(req, RequestStatus.CANCELLED, "cancelled", queued=leader is None)
        return self.take_outputs()

    def fail_all(self, error: str, kind: ErrorKind = ErrorKind.SHUTDOWN) -> list[RequestOutput]:
        """Fail every live request (hard stop): blocks are released, outputs carry `error`."""
        self._forks.clear()
        self._leader_of.clear()
        self._open.clear()
        self.kv.free_all_kept()
        for req in list(self.requests.values()):
            self._finish(req, RequestStatus.FAILED, "error", error, kind)
        return self.take_outputs()

    def _finish(self, req: Request, status: RequestStatus, reason: str, error: str | None = None,
                kind: ErrorKind | None = None, queued: bool = True) -> None:
        """Leave the queues, free the blocks, forget the request; its output goes out with the next update.
        `queued=False`: the caller knows it waited in a fork set, in neither queue (skips two list scans)."""
        if queued and req in self.running:
            self.running.remove(req)
        elif queued and req in self.waiting:
            self.waiting.remove(req)
            self._close(req)  # only a queued leader can still be open to identical prompts
        if self.kv.kept.keeps(req) and status == RequestStatus.FINISHED:
            self.kv.park(req)
        else:
            self.kv.free(req)
        req.finish(status, reason, f"request {req.request_id!r}: {error}" if error else None, kind)
        self.requests.pop(req.request_id, None)
        group = self._group_of.pop(req, None)
        if group is not None and group.member_finished():
            del self.groups[group.request_id]
        self.counters["prefix_hit_tokens"] += req.num_prefix_hit_tokens
        self._outbox.append(req.to_output())

    def _fail_with_forks(self, leader: Request, error: str, kind: ErrorKind) -> None:
        """A prefill that can never run fails the sequences waiting to fork off it too (they need the same room)."""
        for member in [leader, *self._pop_forks(leader)]:
            self._finish(member, RequestStatus.FAILED, "error", error, kind)

    def _hand_over(self, leader: Request) -> None:
        """A leader leaves before its forks could fork: the first of them takes its place at the queue's front."""
        forks = self._pop_forks(leader)
        if not forks:
            return
        heir, *rest = forks
        self._forks[heir] = {}
        self._add_forks(heir, rest)
        self.waiting.appendleft(heir)
        key = _prefill_key(leader)
        if self._open.get(key) is leader:  # identical prompts arriving later still join the group
            self._open[key] = heir

    def _pop_forks(self, leader: Request) -> list[Request]:
        """Take `leader`'s fork set away (its sequences then belong to no leader)."""
        forks = list(self._forks.pop(leader, ()))
        for follower in forks:
            del self._leader_of[follower]
        return forks

    def _close(self, leader: Request) -> None:
        """Identical prompts may no longer join `leader`'s prefill."""
        key = _prefill_key(leader)
        if self._open.get(key) is leader:
            del self._open[key]

    def _plan_add(self, plan: StepPlan, request: Request, num: int) -> None:
        if request.num_pending > 1 and num < request.num_pending:
            self.num_chunked_prefills += 1
        plan.add(request, num)
        plan.registered_blocks.extend(self.kv.publish_full_blocks(request, request.num_computed + num))

    def _fork_all(self, leader: Request) -> None:
        """The leader's prompt is computed and its first token sampled: its forks join the running list."""
        for follower in self._pop_forks(leader):
            follower.take_prompt_logprobs(leader)
            if self.stop(follower) is not None:
                continue  # finished on its first token (the stop check follows); nothing to allocate
            if not self._fork(leader, follower):
                follower.status = RequestStatus.PENDING  # no room for its partial block: recompute later
                self.waiting.appendleft(follower)

    def _fork(self, leader: Request, follower: Request) -> bool:
        """Run `follower` right after its leader on a copy of the leader's computed prompt; False if no room."""
        if not self.kv.fork(leader, follower):
            return False
        follower.status = RequestStatus.DECODING
        self.running.insert(self.running.index(leader) + 1, follower)
        return True

    def preempt_all(self) -> list[Request]:
        """Send every running request back to recompute (used when weights change under `recompute`)."""
        preempted = list(self.running)
        for request in reversed(preempted):
            self._requeue(request)
        for request in self.waiting:  # KV swapped out under the old weights recomputes as well
            self.kv.drop_swapped(request)
        self.kv.free_all_kept()  # their continuations recompute too
        return preempted

    # ------------------------------------------------------------------ kept KV
    def keep_kv(self, sequence_ids: list[str]) -> None:
        """Keep these live sequences' blocks when they finish, for a continuation (see `kept_kv`)."""
        self.kv.kept.want(sequence_ids)

    def release_kept(self, sequence_id: str) -> bool:
        """Drop a kept sequence's blocks (its full blocks stay in the prefix cache); False if it is not kept."""
        return self.kv.free_kept(sequence_id)

    def check_invariants(self) -> None:
        """Every live sequence is in exactly one place (running, waiting, or forking off a leader), and the pool's ref
        counts match the live block tables (used by tests)."""
        places = [*self.running, *self.waiting, *(f for forks in self._forks.values() for f in forks)]
        assert len(places) == len(set(places)), "a sequence is queued twice"
        assert set(places) == set(self.requests.values()), "live sequences and queues disagree"
        assert all(leader in self.requests.values() for leader in self._forks), "forks of a finished leader"
        assert self._leader_of == {f: lead for lead, forks in self._forks.items() for f in forks}, "fork index stale"
        self.kv.check_invariants([*self.running, *self.waiting])


def _record_prompt_logprobs(request: Request, record: PromptLogprobs) -> None:
    if len(request.prompt_logprobs) != record.first + 1:  # kept contiguous by the scheduling; never write a gap
        raise RuntimeError(f"{request.request_id}: prompt logprobs recorded up to {len(request.prompt_logprobs)}, "
                           f"but this step computed them from position {record.first + 1}")
    request.prompt_logprobs.extend(record.logprobs)
    if record.top is not None:
        request.prompt_top_logprobs.extend(record.top)
