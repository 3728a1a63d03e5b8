"""Emulated multi-node clusters on one Linux machine, for benchmarks and tests: nodes as
network namespaces joined by ``tc``-shaped links (created and always removed by the
harness), ``torchrun`` per node with gloo over them. Needs root and iproute2.

>>> from embark.cluster import LinkShape
>>> LinkShape(rate_bits_per_s=1e9).tbf_args()[:3]
['tbf', 'rate', '1000000kbit']
"""

from embark.cluster.launch import NodeResult, run_torchrun
from embark.cluster.netns import (
    ClusterUnavailable,
    EmulatedCluster,
    LinkShape,
    harness_namespaces,
    missing_capability,
    remove_stale,
    root_links_with_prefix,
)

__all__ = [
    "ClusterUnavailable",
    "EmulatedCluster",
    "LinkShape",
    "NodeResult",
    "harness_namespaces",
    "missing_capability",
    "remove_stale",
    "root_links_with_prefix",
    "run_torchrun",
]
