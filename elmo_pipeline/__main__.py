"""`python -m elmo_pipeline ...`: the `elmo-pipeline` command."""
import sys

from elmo_pipeline.pipeline.cli import main

sys.exit(main())
