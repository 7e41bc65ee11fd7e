"""Minimal reproductions of Beam 2.77 DaskRunner shortcomings (docs/runner-notes.md), for upstream reports.

    python docs/dask_runner_repro.py      # needs apache-beam and dask[distributed]; ~30 s

Each case runs a tiny graph on DaskRunner (a 2-process LocalCluster on 127.0.0.1) and on FnApiRunner and
prints what each sink received. Sinks append to files, since Dask workers are other processes.
"""
import os
import tempfile
import uuid

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

DASK = "apache_beam.runners.dask.dask_runner.DaskRunner"
OUT = tempfile.mkdtemp(prefix="dask-repro-")


def sink(label):
    path = os.path.join(OUT, f"{label}-{uuid.uuid4().hex}")

    def write(x):
        with open(path, "a") as f:
            f.write(repr(x) + "\n")
    return path, write


def read(path):
    return sorted(open(path).read().splitlines()) if os.path.exists(path) else []


def run(build, runner, address, extra=()):
    opts = [f"--runner={runner}", *extra] + ([f"--dask_client_address={address}"] if runner == DASK else [])
    p = beam.Pipeline(options=PipelineOptions(opts))
    paths = build(p)
    result = p.run()
    result.wait_until_finish()
    if getattr(result, "client", None) is not None:
        result.client.close()
    return result, {k: read(v) for k, v in paths.items()}


class Split(beam.DoFn):
    def process(self, x):
        yield x
        yield beam.pvalue.TaggedOutput("odd" if x % 2 else "even", -x)


def multi_output(p):
    """1. A multi-output ParDo: every tagged output also reaches the main output's consumers (and each other's)."""
    main_path, main_sink = sink("main")
    odd_path, odd_sink = sink("odd")
    out = p | beam.Create([1, 2, 3]) | beam.ParDo(Split()).with_outputs("odd", "even", main="main")
    out.main | "Main" >> beam.Map(main_sink)
    out.odd | "Odd" >> beam.Map(odd_sink)
    return {"main (expect 1, 2, 3)": main_path, "odd (expect -1, -3)": odd_path}


class Buffer(beam.DoFn):
    def start_bundle(self):
        self.buf = []

    def process(self, x):
        self.buf.append(x)

    def finish_bundle(self):
        yield WindowedValue(sum(self.buf), GlobalWindow().max_timestamp(), [GlobalWindow()])


def finish_bundle_output(p):
    """2. Elements output by finish_bundle never reach the next step."""
    path, write = sink("sum")
    p | beam.Create([1, 2, 3]) | beam.ParDo(Buffer()) | beam.Map(write)
    return {"bundle sums (expect 6)": path}


def two_leaves(p):
    """3. Only the last leaf of the graph is computed: the first branch never runs."""
    a_path, a_sink = sink("a")
    b_path, b_sink = sink("b")
    xs = p | beam.Create([1, 2])
    xs | "A" >> beam.Map(a_sink)
    xs | "B" >> beam.Map(b_sink)
    return {"branch A (expect 1, 2)": a_path, "branch B (expect 1, 2)": b_path}


def side_input_recompute(p):
    """4. A side input's upstream is computed again by every consumer (its side effects happen twice)."""
    effects, effect = sink("effects")
    path, write = sink("out")
    xs = p | "Xs" >> beam.Create([1, 2]) | "Effect" >> beam.Map(lambda x: effect(x) or x)
    (p | "Trigger" >> beam.Create([0])
       | beam.Map(lambda _, xs, n: (sorted(xs), n), beam.pvalue.AsList(xs),
                  beam.pvalue.AsSingleton(xs | beam.combiners.Count.Globally()))
       | beam.Map(write))
    return {"output (expect ([1, 2], 2))": path, "side effects of Effect (expect 1, 2 once)": effects}


if __name__ == "__main__":
    from distributed import LocalCluster
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=None)
    try:
        for case in (multi_output, finish_bundle_output, two_leaves, side_input_recompute):
            print(case.__doc__.strip())
            for runner in (DASK, "FnApiRunner"):
                result, got = run(case, runner, cluster.scheduler_address)
                print(f"  {runner.rsplit('.', 1)[-1]:12s}", got)
        print("5. metrics():")
        result, _ = run(finish_bundle_output, DASK, cluster.scheduler_address)
        try:
            result.metrics()
            print("  DaskRunner   metrics() works")
        except NotImplementedError as e:
            print(f"  DaskRunner   metrics() raises NotImplementedError {e}")
    finally:
        cluster.close()
