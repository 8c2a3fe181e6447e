"""Collectives with autograd, the comm tracer, and gradient synchronization."""
