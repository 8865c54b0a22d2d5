"""The step and its setup: config, state, optimizer, gradient sync, LoRA, shapes, the pure step."""
