"""Who runs this step: token budget, chunked prefill, admission with a safety margin, preemption.

Every running request has `num_pending` tokens whose KV is not yet in the cache (a whole prompt, a chunk of it, the
one token sampled last step, or prompt + generated after preemption). A step gives each scheduled request up to that
many tokens within the `max_batch_tokens` budget. Policies differ only in order: `fifo` serves decodes first (steady
inter-token latency), `prefill_first` admits and prefills first (faster time to first token).
"""

from __future__ import annotations

import logging
from collections import deque

from rollout.engine.block_pool import BlockPool, hash_chain
from rollout.engine.request import Request, RequestStatus
from rollout.engine.step import StepPlan

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting queue and the running list; allocates blocks through the pool; emits a StepPlan."""

    def __init__(self, pool: BlockPool, page_size: int, max_batch_tokens: int, max_requests_per_batch: int,
                 policy: str = "fifo", safety_margin: float = 0.0) -> None:
        self.pool = pool
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.policy = policy
        self.safety_margin = safety_margin
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.weight_version = 0
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # prefill entries cut short by the budget or memory

    # ------------------------------------------------------------------ queues
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # --------------------------------------------------------------- the step
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = [self.max_batch_tokens]
        if self.policy == "fifo":
            self._schedule_running(plan, budget, decode=True)
            self._schedule_running(plan, budget, decode=False)
            self._admit_waiting(plan, budget)
        else:
            self._schedule_running(plan, budget, decode=False)
            self._admit_waiting(plan, budget)
            self._schedule_running(plan, budget, decode=True)
        if not plan.requests and self.running and not plan.failed:
            self._fail_unschedulable(plan)
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
            num = self._reserve(request, num, plan, scheduled)
            if num == 0:
                continue
            self._plan_add(plan, request, num)
            scheduled.add(id(request))
            budget[0] -= num

    def _reserve(self, request: Request, num: int, plan: StepPlan, scheduled: set[int]) -> int:
        """Make room in the block table for `num` more tokens, preempting or shrinking the chunk; 0 if impossible."""
        while True:
            needed = self.blocks_for(request.num_computed + num) - len(request.block_table)
            if needed <= self.pool.num_free:
                if needed > 0:
                    request.block_table.extend(self.pool.allocate(needed))
                return num
            if request.num_pending > 1:  # a prefill chunk can shrink to what fits
                room = (len(request.block_table) + self.pool.num_free) * self.page_size - request.num_computed
                if room > 0:
                    num = min(num, room)
                    continue
            victim = self._pick_victim(exclude=scheduled | {id(request)})
            if victim is None:
                return 0
            self._preempt(victim, plan)

    def _pick_victim(self, exclude: set[int]) -> Request | None:
        for request in reversed(self.running):  # lowest priority = latest arrival = end of the list
            if id(request) not in exclude:
                return request
        return None

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free the request's blocks and requeue it at the front; it recomputes prompt + generated later."""
        self.running.remove(request)
        self.release(request)
        request.status = RequestStatus.PENDING
        self.waiting.appendleft(request)
        plan.preempted.append(request)
        self.num_preemptions += 1
        logger.debug("preempted %s to free KV blocks", request.request_id)

    def _admit_waiting(self, plan: StepPlan, budget: list[int]) -> None:
        reserve = self.safety_margin * self.pool.num_blocks
        while self.waiting and budget[0] > 0 and len(plan) < self.max_requests_per_batch:
            request = self.waiting[0]
            if self.running and self.pool.num_free < reserve:
                return
            if self.blocks_for(len(request.tokens) + 1) > self.pool.num_blocks:
                self.waiting.popleft()
                plan.failed.append(request)
                request.error = (f"request {request.request_id!r} needs {self.blocks_for(len(request.tokens) + 1)} "
                                 f"KV blocks of {self.page_size} tokens but the cache has only {self.pool.num_blocks}; "
                                 "raise num_blocks (or page_size) in ContinuousBatchingConfig or shorten the prompt")
                continue
            self._attach_prefix(request)
            num = min(request.num_pending, budget[0])
            needed = self.blocks_for(request.num_computed + num) - len(request.block_table)
            if needed > self.pool.num_free:
                room = (len(request.block_table) + self.pool.num_free) * self.page_size - request.num_computed
                if room <= 0 or (self.running and room < request.num_pending and room < budget[0]):
                    # Wait for memory rather than start a prefill we would soon have to preempt.
                    self.release(request)
                    return
                num = min(num, room)
                needed = self.blocks_for(request.num_computed + num) - len(request.block_table)
            request.block_table.extend(self.pool.allocate(max(needed, 0)))
            self.waiting.popleft()
            request.status = RequestStatus.PREFILLING
            self.running.append(request)
            self._plan_add(plan, request, num)
            budget[0] -= num

    def _attach_prefix(self, request: Request) -> None:
        """Reuse cached blocks of the request's full-block prefix under the current weights."""
        request.kv_version = self.weight_version
        request.block_hashes = hash_chain(request.tokens, self.page_size, self.weight_version)
        request.num_hashed_blocks = 0
        for key in request.block_hashes:
            block = self.pool.lookup(key)
            if block is None:
                break
            request.block_table.append(block)
        # Always leave at least one token to compute: it yields the logits for the next sample.
        if len(request.block_table) * self.page_size >= len(request.tokens):
            self.pool.release([request.block_table.pop()])
        request.num_computed = len(request.block_table) * self.page_size
        request.num_hashed_blocks = len(request.block_table)
        request.num_prefix_hit_tokens = request.num_computed

    def _fail_unschedulable(self, plan: StepPlan) -> None:
        """Nothing could run: the oldest running request cannot fit even alone. Fail it rather than spin."""
        request = self.running[0]
        self.running.remove(request)
        self.release(request)
        request.error = (f"request {request.request_id!r} ran out of KV cache at {len(request.tokens)} tokens with "
                         f"{self.pool.num_blocks} blocks of {self.page_size}; raise num_blocks in "
                         "ContinuousBatchingConfig or lower max_new_tokens")
        plan.failed.append(request)

    # ---------------------------------------------------------------- lifecycle
    def release(self, request: Request) -> None:
        """Return a request's blocks to the pool (tail first, so cached heads outlive tails) and reset its KV state."""
        self.pool.release(reversed(request.block_table))
        request.block_table = []
        request.num_computed = 0
        request.num_hashed_blocks = 0

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.release(request)

    def _plan_add(self, plan: StepPlan, request: Request, num: int) -> None:
        if 1 < request.num_pending and num < request.num_pending:
            self.num_chunked_prefills += 1
        plan.add(request, num)
        plan.registered_blocks.extend(self._register_full_blocks(request, request.num_computed + num))

    def _register_full_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Publish blocks that are full once `num_tokens` are computed.

        Done at schedule time: every layer writes the whole step's K/V before attending, so a request admitted later
        in the same step can already share blocks this step computes. If the forward fails, the engine unpublishes
        them (`plan.registered_blocks`).
        """
        full = num_tokens // self.page_size
        if full <= request.num_hashed_blocks:
            return []
        if len(request.block_hashes) < full:
            parent = request.block_hashes[-1] if request.block_hashes else None
            request.block_hashes.extend(hash_chain(request.tokens[:full * self.page_size], self.page_size,
                                                   request.kv_version, start=len(request.block_hashes),
                                                   parent=parent))
        registered = [request.block_table[b] for b in range(request.num_hashed_blocks, full)
                      if self.pool.register(request.block_table[b], request.block_hashes[b])]
        request.num_hashed_blocks = full
        return registered

    def fork(self, leader: Request, follower: Request, copy_block) -> bool:
        """Give `follower` the leader's computed prompt: shared full blocks, a private copy of the partial block."""
        full, partial = divmod(leader.num_computed, self.page_size)
        if partial and self.pool.num_free < 1:
            return False
        follower.block_table = leader.block_table[:full]
        for block in follower.block_table:
            self.pool.share(block)
        if partial:
            (new_block,) = self.pool.allocate(1)
            copy_block(leader.block_table[full], new_block, partial)
            follower.block_table.append(new_block)
        follower.num_computed = leader.num_computed
        follower.kv_version = leader.kv_version
        follower.block_hashes = list(leader.block_hashes[:full])
        follower.num_hashed_blocks = min(leader.num_hashed_blocks, full)
        follower.status = RequestStatus.DECODING
        self.running.insert(self.running.index(leader) + 1, follower)
        return True

    def preempt_all(self) -> list[Request]:
        """Send every running request back to recompute (used when weights change under `recompute`)."""
        preempted = list(self.running)
        for request in reversed(preempted):
            self.running.remove(request)
            self.release(request)
            request.status = RequestStatus.PENDING
            self.waiting.appendleft(request)
        return preempted

