"""IPC messages: msgpack round trips, and garbage or foreign-version frames rejected (never
unpickled)."""

import pickle

import msgspec
import pytest

from server import protocol as P
from server.sampling_params import SamplingParams


@pytest.mark.parametrize("msg", [
    P.GenerateReq("r1", [1, 2, 3], SamplingParams(max_new_tokens=4, stop=["x"]), True, 0, 2,
                  "salt"),
    P.GenerateReq("r2", [1], SamplingParams(temperature=0.5, logit_bias={"7": -1.5}, seed=3,
                                            stop_regex="a+", json_schema={"type": "integer"})),
    P.AbortReq("r1"), P.FlushCacheReq(), P.ServerInfoReq(),
    P.Ready("m", 100, 512, 4096, "float32", "bfloat16"),
    P.BatchOutput([P.ReqOutput("r1", [5], "hi", {"type": "stop", "matched": 2}, 3, 1, 0,
                               [(-0.5, 5)], [[(-0.5, 5), (-1.0, 6)]], [(None, 1), (-2.0, 2)])]),
    P.ReqError("r1", "bad", "temperature", 400), P.FlushCacheReply(True),
    P.ServerInfoReply({"kv_usage": 0.5}, 0),
])
def test_round_trip(msg):
    assert P.decode(P.encode(msg)) == msg


@pytest.mark.parametrize("frame", [
    b"", b"\x00\x01garbage", pickle.dumps({"rid": "x"}),
    msgspec.msgpack.encode({"v": 1, "msg": {"type": "Nope"}}),
    msgspec.msgpack.encode({"v": 99, "msg": {"type": "AbortReq", "rid": "x"}}),
])
def test_garbage_and_foreign_frames_are_rejected(frame):
    with pytest.raises(P.ProtocolError):
        P.decode(frame)


def test_a_request_whose_sampling_parameters_are_invalid_is_not_a_message():
    """SamplingParams checks itself when a frame is decoded too: a hand-made frame with a
    negative temperature never reaches the scheduler as a request."""
    frame = msgspec.msgpack.encode({"v": P.PROTOCOL_VERSION, "msg": {
        "type": "GenerateReq", "rid": "x", "input_ids": [1],
        "sampling": {"temperature": -1.0}}})
    with pytest.raises(P.ProtocolError, match="temperature"):
        P.decode(frame)
    assert P.refused_request_id(frame) == "x"  # so the scheduler can still answer it


@pytest.mark.parametrize("frame", [b"", b"\x00\x01garbage", msgspec.msgpack.encode([1, 2]),
                                   P.encode(P.AbortReq("r1")),
                                   msgspec.msgpack.encode({"msg": {"type": "GenerateReq",
                                                                   "rid": 5}})])
def test_only_a_request_frame_with_a_string_rid_has_a_refused_request_id(frame):
    assert P.refused_request_id(frame) is None


def test_stream_outputs_coalesce_until_an_error_or_the_finish():
    import collections

    from server.http.outputs import coalesce

    def out(ids, text, finish=None, lps=()):
        return P.ReqOutput("r", ids, text, finish, completion_tokens=len(text),
                           output_token_logprobs=list(lps))

    pending = collections.deque([out([1], "a", lps=[(-0.1, 1)]), out([2, 3], "abc",
                                                                       lps=[(-0.2, 2), (-0.3, 3)]),
                                 P.ReqError("r", "boom"), out([4], "abcd", {"type": "stop"})])
    first = coalesce(pending)
    assert (first.new_token_ids, first.text, first.completion_tokens) == ([1, 2, 3], "abc", 3)
    assert first.output_token_logprobs == [(-0.1, 1), (-0.2, 2), (-0.3, 3)]
    assert isinstance(coalesce(pending), P.ReqError)  # never merged away
    last = coalesce(pending)
    assert last.finish_reason == {"type": "stop"} and not pending
    pending = collections.deque([out([5], "x", {"type": "length"}), out([6], "xy")])
    assert coalesce(pending).new_token_ids == [5] and len(pending) == 1  # nothing after a finish
