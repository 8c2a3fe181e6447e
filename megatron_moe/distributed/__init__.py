"""Collectives with autograd, the collective observer, gradient synchronization, SAA and Lina."""
