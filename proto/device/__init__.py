"""The device layer, below everything else: which device runs the kernels (backend: a GPU,
Numba's CUDA simulator, or PTX compilation only), the launch path (launcher), values
remembered per array (memo) and the one shared timer (timing). Every kernel and every
runtime module imports it; it imports nothing of theirs. (Nothing is imported here: the
backend must choose before numba is imported.)"""
