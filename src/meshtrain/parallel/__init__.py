from meshtrain.parallel.mesh import ParallelDims

__all__ = ["ParallelDims"]
