"""Distributed building blocks; ParallelDims owns the mesh, the other modules apply one parallelism each."""
