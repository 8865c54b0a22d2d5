"""The run around the step: the Trainer's loop, what it reports to, resume, run dirs, faults."""
