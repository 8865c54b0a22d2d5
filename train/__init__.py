"""Brigade's training: core/ (the step and its setup), run/ (the run around it), cli/ (the
entry points), data/ (the tokens)."""
