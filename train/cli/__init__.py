"""The entry points: `python -m train [plan|report|eval|sample]`, `brigade ...` and the
lm-evaluation-harness adapter; imported by nothing but each other and the `python -m` doorways."""
