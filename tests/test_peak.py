"""kernels.peak: the FMA loop computes what it claims (so its FLOP count is real work, not
dead code), checked against NumPy float32 arithmetic."""
import numpy as np

from kernels import peak
from proto.device.backend import cuda


def test_the_fma_loop_does_the_flops_it_reports():
    out = cuda.device_array(peak.THREADS, np.float32)
    iters = 3
    assert peak.fma_loop(out, 1, iters) == 2 * peak.LANES * peak.ROUNDS * iters * peak.THREADS
    m, c = np.float32(0.9999999), np.float32(1e-7)
    i = np.arange(peak.THREADS, dtype=np.float32)
    acc = [i * np.float32(1e-9) + np.float32(k) if k else i * np.float32(1e-9)
           for k in range(peak.LANES)]
    for _ in range(iters * peak.ROUNDS):
        acc = [a * m + c for a in acc]
    # A GPU fuses each multiply-add (one rounding, NumPy two): 48 steps of a half-ulp each.
    np.testing.assert_allclose(out.copy_to_host(), sum(acc), rtol=1e-4)
