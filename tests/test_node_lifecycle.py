"""The decode node's request and the prefill node's job lifecycles (pure state machines, no I/O): every
transition and every refused move, the Progress word each state reports, and the decode request's token
stream (first-message fields, positions, backlog merging). Plus the logprob wire helpers and the prefill
node's KV connector (which transfer it starts, when it hands one over)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from lifecycle_helpers import assert_move

from pdcluster.control.protocol import PROGRESS_STATES, logprob_from_wire, logprob_to_wire
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.decode_node.request import DecodeRequest, RemoteFailure, State
from pdcluster.prefill_node.job import JobState, Outgoing, PrefillJob

# The lifecycles as documented (decode_node/request.py, prefill_node/job.py), written out again here so
# that a change to either table has to change this test too.
DECODE_MOVES = {
    State.NEW: {State.RESERVING, State.ENGINE, State.GONE},
    State.RESERVING: {State.PREFILLING, State.ENGINE, State.RELEASING, State.GONE},
    State.PREFILLING: {State.WAITING_KV, State.RELEASING, State.ABORTING, State.GONE},
    State.WAITING_KV: {State.ENGINE, State.RELEASING, State.ABORTING, State.GONE},
    State.RELEASING: {State.ENGINE, State.ABORTING, State.GONE},
    State.ABORTING: {State.GONE},
    State.ENGINE: {State.FINISHED, State.GONE},
    State.FINISHED: {State.GONE},
    State.GONE: set(),
}
JOB_MOVES = {
    JobState.CONNECTING: {JobState.QUEUED, JobState.DONE},
    JobState.QUEUED: {JobState.SENDING, JobState.DONE},
    JobState.SENDING: {JobState.DONE, JobState.ABANDONED},
    JobState.ABANDONED: {JobState.DONE},
    JobState.DONE: set(),
}


def request(state: State = State.NEW, **kw) -> DecodeRequest:
    req = DecodeRequest(rid="r", owner=b"router", prompt_ids=[1, 2, 3], params=SamplingParams(), deadline=0.0,
                        prefill_node="", **kw)
    req.state = state
    return req


def job(state: JobState = JobState.CONNECTING) -> PrefillJob:
    j = PrefillJob(rid="p", owner=b"decode", prompt_ids=[1, 2, 3], dst=None, skip_blocks=0, deadline=0.0)
    j.state = state
    return j


def test_the_tables_cover_every_state():
    assert set(DECODE_MOVES) == set(State)
    assert set(JOB_MOVES) == set(JobState)


@pytest.mark.parametrize("src, dst", list(itertools.product(State, State)), ids=lambda s: s.value)
def test_decode_request_moves(src: State, dst: State):
    req = request()
    assert_move(req, req.move, src, dst, dst in DECODE_MOVES[src])


@pytest.mark.parametrize("src, dst", list(itertools.product(JobState, JobState)), ids=lambda s: s.value)
def test_prefill_job_moves(src: JobState, dst: JobState):
    j = job()
    assert_move(j, j.move, src, dst, dst in JOB_MOVES[src])


def test_the_decode_paths_walk_through_the_table():
    remote_ok = [State.RESERVING, State.PREFILLING, State.WAITING_KV, State.ENGINE, State.FINISHED, State.GONE]
    fallback = [State.RESERVING, State.PREFILLING, State.RELEASING, State.ENGINE, State.GONE]
    no_blocks = [State.RESERVING, State.ENGINE, State.FINISHED, State.GONE]
    aborted = [State.RESERVING, State.PREFILLING, State.WAITING_KV, State.ABORTING, State.GONE]
    abort_while_releasing = [State.RESERVING, State.PREFILLING, State.RELEASING, State.ABORTING, State.GONE]
    for path in (remote_ok, fallback, no_blocks, aborted, abort_while_releasing, [State.ENGINE, State.GONE]):
        req = request()
        for state in path:
            req.move(state)
        assert req.state is State.GONE


def test_progress_derives_from_the_state_and_is_a_wire_word():
    words = {s: request(s).progress for s in State}
    assert set(words.values()) <= set(PROGRESS_STATES)
    assert words[State.PREFILLING] == "prefilling" and words[State.WAITING_KV] == "waiting_kv"
    assert all(w == "queued" for s, w in words.items() if s not in (State.PREFILLING, State.WAITING_KV))


def test_remote_and_aborted_follow_the_state():
    assert {s for s in State if request(s).remote} == {State.RESERVING, State.PREFILLING, State.WAITING_KV,
                                                        State.RELEASING, State.ABORTING}
    assert request(State.ABORTING).aborted and not request(State.RELEASING).aborted
    assert request(State.GONE, outcome="abort").aborted and not request(State.GONE, outcome="length").aborted


def test_remote_failure_reasons_keep_their_metric_labels():
    # docs/operations.md documents these `remote_prefill_failures_total{reason}` values
    assert {r.value for r in RemoteFailure} == {"unknown_node", "no_blocks", "send_failed", "timeout",
                                                 "prefill_error", "checksum", "transfer", "internal"}
    assert {r for r in RemoteFailure if r.counts_as_transfer_failure} == {RemoteFailure.CHECKSUM,
                                                                          RemoteFailure.TRANSFER}


def test_prefill_job_answered_aborted_and_queued_follow_the_state():
    assert {s for s in JobState if job(s).answered} == {JobState.ABANDONED, JobState.DONE}
    assert {s for s in JobState if job(s).queued} == {JobState.CONNECTING, JobState.QUEUED}
    j = job(JobState.SENDING)
    j.outcome = "aborted"
    assert j.aborted


# ---------------------------------------------------------------------------------------------- token stream

def output(ids: list[int], finished: bool = False, logprobs=None, num_cached_tokens: int = 0):
    return SimpleNamespace(new_token_ids=ids, logprobs=logprobs, finished=finished,
                           finish_reason="length" if finished else None, num_cached_tokens=num_cached_tokens,
                           prompt_logprobs=None)


def test_the_first_tokens_carry_the_prompt_fields_and_positions_count_up():
    req = request(State.ENGINE, prefill_path="remote:p0", num_cached_tokens=16)
    first = req.tokens(output([7], logprobs=[(-0.5, [(7, -0.5), (8, -1.0)])]))
    assert (first.pos, first.num_prompt_tokens, first.num_cached_tokens, first.prefill_path) == (0, 3, 16, "remote:p0")
    assert first.logprobs == [[-0.5, [[7, -0.5], [8, -1.0]]]]
    second = req.tokens(output([8, 9]))
    assert (second.pos, second.num_prompt_tokens, second.prefill_path, second.logprobs) == (1, 0, "", None)
    assert req.state is State.ENGINE and req.sent == 3


def test_the_engine_s_cached_count_is_used_when_the_node_has_none():
    req = request(State.ENGINE)
    assert req.tokens(output([1], num_cached_tokens=32)).num_cached_tokens == 32


def test_held_tokens_are_merged_in_order_and_a_finish_moves_to_finished():
    req = request(State.ENGINE)
    req.hold(req.tokens(output([1], logprobs=[(-0.1, [])])))   # the router could not take it
    merged = req.tokens(output([2, 3]))
    assert merged.ids == [1, 2, 3] and merged.pos == 0 and merged.num_prompt_tokens == 3
    assert merged.logprobs == [[-0.1, []], None, None] and req.backlog is None
    req.hold(merged)
    last = req.tokens(output([4], finished=True))
    assert last.ids == [1, 2, 3, 4] and last.finish == "length"
    assert req.state is State.FINISHED and req.outcome == "length" and req.backlog is None
    req.hold(last)
    req.backlog_delivered(now=5.0)
    assert req.backlog is None and req.last_sent == 5.0


def test_a_remote_first_token_goes_ahead_and_the_engine_s_output_of_it_only_finishes():
    req = request(State.ENGINE, prefill_path="remote:p0", num_cached_tokens=16)
    first = req.first_token_ahead(7, (-0.5, [(7, -0.5)]))
    assert (first.ids, first.pos, first.finish, first.num_prompt_tokens, first.prefill_path) == ([7], 0, None, 3,
                                                                                                  "remote:p0")
    assert first.logprobs == [[-0.5, [[7, -0.5]]]] and req.sent == 1
    with pytest.raises(RuntimeError, match="ahead"):   # only once, only first
        req.first_token_ahead(7, None)
    landed = req.tokens(output([7], logprobs=[(-0.5, [(7, -0.5)])]))   # the engine's output for the same token
    assert (landed.ids, landed.logprobs, landed.pos, landed.num_prompt_tokens) == ([], [], 1, 0)
    second = req.tokens(output([8]))
    assert (second.ids, second.pos) == ([8], 1) and req.sent == 2


def test_a_first_token_ahead_that_finishes_the_request_is_followed_by_the_finish_alone():
    req = request(State.ENGINE)
    req.first_token_ahead(7, None)
    last = req.tokens(output([7], finished=True))   # max_tokens 1, or a stop token
    assert (last.ids, last.finish, last.pos) == ([], "length", 1)
    assert req.state is State.FINISHED and req.sent == 1


def test_tokens_of_a_request_the_engine_does_not_own_are_refused():
    for state, finished in itertools.product(set(State) - {State.ENGINE}, (False, True)):
        req = request(state)
        with pytest.raises(RuntimeError, match="the engine does not own it"):
            req.tokens(output([1], finished=finished))
        assert req.sent == 0 and req.state is state


# ---------------------------------------------------------------------------------------------- wire helpers

def test_logprobs_round_trip_through_the_wire_shape():
    lp = (-0.25, [(5, -0.25), (9, -2.0)])
    wire = logprob_to_wire(lp)
    assert wire == [-0.25, [[5, -0.25], [9, -2.0]]]
    assert logprob_from_wire(wire) == lp
    assert logprob_to_wire(None) is None and logprob_from_wire(None) is None
    assert logprob_from_wire([-1, []]) == (-1.0, [])


@pytest.mark.parametrize("bad", [[], [0.1], [0.1, 5], [0.1, [[1]]], ["x", []], [0.1, [["a", 0.1]]], "ab", 3,
                                 [0.1, [], 1]])
def test_malformed_wire_logprobs_raise_value_or_type_error(bad):
    with pytest.raises((ValueError, TypeError)):
        logprob_from_wire(bad)


# ---------------------------------------------------------------------------------------------- prefill connector

class FakeTransfer:
    backend = "fake"
    failed = False

    def __init__(self) -> None:
        self.layers: list[tuple[int, int]] = []
        self.sent_all = False
        self.aborted: str | None = None

    def send_layers(self, l0: int, l1: int) -> None:
        self.layers.append((l0, l1))

    def send_all(self) -> None:
        self.sent_all = True

    def abort(self, reason: str) -> None:
        self.aborted = reason


class FakeSender:
    layout = SimpleNamespace(block_bytes=100, rank_slices=1)

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.started: list[list[int]] = []

    def start(self, dst, src, connect=True):
        assert connect is False   # the engine thread never connects
        if self.fail:
            raise ConnectionError("gone")
        self.started.append(src)
        return FakeTransfer()


def connector(layerwise: bool, sender: FakeSender):
    from pdcluster.engine.kv_connector import PromptInStep
    from pdcluster.prefill_node.connector import TransferConnector

    handed: list[Outgoing] = []
    c = TransferConnector(layerwise, handed.append)
    c.sender = sender
    c.add(Outgoing("a", dst=SimpleNamespace(address="d:1"), first_block=1, num_blocks=3))
    return c, handed, PromptInStep


def test_the_connector_streams_layer_by_layer_and_hands_the_transfer_over_once():
    sender = FakeSender()
    c, handed, PromptInStep = connector(True, sender)
    c.on_step_start([PromptInStep("a", [10, 11, 12, 13], 40), PromptInStep("other", [1], 3)])
    c.on_layer_done(0)
    c.on_layer_done(1)
    c.on_prompt_done("a", [10, 11, 12, 13])
    c.on_prompt_done("other", [1])   # not a prompt this node sends: nothing
    (out,) = handed
    assert sender.started == [[11, 12]] and out.nbytes == 200   # the decode node holds block 0 already
    assert out.transfer.layers == [(0, 1), (1, 2)] and not out.transfer.sent_all
    assert not c.outgoing   # the loop's now: the engine thread no longer sees it
    c.abort("a", "late")   # an abort after the handover is the loop's to deliver
    assert out.transfer.aborted is None


def test_the_connector_sends_all_at_once_when_not_layerwise_and_reports_a_failed_start():
    sender = FakeSender()
    c, handed, PromptInStep = connector(False, sender)
    c.on_step_start([PromptInStep("a", [10, 11, 12], 40)])
    c.on_layer_done(0)
    c.on_prompt_done("a", [10, 11, 12])
    assert handed[0].transfer.sent_all and handed[0].transfer.layers == []

    c, handed, PromptInStep = connector(True, FakeSender(fail=True))
    c.on_step_start([PromptInStep("a", [10, 11, 12], 40)])
    c.on_prompt_done("a", [10, 11, 12])
    assert handed[0].transfer is None and "failed to start: gone" in handed[0].error


def test_the_connector_aborts_a_transfer_whose_prompt_is_still_in_the_engine():
    c, handed, PromptInStep = connector(True, FakeSender())
    c.on_step_start([PromptInStep("a", [10, 11, 12], 40)])
    transfer = c.outgoing["a"].transfer
    c.abort("a", "aborted by the decode node")
    assert transfer.aborted == "aborted by the decode node" and not c.outgoing
    c.on_prompt_done("a", [10, 11, 12])
    assert handed == []
