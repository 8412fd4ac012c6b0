"""The runtime: backend choice, graphs, binding, shapes, memory, models."""
