"""Re-exports for one release (#62): what this module held is now split by job, in ``graph``
(the graph of edges), ``edge_scores`` (EAP and EAP-IG), ``edge_patching`` (exact edge
patching) and ``circuit`` (the circuit search). Import from those.
"""

# re-export for one release (#62): moved to probe.interventions.graph, edge_scores,
# edge_patching and circuit
from probe.interventions.circuit import circuit
from probe.interventions.edge_patching import patch_edges
from probe.interventions.edge_scores import edges
from probe.interventions.graph import graph

__all__ = ["circuit", "edges", "graph", "patch_edges"]
