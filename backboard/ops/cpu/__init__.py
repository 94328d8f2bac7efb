"""Our own C++ kernels for the CPU path (compiled on first use; see build.py). Imported lazily by
ops/dispatch.py: nothing here is compiled when this package is imported."""
