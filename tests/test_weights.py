"""Loading and saving the bilm-tf / AllenNLP layout: round trips and clear errors."""
import json
import os
import shutil

import h5py
import numpy as np
import pytest

from elmo_pipeline.model import ElmoEmbedder, OptionsError, WeightsError, load_bilm, save_bilm
from elmo_pipeline.model.synthetic import PUBLISHED_OPTIONS, random_bilm, write_random_bilm

SENTS = [["The", "quick", "brown", "fox", "."], ["Über", "naïve", "café"], ["a"]]


def test_published_layout_with_skip_connections_loads_and_runs(tmp_path):
    # the published small model's shapes (skip connections ON), random weights
    options, weights = write_random_bilm("small", str(tmp_path), seed=3)
    with h5py.File(weights, "r") as f:
        assert f["char_embed"].shape == (261, 16)
        assert f["CNN/W_cnn_6"].shape == (1, 7, 16, 1024)
        assert f["RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_0"].shape == (256, 4096)
    e = ElmoEmbedder(options, weights)
    assert e.model.opts.use_skip_connections
    out = e.embed_batch(SENTS)
    assert [o.shape for o in out] == [(3, 5, 256), (3, 3, 256), (3, 1, 256)]
    assert all(np.isfinite(o).all() for o in out)


def test_skip_connections_change_the_output(tmp_path):
    on = random_bilm("tiny", seed=2)
    raw = json.loads(json.dumps(PUBLISHED_OPTIONS["tiny"]))
    raw["lstm"]["use_skip_connections"] = False
    off = random_bilm(raw, seed=2)
    a = ElmoEmbedder(model=on).embed_sentence(SENTS[0])
    b = ElmoEmbedder(model=off).embed_sentence(SENTS[0])
    np.testing.assert_array_equal(a[:2], b[:2])            # first layer has no residual
    assert np.abs(a[2] - b[2]).max() > 1e-3


def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = random_bilm("tiny", seed=5)
    save_bilm(model, str(tmp_path / "o.json"), str(tmp_path / "w.hdf5"))
    loaded = load_bilm(str(tmp_path / "o.json"), str(tmp_path / "w.hdf5"))
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and np.array_equal(p1.numpy(), p2.numpy()), n1
    a = ElmoEmbedder(model=model).embed_batch(SENTS)
    b = ElmoEmbedder(model=loaded).embed_batch(SENTS)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    # and saving again writes the same arrays
    save_bilm(loaded, str(tmp_path / "o2.json"), str(tmp_path / "w2.hdf5"))
    with h5py.File(tmp_path / "w.hdf5") as f1, h5py.File(tmp_path / "w2.hdf5") as f2:
        names = []
        f1.visit(names.append)
        for n in names:
            if isinstance(f1[n], h5py.Dataset):
                assert np.array_equal(f1[n][...], f2[n][...]), n


def test_fixture_round_trip(fixture_dir, tmp_path):
    m = load_bilm(os.path.join(fixture_dir, "options.json"), os.path.join(fixture_dir, "lm_weights.hdf5"))
    save_bilm(m, str(tmp_path / "o.json"), str(tmp_path / "w.hdf5"))
    with h5py.File(os.path.join(fixture_dir, "lm_weights.hdf5")) as f1, h5py.File(tmp_path / "w.hdf5") as f2:
        names = []
        f1.visit(names.append)
        for n in names:
            if isinstance(f1[n], h5py.Dataset):
                assert np.array_equal(f1[n][...], f2[n][...]), n


def test_missing_dataset_names_its_path(tiny_model_files, tmp_path):
    options, weights = tiny_model_files
    broken = str(tmp_path / "w.hdf5")
    shutil.copy(weights, broken)
    with h5py.File(broken, "a") as f:
        del f["RNN_1/RNN/MultiRNNCell/Cell0/LSTMCell/W_P_0"]
    with pytest.raises(WeightsError, match="missing dataset 'RNN_1/RNN/MultiRNNCell/Cell0/LSTMCell/W_P_0'"):
        load_bilm(options, broken)


def test_wrong_shape_names_expected_and_found(tiny_model_files, tmp_path):
    options, weights = tiny_model_files
    broken = str(tmp_path / "w.hdf5")
    shutil.copy(weights, broken)
    with h5py.File(broken, "a") as f:
        del f["CNN_proj/W_proj"]
        f["CNN_proj/W_proj"] = np.zeros((20, 9), np.float32)
    with pytest.raises(WeightsError, match=r"'CNN_proj/W_proj' has shape \(20, 9\), expected \(20, 8\)"):
        load_bilm(options, broken)


@pytest.mark.parametrize("key,value,message", [
    ("dim", 64, "expected"),                                  # wrong shapes
    ("n_layers", 1, r"dataset\(s\) the options do not use, e.g. 'RNN_0/RNN/MultiRNNCell/Cell1"),   # fewer layers
])
def test_options_weights_mismatch(tiny_model_files, tmp_path, key, value, message):
    _, weights = tiny_model_files
    raw = json.loads(json.dumps(PUBLISHED_OPTIONS["tiny"]))
    raw["lstm"][key] = value
    (tmp_path / "o.json").write_text(json.dumps(raw))
    with pytest.raises(WeightsError, match=message):
        load_bilm(str(tmp_path / "o.json"), weights)


def test_not_hdf5(tiny_model_files, tmp_path):
    (tmp_path / "w.hdf5").write_bytes(b"this is not hdf5")
    with pytest.raises(WeightsError, match=r"not a valid HDF5 file \(truncated or corrupted\?\)"):
        load_bilm(tiny_model_files[0], str(tmp_path / "w.hdf5"))


@pytest.mark.parametrize("keep", [0, 100, 0.5, -100])
def test_truncated_file_is_one_line_weights_error(tiny_model_files, tmp_path, keep):
    options, weights = tiny_model_files
    data = open(weights, "rb").read()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    (tmp_path / "w.hdf5").write_bytes(data[:n])
    with pytest.raises(WeightsError, match=r"not a valid HDF5 file \(truncated or corrupted\?\)") as e:
        load_bilm(options, str(tmp_path / "w.hdf5"))
    assert "\n" not in str(e.value) and f"{n} bytes" in str(e.value)


def test_non_finite_weights_name_the_dataset(tiny_model_files, tmp_path):
    options, weights = tiny_model_files
    broken = str(tmp_path / "w.hdf5")
    shutil.copy(weights, broken)
    with h5py.File(broken, "a") as f:
        f["CNN/b_cnn_0"][0] = np.nan
    with pytest.raises(WeightsError, match=r"'CNN/b_cnn_0' has 1 non-finite value"):
        load_bilm(options, broken)


@pytest.mark.parametrize("how", ["external storage", "virtual", "external link", "soft link", "external group"])
def test_a_dataset_kept_outside_the_file_or_named_by_a_link_is_refused_unopened(tiny_model_files, tmp_path, how):
    """A weights file whose dataset is another file's bytes: its external storage or an external link (a group's
    too) opened that file when read (a FIFO there hung `elmo` for ever); a virtual dataset or a soft link likewise
    read what the file does not hold as its own. Refused with one WeightsError naming the dataset, before any read
    (the other file here is a whole copy of the weights, so that reading it would succeed)."""
    options, weights = tiny_model_files
    other = str(tmp_path / "other.hdf5")
    shutil.copy(weights, other)
    broken = str(tmp_path / "w.hdf5")
    shutil.copy(weights, broken)
    name = "CNN/b_cnn_0"
    with h5py.File(broken, "a") as f, h5py.File(other, "r") as o:
        ds = o[name]
        if how == "external group":
            del f["CNN"]
            f["CNN"] = h5py.ExternalLink(other, "/CNN")
            name = "CNN/W_cnn_0"
        else:
            del f[name]
        if how == "external storage":
            raw = str(tmp_path / "raw")
            ds[...].tofile(raw)
            f.create_dataset(name, ds.shape, ds.dtype, external=[(raw, 0, h5py.h5f.UNLIMITED)])
        elif how == "virtual":
            layout = h5py.VirtualLayout(ds.shape, ds.dtype)
            layout[...] = h5py.VirtualSource(other, name, ds.shape)
            f.create_virtual_dataset(name, layout)
        elif how == "external link":
            f[name] = h5py.ExternalLink(other, "/" + name)
        elif how == "soft link":
            f["elsewhere"] = ds[...]
            f[name] = h5py.SoftLink("/elsewhere")
    with pytest.raises(WeightsError, match=f"'{name}' (is a link|keeps its data outside the file)") as e:
        load_bilm(options, broken)
    assert "\n" not in str(e.value)


def test_a_dataset_stored_in_chunks_larger_than_its_shape_is_refused_unread(tiny_model_files, tmp_path):
    """A 4-float dataset stored (gzip) in one chunk of many floats: with 2**29, a 2 MB weights file made the load
    inflate 2 GiB (HDF5 reads whole chunks, up to 4 GiB a chunk, one dataset after another). Refused unread."""
    options, weights = tiny_model_files
    broken = str(tmp_path / "w.hdf5")
    shutil.copy(weights, broken)
    with h5py.File(broken, "a") as f:
        data = f["CNN/b_cnn_0"][...]
        del f["CNN/b_cnn_0"]
        f.create_dataset("CNN/b_cnn_0", data=data, maxshape=(None,), chunks=(2 ** 24,), compression="gzip")
    with pytest.raises(WeightsError, match=r"'CNN/b_cnn_0' is stored in chunks \(16777216,\), larger than its shape"):
        load_bilm(options, broken)


def test_options_not_an_object(tiny_model_files, tmp_path):
    (tmp_path / "o.json").write_text("[1, 2]")
    with pytest.raises(OptionsError, match="expected a JSON object"):
        load_bilm(str(tmp_path / "o.json"), tiny_model_files[1])


def test_shipped_model_sha256_recorded_and_verified(tmp_path):
    from elmo_pipeline.model.pretrained import HERE, default_model_files, verify_model_folder
    default_model_files()                                   # verifies against sha256sums.txt
    folder = os.path.join(HERE, "wikitext2-small")
    sums = open(os.path.join(folder, "sha256sums.txt")).read()
    assert "weights.hdf5" in sums and "options.json" in sums
    copy = tmp_path / "m"
    copy.mkdir()
    for name in ("options.json", "weights.hdf5", "vocab.txt", "sha256sums.txt"):
        shutil.copy(os.path.join(folder, name), copy / name)
    verify_model_folder(str(copy))
    with open(copy / "weights.hdf5", "r+b") as f:          # one flipped byte in the middle of the data
        f.seek(os.path.getsize(copy / "weights.hdf5") // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ValueError, match="weights.hdf5: sha256 mismatch"):
        verify_model_folder(str(copy))


def test_nothing_is_unpickled():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for pkg in ("model", "transforms", "pipeline"):
        for dirpath, _, names in os.walk(os.path.join(root, pkg)):
            for n in names:
                if n.endswith(".py"):
                    src = open(os.path.join(dirpath, n), encoding="utf-8").read()
                    for bad in ("import pickle", "torch.load(", "allow_pickle=True", "import joblib", "import dill"):
                        assert bad not in src, f"{pkg}/{n} uses {bad}"


@pytest.mark.parametrize("edit,key", [
    (lambda r: r["lstm"].pop("dim"), "lstm.dim"),
    (lambda r: r["lstm"].__setitem__("n_layers", "two"), "lstm.n_layers"),
    (lambda r: r["char_cnn"].__setitem__("activation", "gelu"), "char_cnn.activation"),
    (lambda r: r["char_cnn"].__setitem__("filters", [7]), "char_cnn.filters"),
])
def test_bad_options_name_the_key(tiny_model_files, tmp_path, edit, key):
    raw = json.loads(json.dumps(PUBLISHED_OPTIONS["tiny"]))
    edit(raw)
    (tmp_path / "o.json").write_text(json.dumps(raw))
    with pytest.raises(OptionsError, match=f"'{key}'"):
        load_bilm(str(tmp_path / "o.json"), tiny_model_files[1])


def test_bad_json(tiny_model_files, tmp_path):
    (tmp_path / "o.json").write_text("{not json")
    with pytest.raises(OptionsError, match="not valid JSON"):
        load_bilm(str(tmp_path / "o.json"), tiny_model_files[1])


def test_sha256_verified(tiny_model_files):
    with pytest.raises(ValueError, match="sha256 mismatch"):
        load_bilm(*tiny_model_files, sha256="0" * 64)


def test_check_bilm_refuses_what_load_bilm_refuses_and_builds_nothing(tiny_model_files, tmp_path, monkeypatch):
    """The launcher's check (check_bilm): the options and the weights' metadata and values, no BiLM built."""
    from elmo_pipeline.model import weights
    options, good = tiny_model_files

    def never(*_, **__):
        raise AssertionError("check_bilm built a BiLM")
    monkeypatch.setattr(weights, "BiLM", never)
    assert weights.check_bilm(options, good).n_layers >= 1
    broken = str(tmp_path / "w.hdf5")
    shutil.copy(good, broken)
    with h5py.File(broken, "a") as f:
        f["CNN/b_cnn_0"][0] = np.inf
    with pytest.raises(WeightsError, match=r"'CNN/b_cnn_0' has 1 non-finite value"):
        weights.check_bilm(options, broken)
    (tmp_path / "t.hdf5").write_bytes(open(good, "rb").read()[:1000])
    with pytest.raises(WeightsError, match=r"not a valid HDF5 file"):
        weights.check_bilm(options, str(tmp_path / "t.hdf5"))


@pytest.mark.parametrize("shape", ["tiny", "small"])
def test_a_model_loaded_without_initialising_equals_one_initialised_then_loaded(shape, tmp_path):
    """load_bilm builds the BiLM without drawing its random weights (model/weights.py _unfilled): every parameter
    and buffer (the non-persistent forget bias too) is bit for bit what an initialised BiLM holds once loaded."""
    import torch
    from elmo_pipeline.model.bilm import BiLM
    from elmo_pipeline.model.options import load_options
    from elmo_pipeline.model.weights import load_weights_into
    options, weights = write_random_bilm(shape, str(tmp_path), seed=3)
    fast, full = load_bilm(options, weights), load_weights_into(BiLM(load_options(options)), weights).eval()
    a = {**dict(fast.named_parameters()), **dict(fast.named_buffers())}
    b = {**dict(full.named_parameters()), **dict(full.named_buffers())}
    assert a.keys() == b.keys() and any(k.endswith("forget_bias") for k in a)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_loading_a_model_imports_neither_dynamo_nor_sympy(tiny_model_files):
    """A fresh process's load_bilm stays off torch's Python reference kernels (the meta device's initialisers and
    to_empty imported torch._dynamo and sympy: about 1.1 s of the `elmo` command's fixed cost, benchmarks.model_load)."""
    import subprocess
    import sys
    code = ("import sys; from elmo_pipeline.model.weights import load_bilm; load_bilm(*sys.argv[1:3]); "
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, *tiny_model_files[:2]], capture_output=True, text=True,
                       timeout=120, check=True)
    assert r.stdout.split("\n")[-2] == "[]"


def test_a_parameter_the_layout_does_not_load_is_an_error(tiny_model_files, monkeypatch):
    """A parameter the weights layout leaves out (a model change not followed in _load) would hold uninitialised
    memory: loading refuses instead."""
    import torch
    from elmo_pipeline.model import lstm
    init = lstm.LstmProjection.__init__

    def with_extra(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.extra = torch.nn.Parameter(torch.empty(3))
    monkeypatch.setattr(lstm.LstmProjection, "__init__", with_extra)
    from elmo_pipeline.model.weights import LayoutGap
    with pytest.raises(LayoutGap, match="leaves parameters unloaded: forward_layers.0.extra"):
        load_bilm(*tiny_model_files)


@pytest.mark.parametrize("dtype,shown", [(np.dtype(("<f8", (512,))), r"\('<f8', \(512,\)\)"), (np.int32, "int32"),
                                         (np.dtype([("a", "<f4")]), r"\[\('a', '<f4'\)\]"), (np.longdouble, "float128")])
def test_a_dataset_of_other_elements_than_plain_floats_is_refused_unread(tiny_model_files, tmp_path, monkeypatch,
                                                                        dtype, shown):
    """A dataset of the right shape whose elements are HDF5 arrays of 512 floats (read, 512x the weights), integers,
    records or long doubles is one WeightsError naming its type, before any dataset is read."""
    import elmo_pipeline.model.weights as weights
    from elmo_pipeline.model.weights import check_bilm
    if np.dtype(dtype).itemsize <= 8 and np.dtype(dtype).kind == "f":
        pytest.skip("long double is float64 here")
    options, src = tiny_model_files
    broken = str(tmp_path / "w.hdf5")
    shutil.copy(src, broken)
    with h5py.File(broken, "a") as f:
        shape = f["CNN_proj/W_proj"].shape
        del f["CNN_proj/W_proj"]
        f.create_dataset("CNN_proj/W_proj", shape=shape, dtype=dtype)
    monkeypatch.setattr(weights, "_read", lambda *a: pytest.fail("a dataset was read"))
    for load in (load_bilm, check_bilm):
        with pytest.raises(WeightsError, match=rf"dataset 'CNN_proj/W_proj' has elements of type {shown}, expected "
                                               r"floats \(float16, float32 or float64\)$"):
            load(options, broken)
