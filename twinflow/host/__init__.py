"""The CPU side: the kernel (built and wrapped), its worker thread, pinned staging, the host state in its
precision, and the step's modes (exact, speculative, delayed, new weights first)."""
