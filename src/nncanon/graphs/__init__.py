"""Attribution graphs (circuit tracing over transcoders) on the standard surface.

- `Graph` (``graph``): circuit-tracer's graph record and node order, saved and loaded as ``.pt``.

See ``docs/graphs.md``.
"""

from .graph import Graph

__all__ = ["Graph"]
