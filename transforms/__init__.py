"""The pipeline's steps: Beam DoFns (transforms/*_step.py, chain.py, coders.py, inference.py) as thin shells over
plain, unit-tested functions (the other modules, no Beam import)."""
