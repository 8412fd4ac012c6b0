"""The runtime (graphs, binding, shapes, memory, models, AutoVM) over the device layer
(proto.device: backend choice, launches, the timer)."""
