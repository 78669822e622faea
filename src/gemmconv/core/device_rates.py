"""The cost table: per device, the rates and fitted factors the cost model reads, each
entry with its fit source.

An entry (``DeviceRates``) holds the device's peak rates — the matrix rate of each math
mode (a large matmul on random data), the copy bandwidth (bytes read plus written), the
gap a kernel launch adds — and ``factors``: the numbers fitted to a benchmark run of
the suite on that device, by name (``FACTORS`` lists them). ``source`` says where
they come from. The H200 entry, which prices the H100 too, is fitted to the suite runs
kept in tests/data/h200_suite.json and h100_suite.json (the tests read them too), so a
new bench run changes neither the table nor the tests until someone refits both.

Estimates are pure: ``rates_for`` reads the table, or the rates a process calibrated
for a CUDA device the table does not know (``calibrate``: the rates stored in the find
database, else measured once and stored there), or, until then, the table's nearest
entry. ``prepare`` calibrates the device before the first decision made outside a
CUDA graph capture (gemmconv.selection.dispatch calls it), so no estimate opens the database or
benchmarks. Under a torch.distributed process group of several ranks it does not:
rates measured per rank differ, and so would the ranks' estimates; the nearest entry
prices the device there until ``gemmconv.sync_choices()`` measures it on one rank and
gives every rank those rates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

# The fitted factors an entry holds (fractions of the GEMM floor a kernel reaches, or
# slowdowns), by the problems they price. A vendor class's factor named
# ``<class>_backward_data`` or ``<class>_backward_weights`` prices that direction, the
# class's own name the others (gemmconv.solvers.vendor.vendor_factor): a class has them
# where the suite runs of both cards measured cuDNN's direction more than a quarter
# from its forward (bench/fit_vendor_factors.py prints each direction's figures).
FACTORS = {
    "vendor_pointwise": "the vendor's convolution on 1x1 kernels, as a fraction of the floor",
    "vendor_large_patch": "the vendor's forward on patch embeddings of 16 taps or more",
    "vendor_large_patch_backward_data": "the vendor's backward-data on those",
    "vendor_large_patch_backward_weights": "the vendor's weight gradient on those",
    "vendor_point_output": "the vendor's forward on those with one output pixel per sample",
    "vendor_point_output_backward_data": "the vendor's backward-data on those",
    "vendor_point_output_backward_weights": "the vendor's weight gradient on those",
    "vendor_small_patch": "the vendor's forward on channels-last patches of fewer taps",
    "vendor_small_patch_backward_data": "the vendor's backward-data on those",
    "vendor_small_patch_backward_weights": "the vendor's weight gradient on those",
    "vendor_small_patch_channels_first": "the vendor on channels-first patches of fewer taps",
    "vendor_few_channel_patch": "the vendor's forward and weight gradient on channels-last "
    "patches of fewer taps and fewer than 8 input channels a group",
    "vendor_few_channel_patch_backward_data": "the vendor's backward-data on channels-last "
    "patches of fewer taps and fewer than 32 channels a group",
    "vendor_other": "the vendor on every other convolution",
}


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    name: str
    matrix_tflops: dict[str, float]  # by dtype name; "fp32" is full fp32, "tf32" the TF32 mode
    bandwidth_gbs: float
    launch_us: float
    # Streaming multiprocessors: kernels that size their grid to fill the device are
    # costed with it. None where not known (the CPU, rates stored without it).
    multiprocessors: int | None = None
    # How much slower a GEMM runs when its reduction rows are not 16-byte aligned.
    unaligned_slowdown: float = 1.0
    # Host time per kernel launch (torch op or prepared Triton launch, allocation
    # included) on the eager road, and whether the host runs ahead of the device (a
    # GPU) or does the work itself (a CPU): a call costs the larger of host and
    # device time in the first case, their sum in the second.
    host_launch_us: float = 10.0
    host_triton_launch_us: float = 10.0
    # The result's allocation alone (torch.empty_strided), without a kernel.
    host_allocation_us: float = 10.0
    host_overlaps_device: bool = True
    # What gemmconv's own autograd node costs the host beyond torch's fused
    # convolution backward (the Python node and a call per direction): where the
    # forward goes to the vendor, the backward leaves torch's fused one only for GEMM
    # solvers that save more than this; and every backward direction's call pays it
    # (Solver.call_ms), each running inside that node.
    autograd_node_us: float = 60.0
    # The least time per reduction element of the vendor's forward of a large patch
    # embedding (vendor.vendor_class), however few patches (0: no such least time).
    vendor_patch_forward_us_per_reduction: float = 0.0
    factors: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # By dtype name, a multiplier on every vendor factor for problems of that dtype,
    # where the factors were fitted in another and the vendor stands otherwise to the
    # GEMMs in this one (1 where a dtype has none).
    vendor_dtype_scale: Mapping[str, float] = dataclasses.field(default_factory=dict)
    source: str = ""

    def matrix_rate(self, dtype_key: str) -> float:
        """Flops per millisecond for this dtype/math mode."""
        return self.matrix_tflops.get(dtype_key, self.matrix_tflops["fp32"]) * 1e9

    def bytes_per_ms(self) -> float:
        return self.bandwidth_gbs * 1e6

    def factor(self, name: str) -> float:
        """A fitted factor of FACTORS; KeyError naming the entry when it has none."""
        try:
            return self.factors[name]
        except KeyError:
            raise KeyError(f"{self.name} ({self.source}): no fitted factor {name!r}") from None

    def as_json(self) -> dict:
        return {**dataclasses.asdict(self), "factors": dict(self.factors),
                "vendor_dtype_scale": dict(self.vendor_dtype_scale)}  # fmt: skip


# ---- the table ---------------------------------------------------------------------

H200 = DeviceRates(
    name="NVIDIA H200",
    # Measured on an H200: an 8192^3 bf16 matmul ran 769-798 TFLOP/s and a device copy
    # about 4.3 TB/s; fp32 and tf32 are the datasheet's dense rates scaled by the same
    # measured/datasheet ratio as bf16 (about 0.8).
    matrix_tflops={"bf16": 780.0, "fp16": 780.0, "tf32": 390.0, "fp32": 50.0, "fp64": 50.0},
    bandwidth_gbs=4300.0,
    multiprocessors=132,
    launch_us=4.0,
    # bf16 [9500 x 588] x [588 x 1280] ran 88 us a call, 4.6x its flop floor at the
    # matrix rate above (the same GEMM padded to 592 ran 31 us). The factor was 2.8,
    # the ratio to the padded GEMM, which priced the unaligned GEMM at 55 us.
    unaligned_slowdown=4.6,
    # A torch op cost 20-28 us of Python and dispatch on the H200's host (bench/results/
    # host_costs_h200.txt: F.pad 25 us, an allocation and addmm 28 us), an allocation
    # alone 3-5 (torch.profiler's aten::empty_strided in bench/results/
    # node_gap_h100.txt), a prepared Triton launch on the direct route about 15 with its
    # Python: patch_implicit's run of point 2D's forward, an allocation and one launch,
    # issued in 26 us there (36 as the public call; bench/results/
    # point2d_public_h200.txt). The Triton price was 55 us, the ordinary route's, and
    # stayed so long after the direct route landed because each refit to the direct
    # route sent point 2D's backward to a solver whose
    # public calls ran 1.5-5.6x slower than find's call times said (bench/NOTES.md): a
    # backward runs in gemmconv's autograd node on the engine's worker thread, whose
    # cost no call time held. Backward estimates now carry the node (Solver.call_ms,
    # below) and find times backward candidates from a node (measure.through_autograd).
    # Fitted to the suite's call times, the 22a735c run here and the H100 run at 462056e
    # (backward candidates timed from the node): with these every row of that H100 run,
    # and every row of this one but two backward rows it timed bare, picked within 10%
    # of the fastest call. The H100 run at f0db2a3, on a slower host, misses on eleven
    # rows, none of which a vendor factor puts right without another going wrong (the
    # still_off rows of tests/recorded_runs.py say why of each).
    host_launch_us=20.0,
    host_triton_launch_us=15.0,
    host_allocation_us=5.0,
    # What a public backward call cost the host beyond the solver's own run: 60 us on
    # the H200's host (point_output's backward-data, bench/results/
    # point2d_public_h200.txt: 80.7 us of host issue against 20.4 for its bare run) and
    # 58-66 on an H100's (bench/results/node_gap_h100.txt): torch's autograd.grad, the
    # engine's hand-off to its worker thread and gemmconv's Python node. A backward
    # direction's call pays it on top of its own host time (Solver.call_ms).
    autograd_node_us=60.0,
    # cuDNN's forward kernel for a patch embedding of a few samples walks the reduction
    # at about this many us per element: on an H100 (torch 2.11, cuDNN 9.19) ViT-B/16 at
    # batch 1 (768 elements, 196 patches) ran it in 80 us and Qwen2-VL's one patch
    # (1176) in 117, where the floor-based price said 8 and sent both forwards to cuDNN
    # at 2-20x a GEMM's time (bench/probes/results/small_batch_h100.txt).
    vendor_patch_forward_us_per_reduction=0.1,
    # The vendor's fraction of the floor: each card's floor over cuDNN's device time,
    # the median over a factor's rows of the H100 runs at f0db2a3 (tests/data/
    # h100_suite.json, a copy of bench/results/h100.json at c3062b9) and 3dd28ca
    # (h100_suite_3dd28ca.json) and of this card's at 22a735c, the geometric mean of
    # the three, where that keeps immediate mode's picks on the runs as close to the
    # fastest call as any value does (bench/fit_vendor_factors.py prints each figure).
    # The cards agree to a few percent where both measured a row: ConvNeXt's
    # channels-last downsample 0.73 of the floor forward, 0.43 and 0.45 backward-data,
    # 0.50 weight gradient. The estimate only has to rank the vendor behind a real GEMM
    # where one exists; find measures the truth.
    factors={
        # 1x1: cuDNN and the pointwise GEMM tie on the device on every ResNet row
        # (within 4%, at 0.81-0.97 of the floor); 0.94-1.0 give the fewest picks off (two
        # H100 backward-data rows, off at every value), 0.97 their middle.
        "vendor_pointwise": 0.97,
        "vendor_large_patch": 0.037,
        "vendor_large_patch_backward_data": 0.031,
        # cuDNN's weight gradients of patch embeddings run twice as close to the floor
        # as its forwards on both cards (0.077 and 0.081 against 0.037); no pick moves.
        "vendor_large_patch_backward_weights": 0.079,
        "vendor_point_output": 0.029,
        "vendor_point_output_backward_data": 0.013,
        "vendor_point_output_backward_weights": 0.066,
        # Channels-last small patches of 32 channels a group or more (ConvNeXt's
        # downsample): the forward at the cards' implied 0.72-0.73. The weight gradient
        # at its implied 0.50, where cuDNN is the fastest call on both cards (ConvNeXt:
        # 0.145 ms against patch_triton's 0.164 on the H200). Backward-data above its
        # implied 0.43-0.45: the GEMM solvers' estimates there are 25-35% under their
        # calls (patch_implicit priced 0.156 ms, ran 0.205 on the H200 and 0.235 on the
        # H100 against cuDNN's 0.155 and 0.202), so below 0.51 ConvNeXt's goes to
        # patch_implicit. One factor for the three directions could not hold both.
        "vendor_small_patch": 0.73,
        "vendor_small_patch_backward_data": 0.56,
        "vendor_small_patch_backward_weights": 0.5,
        "vendor_small_patch_channels_first": 0.18,
        # Fewer than 32 channels a group (vendor.FEW_CHANNELS): DiT-XL/2's 4 channels,
        # which cuDNN pads to 8 in two extra kernels, and the SD3 and Wan 2.1 latent
        # patchifies' 16. Forward and weight gradient at 0.31-0.63 of the floor on the
        # H100 (0.25-0.31 for DiT on the H200); 0.39 keeps every recorded forward and
        # weight-gradient pick within 10% (0.01-0.43 do). Priced as ConvNeXt's (0.6), DiT's
        # training call seemed to save 54 us over torch's, under the autograd node, and
        # went to torch's convolution, though its directions saved 210-285 us by the
        # suite's call times (0.69x the rewrite on an H100 at 91437bd, bench/NOTES.md).
        # Backward-data reached 0.21-0.25 on every card (SD3's ran cuDNN's 0.163 ms a
        # call against find's patch_implicit at 0.079 when priced as ConvNeXt's).
        "vendor_few_channel_patch": 0.39,
        "vendor_few_channel_patch_backward_data": 0.22,
        "vendor_other": 0.5,  # no suite row: kept
    },
    source="tests/data/h200_suite.json (NVIDIA H200, torch 2.11, cuDNN 9.19, the suite at "
    "commit 22a735c, bench/results/h200.json at that commit): the "
    "unaligned slowdown and host costs fitted to it; the vendor factors to it and to "
    "tests/data/h100_suite.json (NVIDIA H100 80GB HBM3, the suite at commit f0db2a3, "
    "bench/results/h100.json at c3062b9) and h100_suite_3dd28ca.json (another H100, the "
    "suite at 3dd28ca) by bench/fit_vendor_factors.py",
)

# The CPU machines of this project (2 cores): orders of magnitude below any GPU; only
# the ratios between solvers matter here, and those are set by bytes copied versus
# flops. CPU GEMMs showed no alignment cliff. The rates are conservative (the 2-core
# EPYC ran an fp32 GEMM at 0.2 TFLOP/s and a copy at 48 GB/s), so a vendor factor
# fitted against the GEMM solvers' estimates can exceed 1.
CPU = DeviceRates(
    name="cpu",
    matrix_tflops={"bf16": 0.05, "fp16": 0.02, "tf32": 0.1, "fp32": 0.1, "fp64": 0.05},
    bandwidth_gbs=10.0,
    launch_us=5.0,
    host_launch_us=4.0,
    host_triton_launch_us=4.0,  # never a contender on the CPU: Triton runs interpreted
    host_allocation_us=4.0,
    host_overlaps_device=False,
    # A channels-last 4x4 patch's forward+backward cost 196.5 us through gemmconv's
    # node (a vendor dW and a patch dX) against torch's 125.2, its forward 3.4 of that
    # (bench/results/overhead_cpu.md, the run before this rule).
    autograd_node_us=60.0,
    # torch's CPU convolution ran a ViT-B/16 patch embed at batch 8 forward in 9.6 ms
    # and its weight gradient in 10.4, ahead of the rewrite's GEMM with its copy (10.5,
    # 11.0), as fast as a GEMM can: 1.0. Its backward-data (about 60 ms) and its point
    # patches (950x3x14x14: 27.7 ms against the GEMM's 7.9) are far behind: 0.1
    # (bench/results/cpu.md, the run before this fit, is in its git history).
    factors={
        # oneDNN's 1x1 convolution ran ResNet's 1x1s 1.2-2.5x faster than torch.mm
        # (MKL) on the same product on the 2-core EPYC (12544x256x64: 0.88 against 2.0
        # ms), and its general kernels 2-300x faster than im2col (ResNet's 3x3 at batch
        # 4: 2.1 against 13.6 ms; a depthwise 7x7: 0.62 against 87): fitted by
        # bench/probes/cpu_vendor_fit.py --set general (tests/data/cpu_general_calls.jsonl),
        # a pick within 10% of the fastest call on 17 of 18 pointwise rows and 40 of 42
        # others, where 0.8 and 0.5 (the H200's) got 4 and 16.
        "vendor_pointwise": 1.6,
        "vendor_large_patch": 1.0,
        "vendor_large_patch_backward_data": 0.1,
        "vendor_large_patch_backward_weights": 1.0,
        "vendor_point_output": 0.1,
        "vendor_point_output_backward_data": 0.1,
        "vendor_point_output_backward_weights": 0.1,
        # Patches of fewer taps (SD3's, DiT-XL/2's and Wan 2.1's latent patchifies,
        # ConvNeXt's downsample): oneDNN ran most of them faster than the patch GEMM with
        # its gather, up to 3.2x (SD3 at 512px, forward: 0.79 ms against 2.49
        # channels-first), where the H200's factors, kept before, priced it 3-5x slower
        # and every call went to the GEMM: 0.16-0.65x torch's forward. Fitted by
        # bench/probes/cpu_vendor_fit.py to find's call times on the 2-core EPYC
        # (tests/data/cpu_small_patch_calls.jsonl): a pick within 10% of the fastest
        # call on 21 of 24 rows. The values are a first run's (at fb8cf7d, before the
        # word copies); on the committed rows they pick the same 21 as the values those
        # rows choose. The three left are backward rows where oneDNN and the GEMM trade
        # places within one factor's class (tests/selection/test_cpu_cost_fit.py).
        "vendor_small_patch": 2.1,
        "vendor_small_patch_backward_data": 2.4,
        "vendor_small_patch_backward_weights": 1.3,
        "vendor_small_patch_channels_first": 1.1,
        "vendor_few_channel_patch": 1.8,
        "vendor_few_channel_patch_backward_data": 0.57,
        "vendor_other": 2.2,
    },
    # The factors are fp32's, whose torch.mm is MKL's. bf16 GEMMs run on oneDNN's
    # matmul (AVX512-BF16): ResNet-50's 1x1 ran 5.0x faster in bf16 than in fp32 on
    # pointwise, 1.5x on oneDNN's convolution (0.59 and 1.04 ms). Unscaled, 30 of 48
    # bf16 rows picked within 10% of the fastest call (ViT-B/16's forward went to the
    # vendor, 3.1 ms against the patch GEMM's 2.6); scaled by 0.5, 47
    # (bench/probes/cpu_vendor_fit.py --set half --dtype bf16,
    # tests/data/cpu_bf16_calls.jsonl; 0.44-0.52 gave 47, 0.56 43). fp16, which this
    # EPYC computes without native instructions (10-100x slower than bf16), is unfitted.
    vendor_dtype_scale={"bf16": 0.5},
    source="rates: conservative figures for a 2-core CPU; factors: large patches and point "
    "patches fitted to the CPU table at b6a7d1b (bench/results/cpu.md's history), small "
    "patches to "
    "tests/data/cpu_small_patch_calls.jsonl, 1x1s and the rest to "
    "tests/data/cpu_general_calls.jsonl (AMD EPYC, 2 cores, torch 2.14.1)",
)

_TABLE: dict[str, DeviceRates] = {"NVIDIA H200": H200, "NVIDIA H100 80GB HBM3": H200}
# The entry a CUDA device the table does not know is costed with until it is calibrated
# (the table's only GPU).
NEAREST_GPU = H200


# ---- looking rates up (pure) -------------------------------------------------------

# Rates calibrated in this process for CUDA devices not in the table, by device index
# (gemmconv.selection.calibrate fills it).
_calibrated: dict[int, DeviceRates] = {}


def rates_for(device_type: str, index: int = 0) -> DeviceRates:
    """The rates of a problem's device, from the table or this process's calibration;
    never opens the find database and never measures."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return CPU
    calibrated = _calibrated.get(index)
    if calibrated is not None:
        return calibrated
    return _TABLE.get(_device_name(index), NEAREST_GPU)


def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def calibrated() -> dict[int, DeviceRates]:
    """This process's calibrated rates, by CUDA device index."""
    return dict(_calibrated)


def adopt_calibrated(rates: Mapping[int, DeviceRates]) -> None:
    """Use ``rates`` (another rank's calibration) for these device indices."""
    _calibrated.update(rates)


__all__ = [
    "CPU",
    "adopt_calibrated",
    "calibrated",
    "FACTORS",
    "H200",
    "NEAREST_GPU",
    "DeviceRates",
    "rates_for",
]
