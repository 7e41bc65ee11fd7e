"""The pipeline's command lines, options, plan, graph and run (pipeline/run.py, the `elmo-pipeline` command)."""
