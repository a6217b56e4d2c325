"""Numerical proof that a conversion kept the model: reference forward, parallel forward, comparison."""
