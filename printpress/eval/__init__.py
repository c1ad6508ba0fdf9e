"""Evaluation helpers: scoring text with a model's causal (AR) head."""
