"""jetserve_kernels/bench.py's cases run end to end (tiny shapes, CPU interpreter, no timing), so
the GPU benchmark does not meet its first bug on the GPU."""

import pytest
import torch

from jetserve_kernels import bench


def test_every_case_runs_and_reports_its_figures(monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    for name, value in dict(HEADS=4, KV_HEADS=2, HEAD_DIM=16, BLOCK=16, HIDDEN=64,
                            INTERMEDIATE=32, TOKENS=32, DTYPE=torch.float32).items():
        monkeypatch.setattr(bench, name, value)
    calls = []

    def once(fn, graph=False):
        calls.append(fn())
        return 2.0  # ms

    monkeypatch.setattr(bench, "bench_ms", once)
    decode = bench.decode_case(batch=3, context=64, bandwidth=1e9)
    assert decode["speedup"] == 1.0 and decode["fraction_of_copy_bandwidth"] > 0
    torch.testing.assert_close(calls[0], calls[1][:, :, 0])  # triton vs gathered K/V SDPA
    prefill = bench.prefill_case(chunk=32)
    torch.testing.assert_close(calls[2], calls[3][0].transpose(0, 1))  # triton vs masked SDPA
    assert prefill["context"] == 64 and prefill["triton_tflops"] > 0
    small = bench.small_kernel_cases()
    assert [r["kernel"] for r in small] == ["rms_norm+residual", "rotary_embedding",
                                            "silu_and_mul", "reshape_and_cache"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_exits_zero(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", ["bench", "--result-json", str(tmp_path / "k.json")])
    assert bench.main() == 0
    assert "no CUDA GPU" in capsys.readouterr().out and not (tmp_path / "k.json").exists()
