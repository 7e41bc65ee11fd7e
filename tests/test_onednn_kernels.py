"""benchmarks/onednn_kernels.py: what oneDNN ran for each LSTM step GEMM, read from its verbose records."""
import json

import pytest
import torch

from benchmarks.onednn_kernels import kernel_of, main, verbose_lines


def test_the_gemm_and_the_other_primitives_of_a_call_are_read():
    records = [line.split(",") for line in (
        "onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:bf16::blocked:ab::f0 dst:bf16::blocked:"
        "AB16b64a2b::f0,,,512x1024,0.1",
        "onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx512_core_amx,forward_inference,src:bf16::"
        "blocked:ab::f0 wei:bf16::blocked:AB16b64a2b::f0 dst:bf16::blocked:ab::f0,,,mb40ic1024oc512,0.2")]
    assert kernel_of(records) == {"implementation": "brg_matmul:avx512_core_amx", "weights": "bf16::blocked:AB16b64a2b::f0",
                                  "other_primitives": ["reorder"]}
    assert kernel_of([]) == {"implementation": None, "weights": None, "other_primitives": []}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_one_call_is_captured_here(capfd):
    w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 96))
    x = torch.randn(8, 96)
    records = verbose_lines(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    assert kernel_of(records)["implementation"], records
    assert "onednn_verbose" not in capfd.readouterr().out           # captured, none of it printed


@pytest.mark.slow
def test_the_benchmark_names_each_step_gemm(tmp_path):
    out = tmp_path / "k.json"
    main(["--shape", "small", "--rows", "4", "40", "--dtypes", "float32", "--pack-for-rows", "--pieces", "16",
          "--out", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    per_gemm = [(4, None, None), (4, 4, None), (40, None, None), (40, 40, None), (40, None, 16)]   # 4 rows: no pieces
    assert [(g["gemm"], g["rows"], g["packed_for"], g["pieces"]) for g in run["gemms"]] == [
        (n, *x) for n in ("gates", "gate j", "projection") for x in per_gemm]
    assert all(g["implementation"] and g["gflops"] > 0 for g in run["gemms"])


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_cell_ops_times_each_op_beside_the_gemms(tmp_path):
    """benchmarks/cell_ops.py: every op of the oneDNN loop's cell, the whole cell and the three step GEMMs with and
    without their fused activations, timed; the step's share of the ceiling measured in the same run."""
    from benchmarks import cell_ops
    out = tmp_path / "c.json"
    cell_ops.main(["--shape", "small", "--rows", "8", "--dtypes", "float32", "--out", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    assert list(run["cell_us"]) == ["c * f", "+ i * j", "cell clip", "o * tanh(c) (_tanh_times)",
                                    "o * tanh(c) (torch.tanh in the dtype)", "the whole cell"]
    assert list(run["gemm_us"]) == ["gates", "gate j", "projection"] and all(v > 0 for v in run["gemm_us"].values())
    assert run["cell_us"]["the whole cell"] > 0 and 0 < run["cell_share_of_step"] < 1
    assert list(run["gemm_without_activation_us"]) == list(run["gemm_us"])
    assert all(v > 0 for v in run["gemm_without_activation_us"].values()) and run["ceiling_gflops"] > 0
    gemms, bare = sum(run["gemm_us"].values()), sum(run["gemm_without_activation_us"].values())
    cell = run["cell_us"]["the whole cell"]         # the shares from these times (their relations are the machine's)
    assert run["pointwise_share_of_step"] == pytest.approx((cell + gemms - bare) / (cell + gemms))
    assert run["step_fraction_of_ceiling"] > 0
    assert run["step_fraction_of_ceiling"] / run["pointwise_free_fraction_of_ceiling"] == pytest.approx(bare / (cell + gemms))
