"""Training, fine-tuning, evaluating and exporting biLMs (plain PyTorch, no Beam); training/train.py is the loop.

The biLM itself is model/ (BiLM, weights, options); this package adds the language-model data, the
shared softmax, checkpoints, the bilm-tf export and the training curves.
"""
