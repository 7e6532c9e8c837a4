"""Row-invariant Triton kernels for the GPU: a row's result is bitwise the same whatever else
is in the call (see DESIGN.md, "Row invariance"). Nothing imports this package at specdec import
time; its modules import triton at the top, so only GPU code paths should import them."""
