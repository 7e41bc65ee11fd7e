import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), "shared")
FIXTURES = os.path.join(SHARED, "fixtures", "bilm-tf")
# the fault-injection fixture (tests/faults/sitecustomize.py) in every process the tests start; inert unless a
# test sets ELMO_PIPELINE_CRASH_AT, ELMO_PIPELINE_DELAY_AT or ELMO_PIPELINE_HOLD_AT for it
FAULTS = os.path.join(REPO, "tests", "faults")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (FAULTS, os.environ.get("PYTHONPATH")) if p)


def shared_path(*parts: str) -> str:
    """Path under ../shared, or skip the test with the reason when it is absent."""
    path = os.path.join(SHARED, *parts)
    if not os.path.exists(path):
        pytest.skip(f"needs {path} (the shared material beside the checkout) which is absent")
    return path


@pytest.fixture(scope="session")
def fixture_dir() -> str:
    return shared_path("fixtures", "bilm-tf")


@pytest.fixture(scope="session")
def tiny_model_files(tmp_path_factory):
    """options.json + weights.hdf5 of a random tiny biLM with skip connections ON."""
    from elmo_pipeline.model.synthetic import write_random_bilm
    return write_random_bilm("tiny", str(tmp_path_factory.mktemp("tiny")), seed=1)



# ELMO_TEST_DEVICE=cuda (benchmarks/gpu_check.py): every ElmoEmbedder made without a device runs there
_TEST_DEVICE = os.environ.get("ELMO_TEST_DEVICE")
if _TEST_DEVICE:
    from elmo_pipeline.model.embedder import ElmoEmbedder as _Embedder
    _Embedder.__init__.__kwdefaults__["device"] = _TEST_DEVICE
TEST_DEVICE = _TEST_DEVICE or "cpu"


def _invariant_refusal() -> str | None:
    from elmo_pipeline.model.device import check_batch_invariant
    try:
        check_batch_invariant(TEST_DEVICE)
    except ValueError as e:
        return str(e)
    return None


# tests of batch-invariant bits: skipped, with the reason, on a device that refuses --batch-invariant
needs_invariant_device = pytest.mark.skipif(_invariant_refusal() is not None, reason=f"{_invariant_refusal()}")
