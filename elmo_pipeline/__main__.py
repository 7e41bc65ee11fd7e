"""`python -m elmo_pipeline ...`: the `elmo-pipeline` command."""
from elmo_pipeline.pipeline.cli import console

console()
