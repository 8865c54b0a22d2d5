"""The model: layers, attention, MoE, the decoder, presets; `register` adds a model of your own
(models/registry.py)."""

from models.registry import register

__all__ = ["register"]
