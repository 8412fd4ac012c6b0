"""Numba CUDA kernels, one module per op family, each beside its NumPy reference (`*_ref`).

Every public launcher validates its arguments (kernels._check) before launching through
proto.device.backend.launch, so a graph recorder can capture it. The rules every launcher keeps:

- **Bad arguments fail before any launch**, with an error that names the argument and shows
  expected against actual (wrong type, dtype, shape, layout, an empty array, a bool or a
  float where an integer goes; NumPy integer and float scalars are numbers like any other).
- **An output never overlaps another argument.** Each kernel declares the parameters it
  writes (`proto.device.backend.jit(writes=..., in_place=...)`) and every launch checks them
  (`proto.device.backend.check_writes`); a launcher of several kernels checks all its outputs
  against all its arguments before the first launch (`_check.separate`). The one exception
  is an exact in-place pair a launcher documents ("out may be x").
- **Out-of-range values read on the device give NaN or a flag, never an out-of-bounds
  access.** Token ids, labels, positions and step counters live on the device, where the
  host cannot check them. A float output gets NaN (an embedding row, the loss and its
  gradient row, attention's output); integer state gets a flag the host reads
  (`sampling.STEP_ERROR` in the step counter) and the kernel writes nothing else.
- **NaN propagates as in the reference.** A NaN input gives a NaN output wherever NumPy's
  reference has one; never `max(v, 0)` or `max(a, b)` on floats, which is `fmaxf` on the GPU
  and drops the NaN. Ranking (top-k, argmax) is the exception, documented there: NaN ranks
  as -inf.
"""
