"""GPUs and clusters as data: what the planner (chapter 13) divides FLOPs and bytes by.

Each :class:`GPU` holds the vendor's peak dense matmul rates (bf16 and fp8, without the
2:4 sparsity that datasheets print first and that training does not use), its memory,
its NVLink bandwidth and the network bandwidth a GPU of the vendor's reference node gets
(its own network card, one direction), with the source of each figure.  Where a figure
could not be read from a vendor document the ``notes`` say so, and what stands in its
place.  A :class:`Cluster` is a GPU type, how many sit in one NVLink domain (a node), and
the bandwidth and latency of the two links a collective can cross; the command line
overrides them (``--gpus-per-node``, ``--intra-node-bandwidth``, ``--inter-node-bandwidth``).

Units: FLOP/s, bytes, bytes per second one way (a datasheet's NVLink "900 GB/s" is both
directions together: 450 GB/s each way).  ``GB`` is 10^9 bytes, as datasheets count.
Pure Python: no numpy, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import ConfigError
from .alpha_beta import AlphaBeta

__all__ = ["GPU", "GPUS", "Cluster", "cluster", "INTRA_NODE_ALPHA", "INTER_NODE_ALPHA"]

TFLOPS = 1e12
GB = 1e9

INTRA_NODE_ALPHA = 5e-6
"""Seconds per ring step inside a node: an assumption of the course (no datasheet gives
a collective's latency), the order NCCL's small all-reduces show on NVSwitch nodes."""

INTER_NODE_ALPHA = 10e-6
"""Seconds per ring step across nodes: an assumption, as :data:`INTRA_NODE_ALPHA`."""


@dataclass(frozen=True)
class GPU:
    """One accelerator type, as its vendor states it."""

    name: str
    bf16_flops: float
    """Peak dense bf16 tensor-core FLOP/s (no sparsity)."""
    fp8_flops: float | None
    """Peak dense fp8 FLOP/s; ``None`` where the GPU has no fp8 tensor cores."""
    memory_bytes: float
    """HBM capacity in bytes (the datasheet's GB times 10^9)."""
    nvlink_bandwidth: float
    """NVLink bytes per second one way (half the datasheet's bidirectional figure)."""
    network_bandwidth: float
    """Bytes per second one way through this GPU's own network card in the vendor's
    reference node (DGX / HGX: one card per GPU)."""
    gpus_per_node: int
    """GPUs in one NVLink domain of the reference node."""
    sources: tuple[str, ...] = ()
    """Where each figure comes from."""
    notes: str = ""
    """What could not be read from a vendor document, and what stands in for it."""

    def peak_flops(self, precision: str = "bf16") -> float:
        """Peak dense FLOP/s of the matmuls in ``precision`` (``bf16`` or ``fp8``)."""
        if precision == "bf16":
            return self.bf16_flops
        if precision == "fp8":
            if self.fp8_flops is None:
                raise ConfigError("gpu", f"{self.name} has no fp8 tensor cores; use --precision "
                                         f"bf16, or a Hopper or Blackwell GPU")
            return self.fp8_flops
        raise ConfigError("precision", f"precision {precision!r}: bf16 or fp8")


_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): "
         "BF16 312 TFLOPS dense (624 with sparsity), 40 GB HBM2 / 80 GB HBM2e, NVLink 600 GB/s; "
         "read as quoted by glennklockwood.com/garden/processors/A100, which cites it",)
_A100_NETWORK = ("NVIDIA DGX A100: eight single-port 200 Gb/s HDR InfiniBand cards, one per GPU "
                 "(the DGX A100 datasheet; not read through the search tool in this session, "
                 "see notes)",)
_HOPPER_NODE = ("NVIDIA DGX BasePOD reference architecture, Core Components "
                "(docs.nvidia.com/dgx-basepod/...): DGX H100 and H200: eight Hopper GPUs, "
                "640 GB / 1,128 GB in all, eight single-port ConnectX-7 up to 400 Gb/s",)
_H100 = ("NVIDIA H100 datasheet, H100 SXM: BF16 1,979 TFLOPS and FP8 3,958 TFLOPS with "
         "sparsity (half of each dense), 80 GB, NVLink 900 GB/s; dense figures 989.4 / 1978.9 "
         "as glennklockwood.com/garden/processors/h100 tabulates them",)

GPUS: dict[str, GPU] = {
    "a100-40gb": GPU("A100 SXM 40GB", 312 * TFLOPS, None, 40 * GB, 300 * GB, 25 * GB, 8,
                     _A100 + _A100_NETWORK,
                     notes="network: 200 Gb/s per GPU from the DGX A100 configuration, to be "
                           "checked against its datasheet"),
    "a100-80gb": GPU("A100 SXM 80GB", 312 * TFLOPS, None, 80 * GB, 300 * GB, 25 * GB, 8,
                     _A100 + _A100_NETWORK,
                     notes="network: 200 Gb/s per GPU from the DGX A100 configuration, to be "
                           "checked against its datasheet"),
    "h100-sxm": GPU("H100 SXM", 989.4 * TFLOPS, 1978.9 * TFLOPS, 80 * GB, 450 * GB, 50 * GB, 8,
                    _H100 + _HOPPER_NODE),
    "h800": GPU("H800 SXM", 989.4 * TFLOPS, 1978.9 * TFLOPS, 80 * GB, 200 * GB, 50 * GB, 8,
                ("NVLink 400 GB/s bidirectional: philisun.com, 'NVIDIA H800 vs H100' (a "
                 "vendor of optics, not NVIDIA)",
                 "DeepSeek-V3 technical report (arXiv 2412.19437): H800 nodes of 8 GPUs on "
                 "NVLink / NVSwitch, InfiniBand across nodes"),
                notes="no NVIDIA datasheet for the H800 was found: its tensor-core peaks are "
                      "taken equal to the H100 SXM's (the same die, as the pages cited say), "
                      "its network 400 Gb/s per GPU as the H100's reference node"),
    "h200": GPU("H200 SXM", 989.4 * TFLOPS, 1978.9 * TFLOPS, 141 * GB, 450 * GB, 50 * GB, 8,
                ("NVIDIA H200 (SXM): 141 GB HBM3e, NVLink 900 GB/s, the same tensor cores as "
                 "the H100 SXM (FP8 3,958 TFLOPS with sparsity)",) + _HOPPER_NODE),
    "b200": GPU("B200 (HGX, 1000 W)", 2250 * TFLOPS, 4500 * TFLOPS, 180 * GB, 900 * GB, 50 * GB,
                8,
                ("NVIDIA HGX B200 at 1,000 W: BF16 2,250 and FP8 4,500 TFLOPS dense, as "
                 "glennklockwood.com/garden/processors/B200 quotes NVIDIA",
                 "NVIDIA DGX B200: 1,440 GB of HBM3e over eight GPUs (180 GB each), "
                 "fifth-generation NVLink 1.8 TB/s per GPU, eight single-port ConnectX-7 up "
                 "to 400 Gb/s (DGX BasePOD reference architecture, Core Components)")),
}
"""The GPUs the planner knows, by the name ``--gpu`` takes."""


@dataclass(frozen=True)
class Cluster:
    """A GPU type in nodes: the two links every collective crosses one of."""

    gpu: GPU
    gpus_per_node: int
    intra_node: AlphaBeta = field(default=None)
    """NVLink / NVSwitch between the GPUs of one node."""
    inter_node: AlphaBeta = field(default=None)
    """The network between nodes, per GPU."""

    def link(self, crosses_nodes: bool) -> AlphaBeta:
        """The link a group's ring runs on: the network as soon as it leaves a node (its
        slowest hop sets every step's pace)."""
        return self.inter_node if crosses_nodes else self.intra_node


def cluster(gpu: str, gpus_per_node: int | None = None, intra_node_bandwidth: float | None = None,
            inter_node_bandwidth: float | None = None, *, intra_node_alpha: float = INTRA_NODE_ALPHA,
            inter_node_alpha: float = INTER_NODE_ALPHA) -> Cluster:
    """A cluster of ``gpu`` (a name in :data:`GPUS`), bandwidths in GB/s one way per GPU
    (``None``: the GPU's own figures); :class:`ConfigError` naming the rule otherwise."""
    if gpu not in GPUS:
        raise ConfigError("gpu", f"unknown GPU {gpu!r}; the planner knows "
                                 f"{', '.join(sorted(GPUS))} (--gpu NAME)")
    spec = GPUS[gpu]
    for flag, value in (("--gpus-per-node", gpus_per_node),
                        ("--intra-node-bandwidth", intra_node_bandwidth),
                        ("--inter-node-bandwidth", inter_node_bandwidth)):
        if value is not None and not value > 0:
            raise ConfigError("cluster", f"{flag} must be > 0, got {value!r}; leave it out for "
                                         f"the {spec.name}'s own figure")
    if gpus_per_node is not None and int(gpus_per_node) != gpus_per_node:
        raise ConfigError("cluster", f"--gpus-per-node must be a whole number, got {gpus_per_node}")
    intra = spec.nvlink_bandwidth if intra_node_bandwidth is None else intra_node_bandwidth * GB
    inter = spec.network_bandwidth if inter_node_bandwidth is None else inter_node_bandwidth * GB
    per_node = spec.gpus_per_node if gpus_per_node is None else int(gpus_per_node)
    if gpus_per_node is not None and gpus_per_node != spec.gpus_per_node:
        spec = replace(spec, gpus_per_node=per_node)
    return Cluster(spec, per_node, AlphaBeta(intra_node_alpha, 1 / intra),
                   AlphaBeta(inter_node_alpha, 1 / inter))
