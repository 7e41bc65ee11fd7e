"""The output protocol, owned here: an output folder's names, its staging, commits, fence, finalize and ownership.

A run's lifecycle, top to bottom (the launcher is pipeline/execute.py, the workers are the DoFns of transforms/):

1. Plan (pipeline/plan.py, pipeline/dry_run.py): state.run_key() names the run; state.is_complete() and
   state.finalize_started() read the output and write nothing.
2. Take the output (launcher, under fsio.lease.Lease): state.prepare_output() checks ownership and refuses
   symbolic links, then decides fresh / resume / finalize / complete, clearing only what the pipeline wrote.
3. Stage (workers): staging.Staging writes shards (one writer per format, handed a stream by sink.Sink),
   then each shard's commit record, dead letters, per-file counts and run statistics under
   _staging/<run key>/; every write is fenced by the lease (fsio.lease.Fence): a run that lost the lease
   writes nothing more.
4. Finalize (launcher): finalize.plan_from_staging() reads what was committed; finalize.finalize() writes the
   dead-letter files, the report, metrics.prom and the plan (finalize.json), then complete_finalize() moves
   every file to its final name (names.part_name), writes manifest.json, removes the staging folder,
   registers the output (--iceberg-table) and writes _SUCCESS last; each step fenced by the lease.
5. Recovery: a killed run's rerun goes through 2 again: an interrupted finalize is completed or rolled back,
   committed shards are kept, the rest is embedded again.

Every file is written through sink.Sink: the only place where local folders and object stores differ, and
where write-then-rename happens (fsio.replacing). Readers (downstream/) trust manifest.json only.
No Beam import.
"""
