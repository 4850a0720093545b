"""The prefetch level's override (``SGL_CPU_PREFETCH``, kernels/cpu/csrc/prefetch.h): the
kernels that stream K/V rows and weight blocks from DRAM prefetch them into L1 or L2, chosen
once a process from the CPU family. A hint never changes a result: each level runs here, on any
machine, in its own process, and gives the same bits; any other value is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import cpu as native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"sgl_cpu kernels: {native.unavailable_reason()}")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every kernel that prefetches, as the machine runs it, on inputs long enough to: decode steps
# over 1,100-1,500 cached positions (rows 32 positions ahead are prefetched) and a verify pass
# on each attention kernel, and the VNNI int4 (plain and gate/up + SiLU) and int8 linears on
# decode-sized and prefill-sized batches (weight blocks prefetched ahead).
_SCRIPT = r"""
import sys, torch
from kernels import cpu as native
from server.model.quantization import quantize_int4, quantize_int8
torch.manual_seed(0)
out = {}
cap, hkv, d = 4600, 3, 64
table = (torch.randperm(cap - 1) + 1)[:3 * 1500].view(3, 1500)  # shuffled slots; 0 unused
rows, prefix, ext = torch.tensor([0, 1, 2]), torch.tensor([1100, 1300, 1490]), torch.tensor([1, 1, 8])
for kernel in native.ATTENTION_KERNELS:
    try:
        op = native.attention_op(kernel)
    except RuntimeError:  # this machine cannot run it
        continue
    for dt in (torch.float32, torch.bfloat16):
        k, v = torch.randn(cap, hkv, d).to(dt), torch.randn(cap, hkv, d).to(dt)
        q = torch.randn(int(ext.sum()), 9, d).to(dt)
        out[f"attention/{kernel}/{dt}"] = op(q, k, v, table, rows, prefix, ext, 0.125, 0, 0.0)
if native.available("avx512_vnni"):
    qw = quantize_int4(torch.randn(1536, 576))
    packed = native.vnni_pack_int4(qw.q, qw.scale, qw.zero)
    for m in (1, 16, 200):
        x = torch.randn(m, 576).to(torch.bfloat16)
        out[f"int4/vnni/{m}"] = native.vnni_int4_linear(x, packed, 1536)
        out[f"int4_silu/vnni/{m}"] = native.vnni_int4_linear_silu(x, packed, 1536)
    q8 = quantize_int8(torch.randn(1024, 576))
    packed8, scale8 = native.vnni_pack_int8(q8.q), q8.scale.float().contiguous()
    for m in (1, 16):
        out[f"int8/vnni/{m}"] = native.vnni_int8_linear(torch.randn(m, 576), packed8, scale8)
torch.save(out, sys.argv[1])
"""


def _run(level: str, path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SGL_CPU_PREFETCH": level}
    return subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_each_prefetch_level_gives_the_same_bits(tmp_path):
    outs = []
    for level in ("l1", "l2"):
        path = tmp_path / f"{level}.pt"
        proc = _run(level, path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(torch.load(path))
    assert outs[0].keys() == outs[1].keys()
    assert any(name.startswith("attention/") for name in outs[0])
    assert any(name.startswith("int4/") for name in outs[0]) == native.available("avx512_vnni")
    for name, got in outs[0].items():
        assert torch.equal(got, outs[1][name]), name


def test_an_unknown_prefetch_level_is_an_error(tmp_path):
    proc = _run("l3", tmp_path / "never.pt")
    assert proc.returncode != 0
    assert "SGL_CPU_PREFETCH must be l1 or l2, got 'l3'" in proc.stderr
    assert not (tmp_path / "never.pt").exists()
