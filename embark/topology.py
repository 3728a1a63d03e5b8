"""Topology presets: DGX H100 / DGX A100 × any number of nodes, GB200 NVL72 racks, this
CPU machine (``cpu-local``, gloo ranks on one host) and the emulated cluster on it
(``emulated``: network namespaces joined by shaped links, 2 ranks per node, :mod:`embark.cluster`).

>>> t = get_topology("dgx-h100", nodes=8)
>>> t.world_size, t.gpus_per_node
(64, 8)

Every figure is per GPU and, for links, per direction. Sources are on each constant.
"""

from __future__ import annotations

from embark.types import Topology

GB = 1e9

# --- NVIDIA H100 SXM5 80 GB in a DGX H100 (sources: shared/ANCHORS.md "H100 figures";
# NVIDIA H100 Tensor Core GPU datasheet; DGX H100 user guide: 8 GPUs, 4th-gen NVLink
# 900 GB/s bidirectional per GPU, 8× ConnectX-7 400 Gb/s, one per GPU).
H100_HBM_CAPACITY_BYTES = 80 * GB  # 80 GB HBM3
H100_HBM_BANDWIDTH_BYTES_PER_S = 3.35e12  # 3.35 TB/s
H100_NVLINK_BYTES_PER_S = 450 * GB  # 900 GB/s bidirectional = 450 GB/s per direction
H100_IB_BYTES_PER_S = 50 * GB  # 400 Gb/s NDR InfiniBand per GPU
H100_BF16_DENSE_FLOPS_PER_S = 989e12  # 989 TFLOPS dense bf16 (1979 with 2:4 sparsity)

# --- NVIDIA A100 SXM4 80 GB in a DGX A100 (sources: NVIDIA A100 datasheet; DGX A100 user
# guide: 3rd-gen NVLink 600 GB/s bidirectional per GPU, 8× ConnectX-6 200 Gb/s HDR).
A100_HBM_CAPACITY_BYTES = 80 * GB
A100_HBM_BANDWIDTH_BYTES_PER_S = 2.039e12  # 2,039 GB/s (80 GB SXM)
A100_NVLINK_BYTES_PER_S = 300 * GB  # 600 GB/s bidirectional
A100_IB_BYTES_PER_S = 25 * GB  # 200 Gb/s HDR per GPU
A100_BF16_DENSE_FLOPS_PER_S = 312e12  # 312 TFLOPS dense bf16

# --- NVIDIA GB200 NVL72: one NVLink domain of 72 Blackwell GPUs per rack (sources: NVIDIA
# GB200 NVL72 product page: 13.4 TB HBM3e, 576 TB/s aggregate HBM bandwidth, 130 TB/s
# NVLink, 180 PFLOPS dense FP16/BF16 (360 sparse), each over 72 GPUs; between racks one
# ConnectX-7 400 Gb/s per GPU is assumed, as in the DGX H100).
GB200_GPUS_PER_RACK = 72
GB200_HBM_CAPACITY_BYTES = 13.4e12 / 72  # ≈ 186 GB per GPU
GB200_HBM_BANDWIDTH_BYTES_PER_S = 576e12 / 72  # 8 TB/s
GB200_NVLINK_BYTES_PER_S = 130e12 / 72 / 2  # 1.8 TB/s bidirectional → 0.9 TB/s per direction
GB200_IB_BYTES_PER_S = 50 * GB  # assumed 400 Gb/s per GPU between racks
GB200_BF16_DENSE_FLOPS_PER_S = 180e15 / 72  # 2.5 PFLOPS

# --- This machine: 2 cores, 24 GiB, no GPU; one gloo rank per core (shared/DEPENDENCIES.md:
# bf16 matmul ≈ 600 GFLOP/s on 2 threads). DRAM and shared-memory figures are rough
# assumptions for a 2-core VM slice, used only so small plans can be rated and run locally.
CPU_LOCAL_RANKS = 2
CPU_LOCAL_MEMORY_BYTES = 24 * 2**30 / CPU_LOCAL_RANKS / 2  # half the RAM, split per rank
CPU_LOCAL_DRAM_BYTES_PER_S = 10 * GB  # assumed ~10 GB/s per core of random-gather bandwidth
CPU_LOCAL_SHM_BYTES_PER_S = 5 * GB  # assumed gloo shared-memory transfer rate
CPU_LOCAL_FLOPS_PER_S = 300e9  # ≈ 600 GFLOP/s bf16 on 2 threads, per rank

# --- The emulated cluster (embark.cluster): nodes as network namespaces on this machine, gloo
# ranks inside them, node links shaped with tc. How it maps onto DGX H100 + InfiniBand:
#  1. The inter- to intra-node bandwidth ratio is the DGX H100's: per GPU and direction,
#     NVLink 450 GB/s against one 400 Gb/s (50 GB/s) ConnectX-7, 9 : 1 (H100 constants above).
#     A node's loopback (its ranks' traffic to each other) is shaped to 9× its uplink.
#  2. The absolute rate sets the communication share of a step. EMBark (ANCHORS.md) reports
#     embedding communication at 25 % of a step on 8 GPUs and 51 % on 128, for table-row-wise
#     sharding of its workloads; the emulated cluster is meant for that multi-node regime,
#     where communication is at least half of the step. On this CPU the dense part of a
#     workload at batch 512 over 4 ranks takes 0.1-6 s of a step (4 ranks on 2 shared
#     cores); 8 MB/s per rank between nodes (a 2-rank node's uplink 128 Mbit/s) and 72 MB/s
#     inside a node (loopback 1.15 Gbit/s) put table-row-wise's communication phases (input
#     distribution, vectors all-to-all, backward exchanges and updates, exposed all-reduce)
#     at 66-82 % of its step on the four workloads at batch 512 and 74 % on DLRM-DCNv2 at
#     4096 (benchmarks/embark/bench_cluster.py, docs/benchmarks.md): above EMBark's 51 %,
#     i.e. a network somewhat slower, relative to compute, than 128 H100s on InfiniBand (part
#     of those phases is the CPU's per-table bookkeeping, which a GPU would hide). Loopback unshaped reaches ~0.5 GB/s per rank with
#     4 ranks on 2 cores, well above the 72 MB/s it is shaped to, so the 9 : 1 ratio holds.
#  3. Lookups and dense FLOP/s are this machine's, per rank with 2 ranks per core (fp32:
#     ~166 GFLOP/s on 2 threads, shared/DEPENDENCIES.md); a probe right before each run
#     calibrates them, and the links, under the load that run meets.
EMULATED_RANKS_PER_NODE = 2
EMULATED_INTRA_TO_INTER_RATIO = H100_NVLINK_BYTES_PER_S / H100_IB_BYTES_PER_S  # 9
EMULATED_INTER_NODE_BYTES_PER_S = 8e6  # per rank: a 2-rank node's uplink is 128 Mbit/s
EMULATED_INTRA_NODE_BYTES_PER_S = EMULATED_INTER_NODE_BYTES_PER_S * EMULATED_INTRA_TO_INTER_RATIO
EMULATED_DRAM_BYTES_PER_S = 2.5 * GB  # assumed gather rate per rank, 2 ranks per core
EMULATED_FLOPS_PER_S = 40e9  # ≈ 166 GFLOP/s fp32 on 2 threads / 4 ranks
EMULATED_MEMORY_BYTES = 24 * 2**30 / 8  # a quarter of half the RAM, per rank (4 ranks)

PRESETS = ("dgx-h100", "dgx-a100", "gb200-nvl72", "cpu-local", "emulated")


def emulated_topology(
    nodes: int = 2,
    ranks_per_node: int = EMULATED_RANKS_PER_NODE,
    inter_node_bytes_per_s: float = EMULATED_INTER_NODE_BYTES_PER_S,
    intra_node_bytes_per_s: float = EMULATED_INTRA_NODE_BYTES_PER_S,
    lookup_bytes_per_s: float = EMULATED_DRAM_BYTES_PER_S,
    flops_per_s: float = EMULATED_FLOPS_PER_S,
    latency_s: float = 200e-6,
) -> Topology:
    """The emulated cluster's topology (the mapping above), figures per rank and direction;
    a calibration passes what a probe measured on the emulated links instead.

    Raises:
        ValueError: from :class:`~embark.types.Topology` for a non-positive figure.
    """
    return Topology(
        name="emulated",
        num_nodes=nodes,
        gpus_per_node=ranks_per_node,
        hbm_capacity_bytes=EMULATED_MEMORY_BYTES,
        hbm_bandwidth_bytes_per_s=lookup_bytes_per_s,
        intra_node_bandwidth_bytes_per_s=intra_node_bytes_per_s,
        inter_node_bandwidth_bytes_per_s=inter_node_bytes_per_s,
        dense_peak_flops_per_s=flops_per_s,
        intra_node_latency_s=latency_s,
        inter_node_latency_s=latency_s,
    )


def get_topology(name: str, nodes: int = 1) -> Topology:
    """A preset topology with ``nodes`` nodes (for ``gb200-nvl72`` a node is a 72-GPU rack;
    ``cpu-local`` has exactly one node).

    Raises:
        ValueError: unknown name or a bad node count.
    """
    key = name.lower().replace("_", "-")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
    if key == "dgx-h100":
        return Topology(
            name=key,
            num_nodes=nodes,
            gpus_per_node=8,
            hbm_capacity_bytes=H100_HBM_CAPACITY_BYTES,
            hbm_bandwidth_bytes_per_s=H100_HBM_BANDWIDTH_BYTES_PER_S,
            intra_node_bandwidth_bytes_per_s=H100_NVLINK_BYTES_PER_S,
            inter_node_bandwidth_bytes_per_s=H100_IB_BYTES_PER_S,
            dense_peak_flops_per_s=H100_BF16_DENSE_FLOPS_PER_S,
        )
    if key == "dgx-a100":
        return Topology(
            name=key,
            num_nodes=nodes,
            gpus_per_node=8,
            hbm_capacity_bytes=A100_HBM_CAPACITY_BYTES,
            hbm_bandwidth_bytes_per_s=A100_HBM_BANDWIDTH_BYTES_PER_S,
            intra_node_bandwidth_bytes_per_s=A100_NVLINK_BYTES_PER_S,
            inter_node_bandwidth_bytes_per_s=A100_IB_BYTES_PER_S,
            dense_peak_flops_per_s=A100_BF16_DENSE_FLOPS_PER_S,
        )
    if key == "gb200-nvl72":
        return Topology(
            name=key,
            num_nodes=nodes,
            gpus_per_node=GB200_GPUS_PER_RACK,
            hbm_capacity_bytes=GB200_HBM_CAPACITY_BYTES,
            hbm_bandwidth_bytes_per_s=GB200_HBM_BANDWIDTH_BYTES_PER_S,
            intra_node_bandwidth_bytes_per_s=GB200_NVLINK_BYTES_PER_S,
            inter_node_bandwidth_bytes_per_s=GB200_IB_BYTES_PER_S,
            dense_peak_flops_per_s=GB200_BF16_DENSE_FLOPS_PER_S,
        )
    if key == "cpu-local":
        if nodes != 1:
            raise ValueError(f"cpu-local is one machine; nodes must be 1, got {nodes}")
        return Topology(
            name=key,
            num_nodes=1,
            gpus_per_node=CPU_LOCAL_RANKS,
            hbm_capacity_bytes=CPU_LOCAL_MEMORY_BYTES,
            hbm_bandwidth_bytes_per_s=CPU_LOCAL_DRAM_BYTES_PER_S,
            intra_node_bandwidth_bytes_per_s=CPU_LOCAL_SHM_BYTES_PER_S,
            inter_node_bandwidth_bytes_per_s=CPU_LOCAL_SHM_BYTES_PER_S,
            dense_peak_flops_per_s=CPU_LOCAL_FLOPS_PER_S,
            intra_node_latency_s=50e-6,
            inter_node_latency_s=50e-6,
        )
    if key == "emulated":
        return emulated_topology(nodes)
    raise ValueError(f"unknown topology {name!r}; expected one of {list(PRESETS)}")
