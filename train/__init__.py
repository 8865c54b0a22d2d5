"""Training: core/ (the step, its setup), run/ (the run around it), cli/ (entry points), data/."""
