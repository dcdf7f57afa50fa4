"""cuinterpose: checkpoint and restore of CUDA processes that share GPU memory.

The coordinator engine lives in :mod:`cuinterpose.engine`, the declarative
capture and restore machines in :mod:`cuinterpose.phases`.
"""

__version__ = "0.1.0"
