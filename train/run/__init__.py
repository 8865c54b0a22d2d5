"""The run around the step: the Trainer's loop, what it reports to (metrics, sinks, goodput,
stragglers, watchdog), resume, the run directory, the supervisor and fault injection."""
