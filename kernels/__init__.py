"""Numba CUDA kernels, one module per op family, each beside its NumPy reference (`*_ref`).

Every public launcher validates its arguments (kernels._check) before launching through
proto.backend.launch, so a graph recorder can capture it.
"""
