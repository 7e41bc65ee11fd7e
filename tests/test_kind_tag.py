"""benchmarks.common.kind_tag: the machine kind a result file is named by (benchmarks/README.md, Machine kinds)."""
import pytest

from benchmarks.common import kind_tag
from elmo_pipeline.model import hardware


@pytest.mark.parametrize("name, family, model, flags, tag", [
    ("AMD EPYC 7571", 23, 1, ["avx2"], "zen1"),
    ("AMD EPYC 7R32", 23, 49, ["avx2"], "zen2"),
    ("AMD EPYC 7R13 Processor", 25, 1, ["avx2"], "zen3"),
    ("AMD EPYC 9R14", 25, 17, ["avx2", "avx512f", "avx512_bf16"], "zen4"),
    ("AMD EPYC 9R14", 25, 17, ["avx2"], "zen4"),               # a guest that hides AVX-512: still the Zen 4 core
    ("AMD EPYC 9R45", 26, 2, ["avx2", "avx512f", "avx512_bf16"], "zen5"),
    ("Intel(R) Xeon(R) Platinum 8259CL CPU", 6, 85, ["avx2", "avx512f"], "intel"),
    ("Intel(R) Xeon(R) Platinum 8488C", 6, 143, ["avx2", "avx512f", "avx512_bf16", "amx_bf16"], "intel_amx"),
    ("Neoverse-V1", None, None, None, "cpu"),
])
def test_each_kind_has_its_own_tag(monkeypatch, name, family, model, flags, tag):
    monkeypatch.setattr(hardware, "cpu_info", lambda: {"name": name, "family": family, "model": model, "flags": flags})
    assert kind_tag() == tag
