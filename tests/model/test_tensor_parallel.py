"""Tensor parallelism on CPU with gloo (real torch.distributed, one process per rank): how
heads are planned over ranks, TP=2 against TP=1 in fp32 (greedy tokens identical, logprobs
within 1e-4) for a tiny GQA model whose 3 KV heads do not divide over 2 ranks, an MQA model
whose one KV head is replicated, and the default model; two "nodes" on loopback; and a rank
that dies under a live server."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from server.config import ConfigError, EngineConfig
from server.engine import Engine
from server.model.config import ArchConfig, UnsupportedModelError
from server.model.parallel import TPShard
from server.model.tp_group import free_init_addr
from tests.live_server import REPO_ROOT

SP = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33] * 3 + [40 + i] * (1 + 2 * i) for i in range(3)] + [[7]]


def _arch(heads, kv, **kw):
    return ArchConfig(model_type="llama", vocab_size=101, hidden_size=heads * 8,
                      intermediate_size=30, num_layers=1, num_heads=heads, num_kv_heads=kv,
                      head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=64, **kw)


def test_heads_are_planned_in_whole_groups_or_replicated():
    smol = [TPShard.plan(_arch(9, 3), r, 2) for r in range(2)]  # SmolLM2: 3 groups of 3
    assert [(s.q_heads, s.kv_heads) for s in smol] == [(range(0, 6), range(0, 2)),
                                                        (range(6, 9), range(2, 3))]
    assert [s.inter for s in smol] == [range(0, 15), range(15, 30)]
    assert [s.vocab for s in smol] == [range(0, 51), range(51, 102)]  # padded to 2 x 51
    mqa = [TPShard.plan(_arch(4, 1), r, 2) for r in range(2)]  # one KV head, replicated
    assert [(s.q_heads, s.kv_heads) for s in mqa] == [(range(0, 2), range(0, 1)),
                                                       (range(2, 4), range(0, 1))]
    with pytest.raises(UnsupportedModelError, match="cannot be split"):
        TPShard.plan(_arch(6, 2), 0, 4)  # 2 ranks per KV head, 3 query heads each
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        TPShard.plan(_arch(4, 2, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=8, sparse_layers=(0,)), 0, 2)
    with pytest.raises(ConfigError, match="dist_init_addr"):
        EngineConfig.from_kwargs(tp_size=2, nnodes=2)
    with pytest.raises(ConfigError, match="quantization"):
        from server.resolve import resolve

        resolve(EngineConfig.from_kwargs(tp_size=2, quantization="int4"),
                kv_elements_per_token=8, model_context_length=64, available_bytes=1 << 30)


def _run(path, **kw):
    eng = Engine(path, dtype="float32", context_length=256, max_total_tokens=2048, **kw)
    try:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=SP, return_logprob=True)
        return ([o["output_ids"] for o in outs],
                [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs])
    finally:
        eng.close()


def _same(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        assert max(abs(p - q) for p, q in zip(x, y)) <= 1e-4


@pytest.mark.parametrize("kind, overrides", [("tied", {"num_key_value_heads": 3}),
                                             ("gemma", {})])
def test_tp2_matches_tp1(make_tiny_model, kind, overrides):
    """tied with 3 KV heads: groups split 2 + 1; gemma: MQA, the KV head replicated (and
    GeGLU, scaled embeddings, tied vocab-parallel embedding and lm_head)."""
    path, _ = make_tiny_model(kind, **overrides)
    _same(_run(path, tp_size=2), _run(path))


@pytest.mark.default_model
def test_default_model_tp2_matches_tp1():
    from server.model.loader import default_model_path

    try:
        path = default_model_path()
    except Exception:  # noqa: BLE001
        pytest.skip("the default model is not installed")
    want = _run(path, quantization="none")
    _same(_run(path, tp_size=2), want)


def test_two_nodes_on_loopback(make_tiny_model):
    """Node 1 is its own `python -m server --node-rank 1` process (compute only); node 0's
    engine holds rank 0 and the scheduler; they meet at a TCP rendezvous on 127.0.0.1."""
    path, _ = make_tiny_model("tied", num_key_value_heads=3)
    addr = free_init_addr()
    node1 = subprocess.Popen(
        [sys.executable, "-m", "server", "--model", path, "--tp-size", "2", "--nnodes", "2",
         "--node-rank", "1", "--dist-init-addr", addr, "--log-level", "warning"],
        cwd=REPO_ROOT)
    try:
        got = _run(path, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
        assert node1.wait(60) == 0  # node 0's close() told its rank to stop
    finally:
        node1.kill()
    _same(got, _run(path))


def test_a_dead_rank_stops_the_server_cleanly(make_tiny_model):
    from tests.live_server import ServerProcess

    path, _ = make_tiny_model("tied", num_key_value_heads=3)
    s = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "1024",
                      "--context-length", "256", "--tp-size", "2")
    try:
        with s.client() as c:
            assert c.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params":
                                             {"max_new_tokens": 4}}).is_success
        out = subprocess.run(["pgrep", "-f", "-P", str(s.scheduler_pid()), "spawn_main"],
                             capture_output=True, text=True).stdout.split()
        assert out, "no rank-1 process"
        subprocess.run(["kill", "-9", *out])
        deadline = time.monotonic() + 60
        while s.proc.poll() is None:
            assert time.monotonic() < deadline, "the server did not stop"
            time.sleep(0.1)
        assert s.proc.returncode != 0
        assert any("tensor-parallel rank process" in line for line in s.log)
    finally:
        s.stop(signal.SIGKILL)
