"""Property tests of the scheduler + block manager with no model (the real scheduler code; only the model is faked: engine/trace_replay.py)."""
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember_cupy.config import EngineConfig
from ember_cupy.engine.trace_replay import TraceReplay, TraceRequest
from ember_cupy.engine.sequence import SequenceStatus


def check_invariants(run: TraceReplay, batch) -> None:
    config, bm = run.config, run.block_manager
    assert batch.num_tokens <= config.max_num_batched_tokens
    assert len(batch.scheduled) <= config.max_num_seqs
    assert len(batch.samples) <= config.max_num_seqs            # the logits rows of a step
    assert run.scheduler.num_slots_used() <= config.max_num_seqs   # forks included
    assert len({id(s) for s, _ in batch.scheduled}) == len(batch.scheduled)
    owners = Counter(b for seq in run.live_sequences for b in seq.block_table)
    free = set(bm.free_queue)
    assert not free & set(owners), "a block is both free and owned"
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0), f"refcount of block {block.block_id}"
    assert len(free) + len(owners) == bm.num_blocks
    for seq in run.scheduler.waiting:
        assert not seq.block_table and seq.status is SequenceStatus.WAITING
    for seq in run.scheduler.running:
        assert len(seq.block_table) * config.block_size >= seq.num_computed_tokens
    for block_hash, block_id in bm.cached.items():
        assert bm.blocks[block_id].block_hash == block_hash


requests = st.lists(st.tuples(
    st.integers(0, 30),          # arrival step
    st.integers(1, 70),          # prompt length
    st.integers(1, 20),          # max tokens
    st.integers(0, 3),           # priority
    st.sampled_from([None, 0, 1]),  # shared prefix group
    st.sampled_from([1, 1, 2, 3]),  # n
), min_size=1, max_size=25)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=requests, policy=st.sampled_from(["fcfs", "sjf", "priority"]),
       block_size=st.sampled_from([1, 4, 16]), budget=st.integers(1, 64), max_seqs=st.integers(1, 8),
       spare_blocks=st.integers(0, 12), prefix_caching=st.booleans(),
       aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 24)), max_size=5))
def test_random_workloads_keep_every_invariant(trace, policy, block_size, budget, max_seqs,
                                              spare_blocks, prefix_caching, aborts):
    trace = [TraceRequest(f"r{i}", a, p, m, prio, group, prefix_len=40, n=min(n, max_seqs))
             for i, (a, p, m, prio, group, n) in enumerate(trace)]
    longest = max(r.prompt_len + r.max_tokens for r in trace)
    num_blocks = -(-longest // block_size) + spare_blocks   # every request fits alone
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, block_size=block_size,
                          policy=policy, enable_prefix_caching=prefix_caching, sjf_aging_steps=20)
    run = TraceReplay(config, num_blocks)
    pending = sorted(trace, key=lambda r: r.arrival_step)
    abort_at = {step: f"r{index}" for step, index in aborts}
    while pending or run.scheduler.has_work():
        step = run.scheduler.step_count
        while pending and pending[0].arrival_step <= step:
            run.add(pending.pop(0))
        if step in abort_at:
            run.abort(abort_at[step])
        check_invariants(run, run.step())
        assert run.scheduler.step_count < 5000, "no progress: a request is stuck"
    aborted = {r for r in abort_at.values() if run.timelines.get(r) and run.timelines[r].finish_reason == "abort"}
    for request_id, timeline in run.timelines.items():
        assert timeline.finish_reason == ("abort" if request_id in aborted else "length")
    assert run.block_manager.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in run.block_manager.blocks)


def test_sjf_serves_short_jobs_first():
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, policy="sjf", block_size=4)
    trace = [TraceRequest("long", 0, 100, 50), TraceRequest("short", 0, 10, 5)]
    timelines = TraceReplay(config, 64).run(trace)
    assert timelines["short"].finished_step < timelines["long"].first_scheduled_step


def test_sjf_aging_bounds_the_wait_of_a_long_job():
    """A stream of short jobs never starves a long one: it waits at most aging + one job."""
    aging = 30
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, policy="sjf",
                          block_size=4, sjf_aging_steps=aging)
    trace = [TraceRequest("long", 0, 60, 10)] + [TraceRequest(f"s{i}", i, 4, 3) for i in range(300)]
    timelines = TraceReplay(config, 64).run(trace)
    assert timelines["long"].first_scheduled_step <= aging + 5
    starved = TraceReplay(EngineConfig(**{**config.__dict__, "sjf_aging_steps": 10_000}), 64).run(trace)
    assert starved["long"].first_scheduled_step > 200  # without aging it would wait for the stream


def test_priority_policy_orders_by_priority_then_arrival():
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, policy="priority", block_size=4)
    trace = [TraceRequest("low", 0, 8, 2, priority=5), TraceRequest("high", 0, 8, 2, priority=0),
             TraceRequest("high-later", 0, 8, 2, priority=0)]
    timelines = TraceReplay(config, 64).run(trace)
    order = sorted(timelines, key=lambda r: timelines[r].first_scheduled_step)
    assert order == ["high", "high-later", "low"]


def test_chunked_prefill_splits_a_long_prompt_and_mixes_decodes():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4)
    run = TraceReplay(config, 64)
    run.add(TraceRequest("short", 0, 3, 20))
    run.step()                                  # prefill of "short"
    run.add(TraceRequest("long", 1, 50, 2))
    chunks = []
    for _ in range(4):
        batch = run.step()
        chunks.append({s.request_id: n for s, n in batch.scheduled})
    assert all(c["short"] == 1 for c in chunks)             # the decode runs every step
    assert [c.get("long") for c in chunks] == [15, 15, 15, 5]  # the prompt fills what is left


def test_preemption_happens_and_everything_still_finishes():
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=4)
    trace = [TraceRequest(f"r{i}", 0, 10, 30) for i in range(6)]
    run = TraceReplay(config, 30)   # 6 x 40 tokens need 60 blocks; only 30 exist
    timelines = run.run(trace)
    assert sum(b.preempted != [] for b in run.batches) > 0
    assert sum(t.num_preemptions for t in timelines.values()) > 0
    assert all(t.finish_reason == "length" for t in timelines.values())


def test_prefix_cache_hits_on_a_shared_prefix():
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, block_size=4)
    trace = [TraceRequest(f"r{i}", 0, 30, 2, prefix_id=7, prefix_len=20) for i in range(3)]
    run = TraceReplay(config, 64)
    timelines = run.run(trace)
    assert timelines["r0"].num_cached_tokens == 0
    assert timelines["r1"].num_cached_tokens == timelines["r2"].num_cached_tokens == 20
    stats = run.block_manager.prefix_stats
    assert stats.hits == 40 and stats.queries == 90


def test_same_trace_same_schedule():
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=20, block_size=4, policy="sjf")
    trace = [TraceRequest(f"r{i}", i % 4, 5 + 7 * i % 30, 1 + i % 9) for i in range(15)]
    schedules = []
    for _ in range(2):
        run = TraceReplay(config, 40)
        run.run(trace)
        schedules.append([[(s.request_id, n) for s, n in b.scheduled] for b in run.batches])
    assert schedules[0] == schedules[1]


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    from ember_cupy.engine.block_manager import BlockManager
    from ember_cupy.engine.sequence import Sequence
    from ember_cupy.sampling_params import SamplingParams

    bm = BlockManager(num_blocks=8, block_size=4)
    parent = Sequence("r", list(range(6)), SamplingParams(), 4)   # 1 full block + 2 tokens
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = Sequence("r", list(range(6)), SamplingParams(), 4, index=1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    for seq in (parent, child):
        seq.token_ids.append(99 + seq.index)
    copies = bm.allocate(child, 1)                 # appends into the shared partial block
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert bm.allocate(parent, 1) == []            # now the parent owns its block alone
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_n_forks_share_the_prompt_and_each_generates_max_tokens():
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=512, block_size=4)
    run = TraceReplay(config, 64)
    run.add(TraceRequest("r", 0, 10, 5, n=3))
    batch = run.step()                              # the whole prompt: the parent forks
    seqs = run.live_sequences
    assert [s.index for s in seqs] == [0, 1, 2] and [s for s, _ in batch.scheduled] == seqs[:1]
    assert [source for _, source in batch.samples] == [seqs[0]] * 3
    assert seqs[1].block_table == seqs[2].block_table == seqs[0].block_table
    assert [run.block_manager.blocks[b].ref_count for b in seqs[0].block_table] == [3, 3, 3]
    run.run([])
    assert [s.num_output_tokens for s in seqs] == [5, 5, 5]
    assert len({tuple(s.output_token_ids) for s in seqs}) == 3   # each its own tokens
    assert run.block_manager.num_free_blocks == 64


def test_a_request_waits_for_a_slot_for_each_of_its_sequences():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, block_size=4)
    run = TraceReplay(config, 64)
    run.add(TraceRequest("a", 0, 6, 8, n=3))
    run.add(TraceRequest("b", 0, 6, 8, n=2))
    timelines = run.run([])
    assert timelines["b"].first_scheduled_step > timelines["a"].finished_step - 1
    assert max(len(b.samples) for b in run.batches) == 3


def test_stop_tokens_end_sequences_in_the_scheduler():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, block_size=4)
    run = TraceReplay(config, 64, vocab_size=4, eos_token_ids=(0,))
    timelines = run.run([TraceRequest(f"r{i}", 0, 5, 50) for i in range(4)])
    assert {t.finish_reason for t in timelines.values()} == {"stop"}
    assert run.block_manager.num_free_blocks == 64


def test_a_fork_gets_its_own_copy_of_the_constraint_state():
    class Constraint:   # what the scheduler asks of a constraint state: fork(), accept(), is_finished, failed
        is_finished = False
        failed = False

        def __init__(self, consumed):
            self.consumed = consumed

        def fork(self):
            return Constraint(list(self.consumed))

        def accept(self, token_id):   # the state at the prompt's end is what this test compares
            return True

    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=512, block_size=4)
    run = TraceReplay(config, 64)
    run.add(TraceRequest("r", 0, 10, 5, n=3))
    parent = run.scheduler.waiting[0]
    parent.constraint = Constraint(["state at the prompt's end"])
    run.step()
    children = run.live_sequences[1:]
    assert [c.index for c in children] == [1, 2]
    states = [parent.constraint] + [c.constraint for c in children]
    assert len({id(s) for s in states}) == 3 and all(s.consumed == parent.constraint.consumed for s in states)
    assert all(s.consumed is not parent.constraint.consumed for s in states[1:])
    unconstrained = TraceReplay(config, 64)
    unconstrained.add(TraceRequest("u", 0, 10, 5, n=2))
    unconstrained.step()
    assert [s.constraint for s in unconstrained.live_sequences] == [None, None]
