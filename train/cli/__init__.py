"""Entry points: python -m train [plan|report|eval|sample], brigade, the lm-evaluation-harness."""
