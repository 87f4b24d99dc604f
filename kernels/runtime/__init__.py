"""What every kernel family shares: launching, the compile cache, launch-geometry checks, vector
and half2 loads and stores, the wmma building blocks, and `voltserve check-kernels`."""
