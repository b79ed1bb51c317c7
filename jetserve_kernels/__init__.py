"""Triton kernels for the executor's hot paths (attention.py, elementwise.py; imported only
where used, so that importing kv_int8 or reference brings no triton); `jetserve_kernels.reference`
holds a torch implementation of each with the same signature. On a CPU they run only under
TRITON_INTERPRET=1 (set before triton is imported)."""
