"""Multi-LoRA forward passes vs transformers + peft on tiny random models (fp32, CPU): each row of
a pass that mixes adapters (and the base model) matches ``PeftModel`` with that adapter active,
unmerged and merged, to max abs logit diff <= 1e-4; bad adapters are refused with the reason."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from server.cache.kv_pool import TokenKVPool
from server.cache.req_table import ReqToTokenTable
from server.model.forward_batch import ForwardBatch, ForwardMode
from server.model.loader import load_model
from server.model.lora_files import LoraError
from server.model.lora_registry import LoraRegistry
from server.model.runner import ModelRunner
from tests.helpers import LORA_TARGETS as ALL
from tests.helpers import hf_logits, make_adapter

peft = pytest.importorskip("peft")
TOL = 1e-4
PHI3 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
# (rank, alpha, target modules, rsLoRA) of the adapters a test mixes
ADAPTERS = [(4, 8, ALL, False), (8, 16, ["q_proj", "v_proj"], False),
            (2, 4, ["o_proj", "gate_proj", "down_proj"], True), (8, 4, ["k_proj", "up_proj"], False)]


class LoraHarness:
    """A runner with LoRA slots over ``path``; ``extend`` runs one pass of several sequences,
    each with its adapter slot."""

    def __init__(self, path: str, slots: int = 4, max_rank: int = 8,
                 dtype: torch.dtype = torch.float32):
        loaded = load_model(path)
        a = loaded.arch
        self.pool = TokenKVPool(4096, a.num_layers, a.num_kv_heads, a.head_dim, dtype=dtype)
        self.table = ReqToTokenTable(16, 512)
        self.runner = ModelRunner(loaded, self.pool, dtype=dtype, max_positions=512,
                                  lora_slots=slots, max_lora_rank=max_rank)
        self.registry = LoraRegistry(self.runner.lora, self.runner.model)

    def extend(self, seqs: list[tuple[list[int], int]]) -> list[torch.Tensor]:
        """seqs: (token ids, slot) of new sequences -> each one's logits [n, vocab]."""
        ids, locs, rows, ext = [], [], [], []
        for toks, _ in seqs:
            row, slots = self.table.alloc_row(), self.pool.alloc(len(toks))
            self.table.write(row, 0, slots)
            ids += toks
            locs.append(slots)
            rows.append(row)
            ext.append(len(toks))
        pos = [p for n in ext for p in range(n)]
        batch = ForwardBatch(ForwardMode.EXTEND, [str(i) for i in range(len(seqs))],
                             torch.tensor(ids), torch.tensor(pos), torch.cat(locs), rows,
                             [0] * len(seqs), ext, torch.arange(len(ids)), self.table.table,
                             lora_slots=[s for _, s in seqs])
        return list(self.runner.forward(batch).logits.split(ext))


def _seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3", "gemma2"])
@pytest.mark.parametrize("mixed", [1, 2, 4])
@pytest.mark.parametrize("lengths", [[5, 17, 9, 30, 1, 12], [5, 3, 9, 1, 7, 2]],
                         ids=["masked", "short"])
def test_mixed_adapters_match_peft(make_tiny_model, tmp_path, kind, mixed, lengths):
    """``mixed`` adapters and the base model in one pass: every row matches peft with its own
    adapter (unmerged and merged) and the base rows match transformers. A pass of up to
    SGMV_MAX_ROWS rows ("short") runs the per-row kernel where it is built, a longer one the
    masked matmuls."""
    path, hf = make_tiny_model(kind)
    h = LoraHarness(path)
    peft_models = []
    for i, spec in enumerate(ADAPTERS[:mixed]):
        # Phi-3's checkpoints hold q/k/v and gate/up fused: peft targets those
        targets = spec[2] if kind != "phi3" else PHI3
        out = str(tmp_path / f"a{i}")
        peft_models.append(make_adapter(hf, out, spec[0], spec[1], targets, spec[3], seed=i))
        assert h.registry.load(f"a{i}", out).slot == i
    seqs = _seqs(lengths)
    slots = [i % (mixed + 1) - 1 for i in range(len(seqs))]  # -1: the base model
    outs = h.extend(list(zip(seqs, slots)))
    merged = {}
    for seq, slot, out in zip(seqs, slots, outs):
        if slot < 0:
            ref = hf_logits(hf, seq)
        else:
            ref = hf_logits(peft_models[slot], seq)
            if slot not in merged:
                merged[slot] = copy.deepcopy(peft_models[slot]).merge_and_unload()
            assert (out - hf_logits(merged[slot], seq)).abs().max().item() <= TOL
            assert (ref - hf_logits(hf, seq)).abs().max().item() > 1e-2  # the adapter matters
        assert (out - ref).abs().max().item() <= TOL


def test_bf16_reordered_factors_match_the_plain_matmuls(make_tiny_model, tmp_path):
    """In bf16 on CPU the slots' factors are also kept reordered for oneDNN, used when a pass
    spans at least half of the loaded slots: the logits match the plain path's."""
    path, hf = make_tiny_model("llama")
    h = LoraHarness(path, dtype=torch.bfloat16)
    for i, spec in enumerate(ADAPTERS):
        make_adapter(hf, str(tmp_path / f"a{i}"), spec[0], spec[1], spec[2], spec[3], seed=i)
        h.registry.load(f"a{i}", str(tmp_path / f"a{i}"))
    weights = h.runner.lora
    if not weights.ensure_packed():
        pytest.skip("this torch build cannot reorder bf16 weights for oneDNN")
    seqs = list(zip(_seqs([5, 9, 3, 12]), [0, 1, 2, 3]))
    slots = torch.tensor([s for toks, s in seqs for _ in toks])
    weights.sgmv = False  # the masked matmuls: reordered, then plain
    assert weights.batch(slots).mode == "packed"
    packed = h.extend(seqs)
    weights.packed_slots = 0
    assert weights.batch(slots).mode == "plain"
    plain = h.extend(seqs)
    for a, b in zip(packed, plain):
        assert (a.float() - b.float()).abs().max().item() <= 0.05 * b.float().abs().max().item()


def test_unloaded_slot_is_the_base_model_again(make_tiny_model, tmp_path):
    path, hf = make_tiny_model("llama")
    h = LoraHarness(path)
    make_adapter(hf, str(tmp_path / "a"), 4, 8, ALL, False, seed=0)
    h.registry.load("a", str(tmp_path / "a"))
    with pytest.raises(LoraError, match="in flight"):
        h.registry.unload("a", busy_slots=[0])
    h.registry.unload("a", busy_slots=[])
    seq = _seqs([7])[0]
    # the slot's columns are zero: a row still routed there computes the base model
    assert (h.extend([(seq, 0)])[0] - hf_logits(hf, seq)).abs().max().item() <= TOL
    with pytest.raises(KeyError):
        h.registry.resolve("a")


def test_bad_adapters_are_refused_with_the_reason(make_tiny_model, tmp_path):
    path, hf = make_tiny_model("llama")
    h = LoraHarness(path, slots=1, max_rank=4)
    good = str(tmp_path / "good")
    make_adapter(hf, good, 4, 8, ALL, False, seed=0)
    # another base model's adapter (hidden 96): the shapes say so
    _, other = make_tiny_model("tied")
    make_adapter(other, str(tmp_path / "other"), 4, 8, ALL, False, seed=0)
    with pytest.raises(LoraError, match="another base model"):
        h.registry.load("other", str(tmp_path / "other"))
    make_adapter(hf, str(tmp_path / "big"), 8, 8, ALL, False, seed=0)
    with pytest.raises(LoraError, match="rank 8, above --max-lora-rank 4"):
        h.registry.load("big", str(tmp_path / "big"))
    for key, value, reason in (("use_dora", True, "DoRA"),
                               ("modules_to_save", ["lm_head"], "modules_to_save"),
                               ("peft_type", "IA3", "only LoRA")):
        bad = tmp_path / f"bad-{key}"
        bad.mkdir()
        config = json.loads((tmp_path / "good" / "adapter_config.json").read_text())
        config[key] = value
        (bad / "adapter_config.json").write_text(json.dumps(config))
        os.symlink(tmp_path / "good" / "adapter_model.safetensors",
                   bad / "adapter_model.safetensors")
        with pytest.raises(LoraError, match=reason):
            h.registry.load(key, str(bad))
    with pytest.raises(LoraError, match="no adapter_config.json"):
        h.registry.load("missing", str(tmp_path))
    assert h.registry.names() == []
    h.registry.load("good", good)
    with pytest.raises(LoraError, match="taken"):
        h.registry.load("good", good)
    with pytest.raises(LoraError, match="all 1 LoRA slots are in use"):
        h.registry.load("second", good)
    assert h.registry.names() == ["good"]
