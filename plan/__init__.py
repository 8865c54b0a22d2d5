"""Ahead-of-time analysis of a run: collective theory, HLO reading, the cost model, hardware
profiles and the mesh search; `python -m plan` (or `python -m train plan`) reports them."""
