"""GPUs and clusters as data: what the planner (chapter 13) divides FLOPs and bytes by.

Each :class:`GPU` holds the vendor's peak dense matmul rates (bf16 and fp8, without the
2:4 sparsity that datasheets print first and that training does not use), its memory,
its NVLink bandwidth, the network bandwidth a GPU of the vendor's reference node gets
(its own network card, one direction) and the GPUs of that node.  Every figure has a
:class:`Citation` (the document, its address and the figure's line as the document
prints it) or, where no vendor document gives it, an entry in :attr:`GPU.unsourced`
saying so and what stands in its place (:func:`figure_sources` lists both, the chapter
shows them).  The vendor documents were read as they are quoted in public copies (the
course's search tools reach no vendor site); :attr:`Citation.read_via` names the copy.

A :class:`Cluster` is a GPU type, how many sit in one NVLink domain (a node), and the
bandwidth and latency of the two links a collective can cross; the command line
overrides them (``--gpus-per-node``, ``--intra-node-bandwidth``, ``--inter-node-bandwidth``).

Units: FLOP/s, bytes, bytes per second one way (a datasheet's NVLink "900 GB/s" is both
directions together: 450 GB/s each way; a network card's "400 Gb/s" is bits, one way:
50 GB/s).  ``GB`` is 10^9 bytes, as datasheets count.  Pure Python: no numpy, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import ConfigError
from .alpha_beta import AlphaBeta

__all__ = ["GPU", "GPUS", "Citation", "FIGURES", "figure_sources", "Cluster", "cluster",
           "INTRA_NODE_ALPHA", "INTER_NODE_ALPHA"]

TFLOPS = 1e12
GB = 1e9
GBIT = 1e9 / 8
"""Bytes per second of one Gb/s."""

INTRA_NODE_ALPHA = 5e-6
"""Seconds per ring step inside a node: an assumption of the course (no datasheet gives
a collective's latency), the order NCCL's small all-reduces show on NVSwitch nodes."""

INTER_NODE_ALPHA = 10e-6
"""Seconds per ring step across nodes: an assumption, as :data:`INTRA_NODE_ALPHA`."""

FIGURES = ("bf16_flops", "fp8_flops", "memory_bytes", "nvlink_bandwidth", "network_bandwidth",
           "gpus_per_node")
"""The figures of a :class:`GPU` that need a source."""


@dataclass(frozen=True)
class Citation:
    """Where one figure of a GPU comes from."""

    figure: str
    """The :class:`GPU` field it gives (one of :data:`FIGURES`)."""
    document: str
    url: str
    line: str
    """The figure's line as the document prints it (what the value is read from)."""
    read_via: str = ""
    """Where this line was read, when not in the vendor's document itself."""


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
    citations: tuple[Citation, ...] = ()
    unsourced: tuple[tuple[str, str], ...] = ()
    """``(figure, why)`` for each figure no vendor document gives: what stands in for it."""

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

    def source(self, figure: str) -> Citation | str:
        """The :class:`Citation` of ``figure``, or the text saying it has none."""
        for citation in self.citations:
            if citation.figure == figure:
                return citation
        return dict(self.unsourced)[figure]


# --- the documents -------------------------------------------------------------------

_A100_SHEET = ("NVIDIA A100 Tensor Core GPU datasheet and product page, specifications",
               "https://www.nvidia.com/en-us/data-center/a100/")
_TE_MATRIX = ("NVIDIA TransformerEngine, datatype and hardware support matrix",
              "https://nvidia.github.io/TransformerEngine/support_matrix.html")
_MLPERF_H200 = ("NVIDIA's MLPerf Inference v4.1 submission, system H200-SXM-141GBx8 "
                "(closed/NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json)",
                "https://github.com/mlcommons/inference_results_v4.1")
_DGX_A100 = ("NVIDIA DGX A100 datasheet, system specifications",
             "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
             "nvidia-dgx-a100-datasheet.pdf")
_H100_PAGE = ("NVIDIA H100 Tensor Core GPU, specifications (H100 SXM column; * with sparsity)",
              "https://www.nvidia.com/en-us/data-center/h100/")
_H200_PAGE = ("NVIDIA H200 Tensor Core GPU, specifications (H200 SXM column; * with sparsity)",
              "https://www.nvidia.com/en-us/data-center/h200/")
_DGX_H100 = ("NVIDIA DGX H100 datasheet, specifications (DGX H200 the same networking, "
             "DGX BasePOD reference architecture, core components)",
             "https://www.nvidia.com/en-us/data-center/dgx-h100/")
_HGX = ("NVIDIA HGX platform, specifications (HGX B200, 8 GPUs; tensor-core figures "
        "sparse, dense one half)", "https://www.nvidia.com/en-us/data-center/hgx/")
_DGX_B200 = ("NVIDIA DGX B200, specifications",
             "https://www.nvidia.com/en-us/data-center/dgx-b200/")
_DEEPSEEK_V3 = ("DeepSeek-V3 technical report (arXiv 2412.19437), sections 3.1 and 3.2.2",
                "https://arxiv.org/abs/2412.19437")

_COPY = "quoted in public repositories' notes on GPU specifications (the course's find_string)"


def _cite(figure: str, document: tuple[str, str], line: str, read_via: str = _COPY) -> Citation:
    return Citation(figure, document[0], document[1], line, read_via)


_A100_COMMON = (
    _cite("bf16_flops", _A100_SHEET, "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS* "
          "(* with sparsity)"),
    _cite("nvlink_bandwidth", _DGX_A100, "NVIDIA NVSwitch GPU-to-GPU Bandwidth 600 GB/s",
          "a copy of the DGX A100 specification table in a public repository's docs"),
    _cite("network_bandwidth", _DGX_A100, "Networking: 8x Single-Port Mellanox ConnectX-6 VPI "
          "200Gb/s HDR InfiniBand", "copies of the DGX A100 specification table in public "
          "repositories (three, the same line)"),
    _cite("gpus_per_node", _DGX_A100, "GPUs: 8x NVIDIA A100 Tensor Core GPUs",
          "the same copies"),
)
_A100_NO_FP8 = _cite("fp8_flops", _TE_MATRIX, "8.0, 8.6 (Ampere): BF16 Yes, FP8 (per tensor) No",
                     "the search tool's copy of the page")

_HOPPER_NODE = (
    _cite("network_bandwidth", _DGX_H100, "GPUDirect RDMA networking: 4x OSFP ports serving 8x "
          "single-port NVIDIA ConnectX-7 VPI 400 Gb/s InfiniBand/Ethernet"),
    _cite("gpus_per_node", _DGX_H100, "GPU: 8x NVIDIA H100 Tensor Core GPUs"),
)

GPUS: dict[str, GPU] = {
    "a100-40gb": GPU(
        "A100 SXM 40GB", 312 * TFLOPS, None, 40 * GB, 300 * GB, 200 * GBIT, 8,
        _A100_COMMON + (_cite("memory_bytes", _DGX_A100, "GPUs: 8x NVIDIA A100 40GB Tensor Core "
                              "GPUs, 320 GB total memory"), _A100_NO_FP8)),
    "a100-80gb": GPU(
        "A100 SXM 80GB", 312 * TFLOPS, None, 80 * GB, 300 * GB, 200 * GBIT, 8,
        _A100_COMMON + (_cite("memory_bytes", _A100_SHEET, "A100 80GB SXM: GPU Memory 80GB "
                              "HBM2e"), _A100_NO_FP8)),
    "h100-sxm": GPU(
        "H100 SXM", 1979 / 2 * TFLOPS, 3958 / 2 * TFLOPS, 80 * GB, 450 * GB, 400 * GBIT, 8,
        (_cite("bf16_flops", _H100_PAGE, "BFLOAT16 Tensor Core 1,979 teraFLOPS*"),
         _cite("fp8_flops", _H100_PAGE, "FP8 Tensor Core 3,958 teraFLOPS*"),
         _cite("memory_bytes", _H100_PAGE, "GPU Memory 80GB"),
         _cite("nvlink_bandwidth", _H100_PAGE, "Interconnect: NVIDIA NVLink 900GB/s"))
        + _HOPPER_NODE),
    "h800": GPU(
        "H800 SXM", 1979 / 2 * TFLOPS, 3958 / 2 * TFLOPS, 80 * GB, 160 * GB, 50 * GB, 8,
        (_cite("nvlink_bandwidth", _DEEPSEEK_V3, "NVLink offers a bandwidth of 160 GB/s, "
               "roughly 3.2 times that of IB (50 GB/s)", "copies of the report in public "
               "repositories; the operator's figure, not NVIDIA's"),
         _cite("network_bandwidth", _DEEPSEEK_V3, "NVLink offers a bandwidth of 160 GB/s, "
               "roughly 3.2 times that of IB (50 GB/s)", "the same copies"),
         _cite("gpus_per_node", _DEEPSEEK_V3, "Each node in the H800 cluster contains 8 GPUs "
               "connected by NVLink and NVSwitch within nodes", "the same copies")),
        unsourced=(
            ("bf16_flops", "no NVIDIA datasheet for the H800 SXM was found: taken equal to the "
                           "H100 SXM's (the same Hopper die, whose export variant cut NVLink "
                           "and FP64, as third-party pages say)"),
            ("fp8_flops", "no NVIDIA datasheet found: taken equal to the H100 SXM's, as bf16"),
            ("memory_bytes", "no NVIDIA datasheet found: 80 GB, as the H100 SXM and as "
                             "third-party pages give it"))),
    "h200": GPU(
        "H200 SXM", 1979 / 2 * TFLOPS, 3958 / 2 * TFLOPS, 141 * GB, 450 * GB, 400 * GBIT, 8,
        (_cite("memory_bytes", _H200_PAGE, "GPU Memory 141GB"),
         _cite("nvlink_bandwidth", _MLPERF_H200, "accelerator_interconnect: 18x 4th Gen NVLink, "
               "900GB/s", "the search tool's copy of the file"))
        + _HOPPER_NODE,
        unsourced=(
            ("bf16_flops", "the H200 page's tensor-core lines were not read in this session: "
                           "taken equal to the H100 SXM's (the same Hopper GPU with more and "
                           "faster memory)"),
            ("fp8_flops", "as bf16: the H100 SXM's, not read from the H200 page"))),
    "b200": GPU(
        "B200 (HGX)", 36e3 / 8 / 2 * TFLOPS, 72e3 / 8 / 2 * TFLOPS, 180 * GB, 900 * GB,
        400 * GBIT, 8,
        (_cite("bf16_flops", _HGX, "HGX B200: FP16/BF16 36 PFLOPS (8 GPUs, sparse)"),
         _cite("fp8_flops", _HGX, "HGX B200: FP8/FP6 Tensor Core 72 PFLOPS (8 GPUs, sparse)"),
         _cite("memory_bytes", _DGX_B200, "GPU memory: 1,440 GB total (8 GPUs)"),
         _cite("nvlink_bandwidth", _HGX, "HGX B200: NVLink fifth generation, 1.8 TB/s per GPU "
               "(NVSwitch GPU-to-GPU bandwidth)"),
         _cite("network_bandwidth", _DGX_B200, "Networking: 4x OSFP ports serving 8x "
               "single-port NVIDIA ConnectX-7 VPI, up to 400 Gb/s InfiniBand/Ethernet"),
         _cite("gpus_per_node", _DGX_B200, "GPU: 8x NVIDIA Blackwell GPUs"))),
}
"""The GPUs the planner knows, by the name ``--gpu`` takes."""


def figure_sources(gpus: dict[str, GPU] | None = None) -> list[dict]:
    """One row per GPU and figure: ``gpu``, ``figure``, ``value`` and either the citation's
    ``document``, ``url``, ``line`` and ``read_via`` or ``unsourced`` (why, and what
    stands in).  The table chapter 13 prints."""
    rows = []
    for key, gpu in (GPUS if gpus is None else gpus).items():
        for figure in FIGURES:
            where = gpu.source(figure)
            row = {"gpu": key, "figure": figure, "value": getattr(gpu, figure)}
            if isinstance(where, Citation):
                row.update(document=where.document, url=where.url, line=where.line,
                           read_via=where.read_via)
            else:
                row["unsourced"] = where
            rows.append(row)
    return rows


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
