"""`elmo-pipeline doctor`: what this machine runs the biLM on, and which compute dtypes it runs natively.

    elmo-pipeline doctor           # versions, CPU and its flags, torch's CPU capability, GPUs, dtype verdicts
    elmo-pipeline doctor --json    # the same as one JSON object (model.hardware.report())
"""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")


def text(r: dict) -> str:
    """The report (model.hardware.report()) as the lines the command prints."""
    from elmo_pipeline.model.hardware import cpu_support, native_flags, verdict
    cpu = r["cpu"]
    known = {k: "?" if v is None else v for k, v in cpu.items()}
    lines = [f"python {r['python']}, torch {r['torch']}, {r['os']}",
             f"device (--device auto): {r['default_device']}",
             f"CPU: {known['name']} ({known['arch']}; vendor {known['vendor']}, family {known['family']}, "
             f"model {known['model']}), {r['cores']} cores"]
    if cpu["flags"] is None:
        lines.append("  flags: unknown (no /proc/cpuinfo)")
    else:
        lines.append("  flags: " + ", ".join(f"{f} {'yes' if f in cpu['flags'] else 'no'}"
                                            for f in cpu["flags_checked"]))
    lines.append(f"  torch CPU capability: {r['torch_cpu_capability'] or '?'}"
                 + (f" (ONEDNN_MAX_CPU_ISA={r['onednn_max_cpu_isa']})" if r["onednn_max_cpu_isa"] else ""))
    if not r["cuda"]:
        lines.append("CUDA: no GPU")
    for g in r["cuda"]:
        lines.append(f"cuda:{g['index']}: {g['name']}, compute capability {g['capability']}, "
                     f"bfloat16 {verdict(g['bfloat16'])}")
    for dtype in ("bfloat16", "float16"):
        support = cpu_support(dtype, cpu)
        why = [f for f in native_flags(dtype, cpu) if f in (cpu["flags"] or [])]
        lines.append(f"{dtype} on the CPU: {verdict(support)}" + (f" ({', '.join(why)})" if why else ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from elmo_pipeline.model.hardware import report
    r = report()
    print(json.dumps(r) if args.json else text(r))
    return 0
