"""Layer 2: device-side route metadata (expert-major pointer tables)."""
from .tables import RoutingTables, build_routing_tables, row_capacity

__all__ = ["RoutingTables", "build_routing_tables", "row_capacity"]
