"""Token-level scheduler: decides, each step, which sequences run and how many tokens each gets.

Running sequences first (decodes and unfinished prefill chunks), then waiting ones, all within a
token budget and a sequence limit, so long prompts are prefilled in chunks beside ongoing decodes.
When KV blocks run out it preempts by recompute: the lowest-score, latest-admitted sequence
gives its blocks back and returns to the waiting queue at its original place. A waiting sequence
whose score beats a running one's by `preemption_margin` may preempt it, unless that one was
aged past the aging bound (then it sorts first and is never displaced by others). With two KV
pools (block_manager.KvPools) a sequence short of blocks preempts only within its own pool.

Deadline pacing: a request with a deadline must produce its remaining tokens one a step, so the
step time must stay under (time left) / (tokens left). While a running request needs that and
the steps are slower, the step's token budget shrinks (prefill chunks give way first),
multiplicatively while steps are too slow and back additively while they are fast enough:
a controller on the measured step time, with no model of what a step costs. Once no prefill is
left to give, the decodes of sequences that rank below the paced request by the preemption margin
can sit steps out too (`pause_decodes`, off by default: they keep their KV blocks and resume where
they stopped, with nothing recomputed), for where a step's time grows with its batch, as on a
CPU. A request that could not keep pace even with the smallest paced steps seen lately is not
paced for (it would only cost the others).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from services.executor.engine.block_manager import BlockManager
from services.executor.engine.sequence import SeqStatus, Sequence

PACE_DECREASE = 0.8  # the paced budget's factor after a step slower than the pace
PACE_INCREASE = 16  # tokens it regains after a step comfortably within the pace
MIN_PREFILL = 16  # prompt tokens a paced step still runs besides its decodes
PACE_SAFETY = 0.9  # aim at this share of the step time a deadline needs (the controller wobbles)
FLOOR_ALPHA = 0.2  # weight of the latest step at the smallest paced budget in its moving average
FLOOR_DECAY = 0.999  # per other step: the floor is forgotten (the batch it was seen at changes)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    start_pos: int  # position of the first new token
    samples: bool  # the chunk reaches the end of the known tokens, so a token is sampled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, admission_watermark: float = 0.01,
                 preemption_margin: float = 1.0, deadline_pacing: bool = True,
                 pause_decodes: bool = False):
        self.block_manager = block_manager
        self.deadline_pacing = deadline_pacing
        self.pause_decodes = pause_decodes
        self.pace_for: Sequence | None = None  # the request the latest pace_target() paces for
        self.pace_tokens = max_num_batched_tokens  # the paced step's budget (controller state)
        self.floor_step_s: float | None = None  # steps at the smallest paced budget, lately
        self.step_budget = max_num_batched_tokens  # the latest step's token budget
        self.at_floor = False  # whether the latest schedule() ran at that budget
        self.paced_steps = 0
        self.paused_decodes = 0  # decodes that sat a step out for a deadline's pace, in all
        self.preemption_margin = preemption_margin
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Keep a few blocks free when admitting new work, so running decodes rarely get
        # preempted: a share of each pool (of a small int8 pool, a share of its own size).
        self.pool_watermarks = [int(admission_watermark * block_manager.pool_size(pool))
                                for pool in range(block_manager.num_pools)]
        self.watermark_blocks = sum(self.pool_watermarks)
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # discarded by preemptions and computed again

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def age(self, seq: Sequence) -> None:
        """`seq` has waited past the aging bound: it goes ahead of every sequence that has not
        and none of those may preempt it."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            seq.aged = True
            self.add(seq)
        else:
            seq.aged = True

    def overtake_above(self) -> float | None:
        """The score a newcomer needs to start here at once: to outrank, by the preemption
        margin, every running prefill (their chunks would go first), the best waiting sequence
        and, when every slot is taken or others already wait (for slots or KV blocks), the
        weakest running one (preempted for it). None when nothing is in its way (there is
        room), something in its way was aged, or there is no margin to outrank by."""
        if self.preemption_margin <= 0:
            return None
        rivals = [s for s in self.running if self._tokens_to_run(s) > 1]
        if self.waiting:
            rivals.append(self.waiting[0])
        if self.running and (self.waiting or len(self.running) >= self.max_num_seqs):
            rivals.append(max(self.running, key=Sequence.sort_key))
        if not rivals or any(s.aged for s in rivals):
            return None
        return max(s.score for s in rivals) + self.preemption_margin

    def intake_room(self, horizon_steps: float) -> int:
        """Prompt tokens this executor can take on now and still start them within about
        `horizon_steps` steps: the prefill its steps can do in that time (the token budget after
        one token per decoding sequence) less what running prefills and waiting sequences still
        need, and no more than its free KV blocks (above the watermark) hold once those have
        theirs. At most 0: what it already has keeps it busy for the horizon."""
        bm, bs = self.block_manager, self.block_manager.block_size
        backlog = blocks = decodes = 0
        for seq in self.running:
            left = seq.num_tokens - seq.num_computed_tokens
            if left > 1:
                backlog += left
                blocks += max(0, -(-seq.num_tokens // bs) - len(seq.block_table))
            else:
                decodes += 1
        for seq in self.waiting:
            left = seq.num_tokens - seq.num_computed_tokens
            backlog += left
            blocks += -(-left // bs)
        # While deadline pacing holds steps back, the prefill a step does is what it allows.
        per_step = max(self.step_budget - decodes, MIN_PREFILL)
        prefill = max(1, int(horizon_steps * per_step))
        kv_tokens = (bm.num_free_blocks - self.watermark_blocks - blocks) * bs
        return min(prefill - backlog, kv_tokens)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.block_manager.free_seq(seq)

    def pace_target(self, now: float) -> float | None:
        """The step time (s) the most pressed running request with a deadline, among those that
        outrank every prefill pacing would hold back, needs: its time
        left over the steps it still needs (its outputs up to max_tokens, and its prefill at a
        full budget a step). Those that could not keep up even at the smallest paced steps are
        left out. None: nobody needs a pace. (One step more than it needs: the one in flight
        while the next is scheduled.)"""
        target = math.inf
        self.pace_for = None
        floor = 0.0 if self.floor_step_s is None else self.floor_step_s
        # Pacing holds back prefill: only for a request that outranks every prefill it holds
        # back (no low-priority deadline may slow a high-priority prompt).
        held = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        if self.waiting:
            held.append(self.waiting[0])
        ranked = sorted(held, key=Sequence.sort_key)[:2]
        for seq in self.running:
            if seq.deadline is None:
                continue
            rivals = [s for s in ranked if s is not seq][:1]
            if rivals and rivals[0].sort_key() < seq.sort_key():
                continue  # a prefill it would hold back outranks it
            steps = max(1, seq.sampling.max_tokens - seq.num_output_tokens) + 1
            prefill = seq.num_tokens - seq.num_computed_tokens
            if prefill > 1:
                steps += -(-prefill // self.max_num_batched_tokens)
            need = (seq.deadline - now) / steps
            if floor <= need < target:
                target, self.pace_for = need, seq
        return None if target == math.inf else PACE_SAFETY * target

    def step_done(self, seconds: float, target: float | None, at_floor: bool = False) -> None:
        """A step ran in `seconds`; it was scheduled for a pace of `target` (None: unpaced),
        `at_floor`: at the smallest paced budget."""
        floor = self.floor_step_s
        if at_floor:
            self.floor_step_s = seconds if floor is None else floor + FLOOR_ALPHA * (
                seconds - floor)
        elif floor is not None:
            self.floor_step_s = floor * FLOOR_DECAY
        ceiling = self.max_num_batched_tokens
        if target is not None and seconds > target:
            self.pace_tokens = max(MIN_PREFILL, int(self.pace_tokens * PACE_DECREASE))
        elif target is None or seconds < 0.9 * target:
            self.pace_tokens = min(ceiling, self.pace_tokens + PACE_INCREASE)

    def schedule(self, target: float | None = None) -> list[ScheduledSeq]:
        """One step's sequences and tokens. `target`: the step time deadline pacing aims at
        (`pace_target`); the budget is then the controller's, never less than every decode that
        may not pause (`pause_decodes` off: every decode) plus MIN_PREFILL."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        self.running.sort(key=Sequence.sort_key)
        self.at_floor = False
        self.step_budget = budget
        decodes = [s for s in self.running if self._tokens_to_run(s) <= 1]
        paused: list[Sequence] = []
        if target is not None:
            keep = len(decodes)
            if self.pause_decodes and self.pace_for is not None:
                # Those that rank within the margin of the paced request (or were aged) keep
                # running; they come first in `decodes`, which is in sort_key order.
                keep = sum(1 for s in decodes if self._keeps_pace(s))
            paced = max(self.pace_tokens, keep + MIN_PREFILL)
            if paced < budget:
                budget = self.step_budget = paced
                self.paced_steps += 1
                self.at_floor = paced == keep + MIN_PREFILL
                if paced < len(decodes) + MIN_PREFILL:
                    # Below every decode: the lowest-ranked decodes sit this step out (after
                    # the prefill below, if budget is left), their KV kept.
                    decodes, paused = decodes[:keep], decodes[keep:]

        # Budget order: running decodes (a long prefill never stalls them: stall-free batching),
        # then the prefill chunks of running sequences that outrank the best waiting one, then
        # new admissions, then the remaining chunks. A high-score arrival so starts its prefill
        # at once instead of waiting behind the chunks of lower-score prompts.
        prefills = [s for s in self.running if self._tokens_to_run(s) > 1]
        best_waiting = self.waiting[0].sort_key() if self.waiting else None
        ahead = [s for s in prefills if best_waiting is None or s.sort_key() < best_waiting]
        behind = [s for s in prefills if best_waiting is not None and s.sort_key() >= best_waiting]
        budget, preempted = self._schedule_running(decodes + ahead, scheduled, budget)

        # Admission in score order within each KV pool: a pool out of blocks stops admitting
        # for this step but does not hold back sequences bound for another pool.
        full_pools: set[int] = set()
        index = 0
        while index < len(self.waiting) and budget > 0 and not preempted:
            seq = self.waiting[index]
            if seq.pool in full_pools:
                index += 1
                continue
            if seq.num_pending:  # preempted while its last token was in flight: next step
                break
            if len(self.running) >= self.max_num_seqs and not self._outranks(
                    seq, max(self.running, key=Sequence.sort_key)):
                break  # no slot to be had: nothing after it outranks more (its cache untouched)
            lost = 0  # back from a preemption: what must run again
            claimed = not seq.block_table
            if claimed:
                cached = bm.take_cached_prefix(seq)
                if not seq.admitted_once:  # (a resumed request's outputs may be cached too)
                    seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
                elif seq.discarded_tokens:
                    lost = max(0, min(seq.discarded_tokens, seq.num_tokens - 1) - cached)
            reserve = self.pool_watermarks[seq.pool]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._could_fit(seq, num_new, reserve) and len(self.running) >= self.max_num_seqs:
                victim = self._preempt_lower(seq)  # (one it outranks: checked above)
                budget += scheduled.pop(victim, 0)
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # Blocks: only where its pool can hold it once the sequences it outranks there have
            # given theirs back (_could_fit); else nothing is preempted for it, a slot taken
            # from another pool's sequence would be given back, recomputed, step after step.
            while not bm.can_allocate(seq, num_new, reserve=reserve) \
                    and self._could_fit(seq, num_new, reserve):
                victim = self._preempt_lower(seq, same_pool=True)
                if victim is None:
                    break
                budget += scheduled.pop(victim, 0)
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.can_allocate(seq, num_new, reserve=reserve):
                self._give_back(seq, claimed)
                full_pools.add(seq.pool)
                if len(full_pools) == bm.num_pools:
                    break
                index += 1
                continue
            bm.allocate(seq, num_new)
            if lost:
                seq.recomputed_tokens += lost
                self.num_recomputed_tokens += lost
                seq.discarded_tokens = 0
            self.waiting.pop(index)
            seq.status = SeqStatus.RUNNING
            seq.admitted_once = True
            self.running.append(seq)
            scheduled[seq] = num_new
            budget -= num_new

        budget, _ = self._schedule_running(behind + paused, scheduled, budget)
        self.paused_decodes += sum(1 for s in paused
                                   if s not in scheduled and s.status is SeqStatus.RUNNING)

        batch = []
        for seq, num_new in scheduled.items():
            start = seq.num_computed_tokens
            seq.num_computed_tokens += num_new
            samples = seq.num_computed_tokens == seq.num_tokens
            batch.append(ScheduledSeq(seq, num_new, start, samples))
            if samples:
                seq.num_pending += 1
            bm.commit_full_blocks(seq)
        if bm.num_pools > 1:  # the model attends pool by pool, over consecutive rows
            batch.sort(key=lambda item: item.seq.pool)
        return batch

    def _schedule_running(self, seqs: list[Sequence], scheduled: dict[Sequence, int],
                          budget: int) -> tuple[int, bool]:
        """Give running sequences their tokens, in the order given, preempting the lowest-score
        running sequence while KV blocks run short; the budget left and whether it preempted."""
        bm = self.block_manager
        preempted = False
        for seq in seqs:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(self._tokens_to_run(seq), budget)
            if num_new == 0:
                continue
            while not bm.can_allocate(seq, num_new):
                # The lowest score, latest admitted, among those whose blocks it can use.
                victim = max((s for s in self.running if s.pool == seq.pool),
                             key=Sequence.sort_key)
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            bm.allocate(seq, num_new)
            scheduled[seq] = num_new
            budget -= num_new
        return budget, preempted

    def _keeps_pace(self, seq: Sequence) -> bool:
        """Whether `seq`'s decode runs while pacing for `pace_for`: it was aged, or it ranks
        within the preemption margin of it (what may preempt may pause, and nothing less)."""
        return (seq is self.pace_for or seq.aged
                or self.pace_for.score - seq.score < self.preemption_margin)

    def _tokens_to_run(self, seq: Sequence) -> int:
        if seq.num_output_tokens >= seq.sampling.max_tokens:
            return 0  # its last token is in flight; it finishes when that token is processed
        return seq.num_tokens - seq.num_computed_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.discarded_tokens = seq.num_computed_tokens
        self.block_manager.free_seq(seq)
        seq.preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _outranks(self, seq: Sequence, victim: Sequence) -> bool:
        """Whether `seq` may preempt `victim`: by the margin, and never an aged one unless
        itself aged."""
        return not (victim.aged and not seq.aged) and \
            seq.score - victim.score >= self.preemption_margin

    def _preempt_lower(self, seq: Sequence, same_pool: bool = False) -> Sequence | None:
        """Preempt the weakest running sequence (in `seq`'s KV pool, when it is blocks `seq`
        needs) if `seq` outranks it by the margin; return it."""
        rivals = [s for s in self.running if s.pool == seq.pool] if same_pool else self.running
        if not rivals:
            return None
        victim = max(rivals, key=Sequence.sort_key)
        if not self._outranks(seq, victim):
            return None
        self._preempt(victim)
        return victim

    def _give_back(self, seq: Sequence, claimed: bool) -> None:
        """`seq` waits on: the cached prefix it claimed this step given back, uncounted (else
        the blocks it holds, as before)."""
        if claimed:
            self.block_manager.give_back_prefix(seq)
        else:
            self.block_manager.free_seq(seq)

    def _could_fit(self, seq: Sequence, num_new: int, reserve: int) -> bool:
        """Whether `seq`'s blocks for `num_new` more tokens fit in its pool, once the running
        sequences of that pool it would preempt (weakest first, while it outranks them) have
        given theirs back: those each holds alone (one shared, with `seq`'s claimed prefix or
        with a sequence left running, is not freed). Blocks two victims share are not counted:
        a lower bound there."""
        bm = self.block_manager
        if bm.can_allocate(seq, num_new, reserve=reserve):
            return True
        pool = bm.pools[seq.pool] if bm.num_pools > 1 else bm
        freed = 0
        for rival in sorted((s for s in self.running if s.pool == seq.pool),
                            key=Sequence.sort_key, reverse=True):
            if not self._outranks(seq, rival):
                break
            # (a block it shares, with `seq`'s claimed prefix or another sequence, stays held)
            freed += sum(1 for b in rival.block_table if pool.blocks[b].ref_count == 1)
        return pool.blocks_needed(seq, num_new) + reserve <= pool.num_free_blocks + freed
