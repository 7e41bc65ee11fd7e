"""The output protocol, owned here: an output folder's names, its staging, commits, fence, finalize and ownership.

A run's lifecycle, top to bottom (lifecycle.run(); the launcher pipeline/execute.py hands it the Beam graph run,
the workers are the DoFns of transforms/):

1. Plan (pipeline/plan.py, pipeline/dry_run.py): state.run_key() names the run; state.is_complete() and
   state.finalize_started() read the output and write nothing; manifest.planned() assembles what is known.
2. Take the output (lifecycle.run, under output.lease.Lease): state.prepare_output() checks ownership and links
   (ownership.py), then decides fresh / resume / finalize / complete, clearing only what the pipeline wrote.
3. Stage (workers): staging.Staging writes shards (one writer per format, handed a stream by sink.Sink),
   then each shard's commit record, dead letters, per-file counts and run statistics under
   _staging/<run key>/; every write is fenced by the lease (output.lease.Fence): a run that lost the lease
   writes nothing more.
4. Finalize (lifecycle.rounds): finalize.plan_from_staging() reads what was committed; finalize.finalize()
   writes the dead-letter files, the upsert's document state, the report, metrics.prom and the plan
   (finalize.json), then complete_finalize() moves every file to its final name (names.part_name), writes
   manifest.json (manifest.write, the one writer), removes the staging folder, registers the output
   (register.py, --iceberg-table) and writes _SUCCESS last; each step fenced by the lease.
5. Recovery: a killed run's rerun goes through 2 again: an interrupted finalize is completed or rolled back,
   committed shards are kept, the rest is embedded again.

Every file is written through sink.Sink: the only place where local folders and object stores differ, where
write-then-rename happens (fsio.replacing) and where each write is checked inside the output. Readers
(downstream/) trust manifest.json only, and verify each file against its record. No Beam import.
"""
