"""The LSTM step loops (model/lstm.py: LSTM_LOOPS, step_loop; model/lstm_loops.py) and the fused cell a GPU compiles."""
import json
import os
import subprocess
import sys

import pytest
import torch

import elmo_pipeline.model.lstm_loops as lstm_loops
from elmo_pipeline.model import hardware
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.char_ids import batch_char_ids
from elmo_pipeline.model.embedder import ElmoEmbedder
from elmo_pipeline.model.kernels import shape_layers
from elmo_pipeline.model.lstm import ONEDNN_MIN_GATE_WIDTH, ONEDNN_MIN_INPUT_WIDTH, LstmProjection, step_loop
from elmo_pipeline.model.row_tile import MAX_ROWS, ROW_TILE, in_pieces, row_rule_of
from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS, random_bilm
from elmo_pipeline.model.options import parse_options
from tests.oracle import oracle_forward
from tests.test_batch_invariant import sentences


def _batch(n=9, seed=2):
    return (torch.from_numpy(a) for a in batch_char_ids(sentences(n, seed=seed, max_len=18)))


@pytest.mark.parametrize("gemm", ["onednn", "onednn in gate pieces", "bmm"])
def test_each_loop_equals_the_oracle(gemm, monkeypatch):
    """Both loops, chosen, give the oracle's vectors and final states (lengths vary: sequences end mid-batch); so does
    the oneDNN loop with its gate GEMMs in row pieces, each piece's cell after its gates (gate_rows: bf16 on a CPU
    with AMX; pieces of 4 rows here, in float32, so that every step is cut)."""
    if gemm.startswith("onednn") and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    assert lstm_loops.gate_rows(torch.float32) is None           # elsewhere a step's rows are one call, as before
    if gemm == "onednn in gate pieces":
        monkeypatch.setattr(lstm_loops, "gate_rows", lambda dtype: 4)
    model = random_bilm("tiny", seed=4)
    model.lstm_loop = gemm.split()[0]
    ids, lengths = _batch()
    ref, (rh, rc) = oracle_forward(model, ids, lengths, None)
    with torch.inference_mode():
        got, (h, c) = model(ids, lengths)
    assert model._pair_weights(0)[0].name == model.lstm_loop
    assert (got - ref).abs().max() <= 1e-5
    assert (h - rh).abs().max() <= 1e-5 and (c - rc).abs().max() <= 1e-5


def test_gate_rows_by_the_cpus_flags(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert lstm_loops.gate_rows(torch.bfloat16) == lstm_loops.AMX_GATE_ROWS
    assert lstm_loops.gate_rows(torch.float32) is None
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert lstm_loops.gate_rows(torch.bfloat16) is None


def test_auto_choice():
    """auto: oneDNN on a CPU whose torch has it (for the dtype) for layers wide enough (gate width 4H >=
    ONEDNN_MIN_GATE_WIDTH, GEMM input width D_in + P >= ONEDNN_MIN_INPUT_WIDTH), the bmm loop for narrower layers
    and on a GPU; a loop named explicitly is taken whatever the shape."""
    assert step_loop(torch.device("cuda"), torch.float32, "auto", compile_cell=False).name == "bmm"
    with pytest.raises(ValueError, match="CPU only"):       # oneDNN's reorders have no CUDA kernel
        step_loop(torch.device("cuda"), torch.float32, "onednn")
    want = "onednn" if torch.backends.mkldnn.is_available() else "bmm"
    cpu = torch.device("cpu")
    assert step_loop(cpu, torch.float32).name == want
    H, K = ONEDNN_MIN_GATE_WIDTH // 4, ONEDNN_MIN_INPUT_WIDTH // 2
    assert step_loop(cpu, torch.float32, layer=LstmProjection(K, H, K, 3.0, 3.0)).name == want
    assert step_loop(cpu, torch.float32, layer=LstmProjection(K, H - 1, K, 3.0, 3.0)).name == "bmm"
    assert step_loop(cpu, torch.float32, layer=LstmProjection(K - 1, H, K - 1, 3.0, 3.0)).name == "bmm"
    assert step_loop(cpu, torch.float32, "onednn", layer=LstmProjection(8, 16, 8, 3.0, 3.0)).name == "onednn"
    tiny, small = random_bilm("tiny"), random_bilm("small")          # LSTM widths 32 and 1,024
    assert tiny._pair_weights(0)[0].name == "bmm" and small._pair_weights(0)[0].name == want


def test_weights_follow_the_choice():
    """The cached weights are re-made in the other form when the choice changes."""
    model = random_bilm("tiny", seed=4)
    model.lstm_loop = "bmm"
    assert isinstance(model._pair_weights(0)[1], tuple)
    if torch.backends.mkldnn.is_available():
        model.lstm_loop = "onednn"
        assert isinstance(model._pair_weights(0)[1], list)


def test_bad_choice_is_an_error(monkeypatch):
    """An unknown loop is a ValueError naming where it came from: the option, or the variable."""
    opts = parse_options(PUBLISHED_OPTIONS["tiny"])
    with pytest.raises(ValueError, match="lstm_loop"):
        BiLM(opts, lstm_loop="cublas")
    with pytest.raises(ValueError, match="lstm_loop"):
        random_bilm("tiny").lstm_loop = "cublas"
    monkeypatch.setenv("ELMO_LSTM_GEMM", "cublas")
    with pytest.raises(ValueError, match="ELMO_LSTM_GEMM"):
        BiLM(opts)


def test_the_choice_is_the_models_option(monkeypatch):
    """The loop is an option of each model: its default is ELMO_LSTM_GEMM when the model is constructed (not
    when model.bilm was imported), and the constructor's argument, the attribute or ElmoEmbedder(lstm_loop=) set it;
    ELMO_COMPILE_CELL=0 likewise turns the compiled cell off for the models constructed under it."""
    opts = parse_options(PUBLISHED_OPTIONS["tiny"])
    assert BiLM(opts).lstm_loop == "auto" and BiLM(opts).compile_cell
    monkeypatch.setenv("ELMO_LSTM_GEMM", "bmm")
    monkeypatch.setenv("ELMO_COMPILE_CELL", "0")
    model = random_bilm("tiny", seed=4)
    assert model.lstm_loop == "bmm" and not model.compile_cell
    assert BiLM(opts, lstm_loop="auto").lstm_loop == "auto"
    monkeypatch.delenv("ELMO_LSTM_GEMM")
    assert model._pair_weights(0)[0].name == "bmm"          # chosen when the model was made
    assert ElmoEmbedder(model=random_bilm("tiny"), lstm_loop="bmm").model.lstm_loop == "bmm"


def test_the_compiled_cell_only_on_a_gpu_when_asked():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert lstm_loops.cell_for(cuda, True) is lstm_loops.compiled_cell()
    assert lstm_loops.cell_for(cuda, False) is lstm_loops.cell_eager
    assert lstm_loops.cell_for(cpu, True) is lstm_loops.cell_eager


@pytest.mark.slow
def test_fused_cell_compiles_to_one_graph_and_equals_the_eager_cell():
    """What a GPU runs (torch.compile of cell_fused, here with inductor's CPU code): one graph (fullgraph),
    one compilation for every row count (dynamic), the eager cell's values to float rounding."""
    fused = torch.compile(lstm_loops.cell_fused, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for n in (3, 8, 13):
        gates = torch.randn(2, n, 4 * 16, generator=g) * 3
        c = torch.randn(2, n, 16, generator=g) * 3
        want_c, want_out = lstm_loops.cell_eager(gates.clone(), c.clone(), 3.0, torch.empty(2, n, 16))
        got_c, got_out = fused(gates, c, 3.0, torch.empty(2, n, 16))
        assert (got_c - want_c).abs().max() <= 1e-6 and (got_out - want_out).abs().max() <= 1e-6
        assert got_c.abs().max() <= 3.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tanh_times_in_a_half_dtype_has_the_bits_of_torchs_tanh(dtype):
    """The oneDNN loop's o * tanh(c) for bf16/fp16 goes through float32 work rows (faster): the bits of torch's own
    tanh in that dtype times o, for every value, extremes and the cell clip's range included."""
    g = torch.Generator().manual_seed(0)
    c = torch.cat([torch.randn(40, 64, generator=g) * 3, torch.linspace(-20, 20, 64)[None],
                   torch.tensor([[0.0, -0.0, 1e-8, -1e-8] * 16])]).to(dtype)
    o = torch.rand(c.shape, generator=g).to(dtype)
    out = torch.empty_like(c)
    got = lstm_loops._tanh_times(c, o, out, torch.empty(64, 64))
    assert got is out and torch.equal(got, torch.tanh(c).mul_(o))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_step_gemms_in_checked_pieces_give_a_row_its_row_tile_bits(dtype):
    """What --batch-invariant relies on in the oneDNN loop: the step GEMMs of the original shape (gates with sigmoid,
    gate j with tanh, the projection with its clip), called as the invariant loop calls them (in_pieces: on row
    counts their RowRule checked, at 1 thread and at this process's thread count), give every row the bits a
    ROW_TILE-row call at 1 thread gives it, for row counts past MAX_ROWS and at any position (docs/exactness.md).
    Where a kind's kernels move a row's bits at some count (an Intel Xeon with AMX in bf16 at 1 thread: from 36
    rows), the calls are cut below it there: never other bits."""
    if not torch.backends.mkldnn.is_available() or (dtype == torch.bfloat16
                                                    and not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("no oneDNN for this dtype in this torch build")
    linear, reorder = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    rows = MAX_ROWS + 3 * 32 + 3 * ROW_TILE
    original = shape_layers(parse_options(PUBLISHED_OPTIONS["original"]))[0]
    try:
        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            for _, k, n, attr, scalars, bias in lstm_loops.onednn_step_gemms(original):
                w = reorder((torch.randn(n, k, generator=g) / k ** 0.5).to(dtype))
                b = torch.randn(n, generator=g).to(dtype) if bias else None
                x = torch.randn(rows, k, generator=g).to(dtype)

                def gemm(part):
                    return linear(part, w, b, attr, scalars, "")
                torch.set_num_threads(1)
                ref = torch.cat([gemm(x[i: i + ROW_TILE]) for i in range(0, rows, ROW_TILE)])
                torch.set_num_threads(n_threads)
                rule = row_rule_of("onednn", k, n, dtype, attr, *scalars, *(("bias",) if bias else ()))
                for m in (ROW_TILE, 36, 132, 184, MAX_ROWS + 4 * ROW_TILE, rows):
                    assert torch.equal(in_pieces(gemm, x[:m], rule), ref[:m]), (n_threads, k, n, m, rule.kept)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_model_speed_profile_counts_the_onednn_linears_by_rows(tmp_path):
    """python -m benchmarks.model_speed --profile: the oneDNN linears by rows per call, [2^k, 2^(k+1)) buckets
    with their calls, seconds and GFLOP/s; the LSTM steps' GEMMs are most of the CPU time."""
    out = tmp_path / "speed.json"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.model_speed", "--configs", "small", "--sentences", "40",
                           "--threads", "1", "--path", "embedder", "--warm-cache-sentences", "40", "--profile",
                           "--out", str(out)], cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    buckets = row["profile"]["linear_by_rows"]
    assert buckets and sum(b["calls"] for b in buckets) > 0
    for b in buckets:
        lo, hi = map(int, b["rows"].split("-"))
        assert hi == 2 * lo - 1 and lo & (lo - 1) == 0 and b["seconds"] > 0 and b["gflops"] > 0
    assert 0 < row["profile"]["gemm_s"] <= row["profile"]["total_s"]


def test_a_model_that_ran_copies_and_pickles():
    """copy.deepcopy and pickle of a model after inference (its loops' and encoder's packed oneDNN weights cached):
    the copy gives the same vectors."""
    import copy
    import pickle
    model = random_bilm("small", seed=4)
    ids, lengths = _batch()
    with torch.inference_mode():
        want, _ = model(ids, lengths)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.inference_mode():
            got, _ = twin(ids, lengths)
        assert torch.equal(got, want)


@pytest.mark.slow
def test_compiled_cell_takes_every_variant_a_process_meets():
    """The compiled cell is specialised per dtype, clip, c's layout and one row or several: one process meeting all of
    them (fp32 then bf16, as gpu_check does) compiles each once, never FailOnRecompileLimitHit (torch's default
    limit of 8 was hit on an NVIDIA H200); each variant's values are cell_eager's."""
    from elmo_pipeline.model.lstm_loops import cell_eager, compiled_cell
    cell, H = compiled_cell(), 8
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 5):
            for view in (False, True):
                for clip in (None, 3.0):
                    g = torch.Generator().manual_seed(rows)
                    gates = torch.randn(2, rows, 5 * H, generator=g).to(dtype)[..., : 4 * H]
                    c = torch.randn(2, rows, 4 * H, generator=g).to(dtype)[..., H: 2 * H]     # strided, as in the loop
                    c = c if view else c.contiguous()
                    out = torch.empty(2, rows, H, dtype=dtype)
                    c2, h2 = cell(gates, c, clip, out)
                    c1, h1 = cell_eager(gates.clone(), c.clone(), clip, torch.empty_like(out))
                    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}   # fused: one rounding
                    torch.testing.assert_close(c2, c1, **tol)
                    torch.testing.assert_close(h2, h1, **tol)
