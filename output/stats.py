"""Run statistics for the run report, gathered on the workers and staged per bundle. No Beam import.

Each DoFn that measures something keeps a RunStats; the Chain that runs it stages what it gathered at the
end of each bundle (stats/<uuid>.json, output.staging.stage_stats) and Finalize merges the staged files
(merge_stats) into the report (output/report.py). Work per batch or per document only (a clock read, a
dict update), never per token. Retried bundles stage their stats again: the report's timings count every
attempt, as they took time; the counts of the output are the manifest's, not these.

    {"seconds": {stage: wall seconds},                       # read, tokenize, batch, embed, write
     "tokens_at": {unix second: tokens embedded in it},      # tokens/s over time (batches spread over theirs)
     "span": [unix time the first batch started, the last one ended],
     "padding": {bucket: [batches, real tokens, slots]},     # by the batch's longest sentence (power-of-2 bucket)
     "hosts": {"<host>:<pid>": 1}}                           # the processes that staged them
"""
from __future__ import annotations

import os
import socket
import time

STAGES = ("read", "tokenize", "batch", "embed", "write")


def length_bucket(n: int) -> int:
    """The power-of-2 bucket (upper bound) of a batch whose longest sentence has n tokens: 8, 16, 32, ..."""
    return max(8, 1 << max(0, n - 1).bit_length())


class RunStats:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = {}
        self.tokens_at: dict[int, int] = {}
        self.padding: dict[int, list[int]] = {}
        self.span: list[float] = []

    def time(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def embedded(self, tokens: int, start: float, end: float | None = None) -> None:
        """A batch of `tokens` embedded from unix time `start` to `end` (default now): its tokens are spread over
        the seconds it took, in proportion (a batch of about a second would otherwise make a saw of the curve)."""
        end = time.time() if end is None else end
        if end <= start:        # no time measured (a coarse clock, or one set back): all in one second
            self.tokens_at[int(end)] = self.tokens_at.get(int(end), 0) + tokens
        sec = int(start)
        while start < end and sec < end:
            part = tokens * (min(end, sec + 1) - max(start, sec)) / (end - start)
            self.tokens_at[sec] = self.tokens_at.get(sec, 0) + part
            sec += 1
        self.span = [min(self.span[0], start), max(self.span[1], end)] if self.span else [start, end]

    def batch(self, longest: int, real: int, slots: int) -> None:
        p = self.padding.setdefault(length_bucket(longest), [0, 0, 0])
        p[0] += 1
        p[1] += real
        p[2] += slots

    def take(self) -> dict | None:
        """What was gathered since the last take (None: nothing), as a JSON-ready dict; then starts over."""
        if not (self.seconds or self.tokens_at or self.padding):
            return None
        out = {"seconds": dict(self.seconds), "tokens_at": {str(k): v for k, v in self.tokens_at.items()},
               "padding": {str(k): list(v) for k, v in self.padding.items()}, "span": list(self.span),
               "hosts": {f"{socket.gethostname()}:{os.getpid()}": 1}}
        self.reset()
        return out


def is_stats(d) -> bool:
    """True for a staged stats dict of the layout above (each key optional): what merge_stats can add up."""
    def num(x) -> bool:
        return type(x) in (int, float)

    def numbers(m, key=lambda k: True) -> bool:
        return isinstance(m, dict) and all(key(k) and num(v) for k, v in m.items())
    return (isinstance(d, dict) and numbers(d.get("seconds", {}))
            and numbers(d.get("tokens_at", {}), lambda k: isinstance(k, str) and k.lstrip("-").isdigit())
            and isinstance(d.get("padding", {}), dict)
            and all(isinstance(k, str) and k.isdigit() and isinstance(v, list) and len(v) == 3 and all(map(num, v))
                    for k, v in d.get("padding", {}).items())
            and isinstance(d.get("hosts", {}), dict)
            and (not d.get("span")
                 or (isinstance(d["span"], list) and len(d["span"]) == 2 and all(map(num, d["span"])))))


def merge_stats(parts) -> dict:
    """The sum of staged stats dicts (see the module docstring); keys of each part are optional."""
    out = {"seconds": {}, "tokens_at": {}, "padding": {}, "hosts": {}, "span": []}
    for p in parts:
        if not p:
            continue
        for k, v in p.get("seconds", {}).items():
            out["seconds"][k] = out["seconds"].get(k, 0.0) + v
        for k, v in p.get("tokens_at", {}).items():
            out["tokens_at"][int(k)] = out["tokens_at"].get(int(k), 0) + v
        for k, v in p.get("padding", {}).items():
            acc = out["padding"].setdefault(int(k), [0, 0, 0])
            for i, x in enumerate(v):
                acc[i] += x
        out["hosts"].update(p.get("hosts", {}))
        if p.get("span"):
            a, b = p["span"]
            out["span"] = [min(out["span"][0], a), max(out["span"][1], b)] if out["span"] else [a, b]
    return out
