"""model.hardware: the CPU's native compute dtypes from /proc/cpuinfo text (samples of the machine kinds this
project runs on, trimmed), the once-per-process warning, `elmo-pipeline doctor`."""
import json
import logging

import pytest

from elmo_pipeline.model import hardware

BASE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall "
        "nx pdpe1gb rdtscp lm constant_tsc rep_good nopl pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes "
        "xsave avx f16c rdrand lahf_lm abm fsgsbase bmi1 avx2 smep bmi2 rdseed adx smap clflushopt sha_ni xsaveopt")
AVX512 = "avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg"


def cpuinfo(vendor, family, model, name, flags, processors=2):
    block = (f"processor\t: {{i}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
             f"model name\t: {name}\nstepping\t: 1\nflags\t\t: {flags}\nbogomips\t: 4000.00\n\n")
    return "".join(block.format(i=i) for i in range(processors))


ZEN1 = cpuinfo("AuthenticAMD", 23, 1, "AMD EPYC 7601 32-Core Processor",
               BASE + " mmxext fxsr_opt svm extapic cr8_legacy sse4a misalignsse 3dnowprefetch clzero")
ZEN4 = cpuinfo("AuthenticAMD", 25, 17, "AMD EPYC 9654 96-Core Processor",
               f"{BASE} {AVX512} avx512_bf16 avx512_vpopcntdq gfni vaes vpclmulqdq")
ZEN5 = cpuinfo("AuthenticAMD", 26, 2, "AMD EPYC", f"{BASE} {AVX512} avx_vnni avx512_bf16 avx512_vp2intersect")
SKYLAKE = cpuinfo("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Platinum 8175M CPU @ 2.50GHz",
                  BASE + " avx512f avx512dq avx512cd avx512bw avx512vl")
SAPPHIRE = cpuinfo("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+",
                   f"{BASE} {AVX512} avx_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8")
GRAVITON3 = ("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
             "fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat "
             "ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\nCPU implementer\t: 0x41\n"
             "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd40\nCPU revision\t: 1\n\n")
GRAVITON2 = GRAVITON3.replace(" svebf16 i8mm bf16", "").replace(" sve ", " ").replace("0xd40", "0xd0c")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """machine(text): this process reads `text` as its /proc/cpuinfo from now on, and has warned about nothing."""
    monkeypatch.setattr(hardware, "_WARNED", set())

    def use(text):
        (tmp_path / "cpuinfo").write_text(text)
        monkeypatch.setattr(hardware, "CPUINFO", str(tmp_path / "cpuinfo"))
    return use


@pytest.mark.parametrize("text, bf16, fp16", [
    (ZEN1, "emulated", "emulated"), (ZEN4, "native", "emulated"), (ZEN5, "native", "emulated"),
    (SKYLAKE, "emulated", "emulated"), (SAPPHIRE, "native", "native"),
    (GRAVITON3, "native", "unknown"), (GRAVITON2, "emulated", "unknown")])
def test_cpu_support_from_cpuinfo(text, bf16, fp16):
    cpu = hardware.cpu_info(text)
    assert hardware.cpu_support("float32", cpu) == "native"
    assert (hardware.cpu_support("bfloat16", cpu), hardware.cpu_support("float16", cpu)) == (bf16, fp16)


def test_cpu_info_fields():
    zen1, zen4, intel, arm = (hardware.cpu_info(t) for t in (ZEN1, ZEN4, SAPPHIRE, GRAVITON3))
    assert (zen1["vendor"], zen1["family"], zen1["model"], zen1["name"]) == \
        ("AuthenticAMD", 23, 1, "AMD EPYC 7601 32-Core Processor")
    assert zen1["flags"] == ["avx2"]                     # no AVX-512 at all
    assert zen4["flags"] == ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"] and zen4["family"] == 25
    assert intel["flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni"]
    assert (arm["vendor"], arm["model"], arm["flags"]) == ("0x41", 0xd40, ["asimd", "sve", "bf16", "i8mm"])


def test_no_cpuinfo_claims_nothing(monkeypatch, tmp_path):
    from elmo_pipeline.pipeline.doctor_command import text
    monkeypatch.setattr(hardware, "CPUINFO", str(tmp_path / "missing"))
    monkeypatch.setattr(hardware, "_WARNED", set())
    cpu = hardware.cpu_info()
    assert cpu["flags"] is None and hardware.cpu_support("bfloat16", cpu) == "unknown"
    assert hardware.cpu_support("float32", cpu) == "native"
    assert not hardware.warn_if_emulated("bfloat16", "cpu")
    out = text(hardware.report())
    assert "flags: unknown" in out and "bfloat16 on the CPU: unknown" in out
    assert hardware.cpu_info("")["flags"] is None                 # an empty file: nothing known either


def test_compute_support_entry():
    entry = hardware.compute_support("bfloat16", "cpu", hardware.cpu_info(ZEN1))
    assert entry == {"dtype": "bfloat16", "device": "cpu", "support": "emulated", "cpu": hardware.cpu_info(ZEN1)}
    assert hardware.compute_support("torch.bfloat16", "cpu", hardware.cpu_info(ZEN4))["support"] == "native"


@pytest.mark.parametrize("text, warns", [(ZEN1, True), (SKYLAKE, True), (ZEN4, False), (SAPPHIRE, False)])
def test_warns_once_where_bf16_is_emulated(machine, caplog, text, warns):
    machine(text)
    with caplog.at_level(logging.WARNING, logger="elmo-pipeline.hardware"):
        first = [hardware.warn_if_emulated("bfloat16", "cpu"), hardware.warn_if_emulated("bfloat16", "cpu"),
                 hardware.warn_if_emulated("float32", "cpu")]
    assert first == [warns, False, False]
    lines = [r.getMessage() for r in caplog.records if r.name == "elmo-pipeline.hardware"]
    assert len(lines) == int(warns)
    if warns:
        assert "emulated, slower than float32" in lines[0] and "avx512_bf16 or amx_bf16" in lines[0]


def test_embedder_warns_on_an_emulating_cpu(machine, caplog, tiny_model_files):
    from elmo_pipeline.model.embedder import ElmoEmbedder
    machine(ZEN1)
    with caplog.at_level(logging.WARNING, logger="elmo-pipeline.hardware"):
        ElmoEmbedder(*tiny_model_files[:2], dtype="float32")
        assert not caplog.records
        ElmoEmbedder(*tiny_model_files[:2], dtype="bfloat16")
        ElmoEmbedder(*tiny_model_files[:2], dtype="bfloat16")
    assert len([r for r in caplog.records if "emulated" in r.getMessage()]) == 1


def test_doctor_text_and_json(machine, capsys):
    from elmo_pipeline.pipeline.cli import main
    from elmo_pipeline.pipeline.doctor_command import text
    machine(ZEN1)
    out = text(hardware.report())
    assert "family 23" in out and "avx512f no" in out and "avx512_bf16 no" in out
    assert "bfloat16 on the CPU: emulated (slower than float32)" in out
    machine(SAPPHIRE)
    assert "bfloat16 on the CPU: native (avx512_bf16, amx_bf16)" in text(hardware.report())
    assert main(["doctor", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["cpu"]["family"] == 6 and r["cpu_support"] == {"float32": "native", "bfloat16": "native",
                                                            "float16": "native"}
