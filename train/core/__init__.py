"""The step and its setup: the config, the state, the optimizer, gradient sync, LoRA, the shapes
a mesh can run, and the pure train step; no files written, no loop."""
