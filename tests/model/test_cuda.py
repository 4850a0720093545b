"""The engine on a CUDA GPU: Triton and FlashInfer backends against the reference backend,
decode through captured CUDA graphs against eager decode, bf16 logits against transformers,
and sampling on the device with one device-to-host copy per step. Skipped without a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from server.engine import Engine

pytestmark = pytest.mark.gpu

# 5 and 3 requests: padded to the 8 and 4 buckets; shared and unshared prefixes.
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33] * 3 + [40 + i] * (1 + 3 * i) for i in range(4)]
PROMPTS.append([7, 11])
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def _engine(path: str, dtype: str, backend: str, graphs: bool) -> Engine:
    return Engine(path, dtype=dtype, device="cuda", attention_backend=backend,
                  disable_cuda_graph=not graphs, max_total_tokens=4096, context_length=256,
                  max_running_requests=16)


def _greedy(engine: Engine, prompts=PROMPTS) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


def _prompt_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=0)
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])


def test_triton_eager_and_graphs_match_the_reference_fp32(make_tiny_model):
    path, _ = make_tiny_model("tied")  # 6 query heads over 2 KV heads, as SmolLM2
    ref = _greedy(_engine(path, "float32", "reference", graphs=False))
    eager = _engine(path, "float32", "triton", graphs=False)
    graphs = _engine(path, "float32", "triton", graphs=True)
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    assert _greedy(eager) == ref
    assert _greedy(graphs) == ref
    assert _greedy(graphs, PROMPTS[:3]) == ref[:3]  # another bucket (4)


def test_flashinfer_graphs_match_eager_and_track_the_reference(make_tiny_model):
    """FlashInfer runs fp16/bf16 and head_dim 64/128/256 only: a head_dim-64 model in bf16."""
    pytest.importorskip("flashinfer")
    path, _ = make_tiny_model("llama", hidden_size=256, head_dim=64, intermediate_size=512)
    eager = _greedy(_engine(path, "bfloat16", "flashinfer", graphs=False))
    graphs_engine = _engine(path, "bfloat16", "flashinfer", graphs=True)
    assert graphs_engine.runner.graphs is not None
    assert _greedy(graphs_engine) == eager
    ids = PROMPTS[3]
    ref = _prompt_logprobs(_engine(path, "bfloat16", "reference", graphs=False), ids)
    got = _prompt_logprobs(graphs_engine, ids)
    assert (got - ref).abs().mean() < 0.02 * ref.abs().mean()


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_bf16_logits_track_transformers(make_tiny_model, backend):
    """Prompt logprobs in bf16 on the GPU vs transformers in fp32 (same weights): within 2% of
    their spread on average (bf16 carries ~3 significant digits)."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    path, hf = make_tiny_model("llama", hidden_size=256, head_dim=64, intermediate_size=512)
    ids = [5, 9, 13, 17, 21, 25, 29, 33] * 4
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = _prompt_logprobs(_engine(path, "bfloat16", backend, graphs=True), ids)
    assert (got - ref).abs().mean() < 0.02 * ref.abs().mean()


def test_decode_step_syncs_with_the_host_once(make_tiny_model):
    """A whole decode step (scheduling, graph replay, sampling on the device): the only
    synchronizing call is the copy of the sampled ids to the host (torch's sync debug mode warns
    on every synchronizing call it detects)."""
    path, _ = make_tiny_model("tied")
    engine = _engine(path, "float32", "triton", graphs=True)
    sched = engine.scheduler
    for p in PROMPTS[:3]:
        sched.add_request(engine.make_request(p, _params()))
    batch = sched.step()  # the prefill
    sched.update(batch, engine.runner.forward(batch))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:  # scheduling (slot allocation, request-table writes), the replay, sampling
            batch = sched.step()
            sched.update(batch, engine.runner.forward(batch))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert batch.mode.value == "decode"
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def _params():
    from server.model.sampling import SamplingParams

    return SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.9, seed=3,
                          ignore_eos=True)


def test_seeded_sampling_is_the_same_on_the_gpu_as_on_the_cpu(make_tiny_model):
    """Draws take one host-side uniform per row, so a seeded request samples the same tokens
    on either device (fp32, where logits agree to ~1e-6)."""
    path, _ = make_tiny_model("tied")
    sp = {"max_new_tokens": 6, "temperature": 0.7, "seed": 7, "ignore_eos": True}
    gpu = _engine(path, "float32", "triton", graphs=True)
    cpu = Engine(path, dtype="float32", device="cpu", max_total_tokens=4096, context_length=256)
    assert (gpu.generate(input_ids=PROMPTS[0], sampling_params=sp)["output_ids"]
            == cpu.generate(input_ids=PROMPTS[0], sampling_params=sp)["output_ids"])
