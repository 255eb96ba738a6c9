"""What the estimate changes to model a CUDA GPU: attention kernels and their workspaces, foreach optimizers, the
caching allocator; and the data-parallel strategies (FSDP2 over a fake process group, DDP buckets)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from remat.estimate.api import estimate_memory
from remat.estimate.attention import backward_workspace, cuda_attention_kernel
from remat.estimate.settings import StepSettings
from remat.memory import LiveTensorTracker
from remat.models import ModelConfig

_aten = torch.ops.aten
B, H, HKV, S, D = 2, 8, 2, 256, 64
LAYERS = 2
TINY = ModelConfig(preset="tiny-llama", config={"num_hidden_layers": LAYERS, "vocab_size": 512})
SMALL_STEP = StepSettings(batch_size=2, seq_length=64)


def _qkv(dtype: torch.dtype, kv_heads: int = HKV, head_dim: int = D) -> tuple[torch.Tensor, ...]:
    return (torch.empty(B, H, S, head_dim, dtype=dtype, device="meta"),
            torch.empty(B, kv_heads, S, head_dim, dtype=dtype, device="meta"),
            torch.empty(B, kv_heads, S, head_dim, dtype=dtype, device="meta"))


def test_kernel_choice_follows_pytorch_on_sm80() -> None:
    mask = torch.empty(B, 1, S, S, dtype=torch.bool, device="meta")
    assert cuda_attention_kernel(*_qkv(torch.bfloat16), enable_gqa=True) == "flash"
    assert cuda_attention_kernel(*_qkv(torch.bfloat16, kv_heads=H), attn_mask=mask) == "efficient"
    assert cuda_attention_kernel(*_qkv(torch.float32, kv_heads=H)) == "efficient"  # flash has no fp32 kernel
    assert cuda_attention_kernel(*_qkv(torch.float32), enable_gqa=True) == "math"  # efficient has no GQA
    assert cuda_attention_kernel(*_qkv(torch.bfloat16, kv_heads=H, head_dim=512)) == "efficient"  # flash <= 256
    assert cuda_attention_kernel(*_qkv(torch.float32, kv_heads=H, head_dim=6)) == "math"  # misaligned head dim


def test_flash_backward_workspace_is_flash_attention_2s() -> None:
    args = (None, *_qkv(torch.bfloat16))
    workspace = backward_workspace(_aten._scaled_dot_product_flash_attention_backward.default, args)
    assert workspace is not None
    nbytes = [t.numel() * t.element_size() for t in workspace]
    assert nbytes == [B * H * 256 * 4,  # softmax_d, seq rounded to 128
                      B * 256 * H * 64 * 4,  # dq accumulator in fp32, head dim rounded to 32
                      B * S * H * D * 2, B * S * H * D * 2]  # dK and dV expanded to all query heads (GQA)
    assert backward_workspace(_aten.mm.default, args) is None


def test_efficient_backward_workspace_has_an_fp32_dq_accumulator_for_half_inputs() -> None:
    op = _aten._scaled_dot_product_efficient_attention_backward.default
    half = backward_workspace(op, (None, *_qkv(torch.bfloat16, kv_heads=H)))
    full = backward_workspace(op, (None, *_qkv(torch.float32, kv_heads=H)))
    assert half is not None and full is not None
    assert [t.shape for t in half] == [(B, H, S), (B, H, S, 64)]
    assert [t.shape for t in full] == [(B, H, S)]


def test_attention_kernels_reported_per_setting() -> None:
    flash = estimate_memory(TINY, SMALL_STEP, autocast="bfloat16")
    assert flash.attention_kernels == {"flash": LAYERS}
    recomputed = estimate_memory(TINY, SMALL_STEP, autocast="bfloat16", policy="full")
    assert recomputed.attention_kernels == {"flash": 2 * LAYERS}  # the recompute calls attention again
    packed = estimate_memory(TINY, SMALL_STEP, autocast="bfloat16", documents_per_row=2)
    assert packed.attention_kernels == {"flash": 2 * LAYERS}  # document-wise: one flash call per document, no mask
    dense = TINY.model_copy(update={"document_attention": False})
    masked = estimate_memory(dense, SMALL_STEP, autocast="bfloat16", documents_per_row=2)
    assert masked.attention_kernels == {"efficient": LAYERS}  # transformers' block-diagonal mask: no flash
    long_rows = StepSettings(batch_size=2, seq_length=1024, autocast="bfloat16", documents_per_row=4)
    mask_bytes = 2 * 1024 * 1024  # transformers' [batch, 1, T, T] boolean mask
    without_mask = estimate_memory(TINY, long_rows).peak_bytes
    assert estimate_memory(dense, long_rows).peak_bytes - without_mask >= mask_bytes
    assert estimate_memory(TINY, SMALL_STEP, target="cpu").attention_kernels == {}


def test_math_attention_keeps_the_score_matrix() -> None:
    step = StepSettings(batch_size=2, seq_length=256)
    math = estimate_memory(TINY, step)  # fp32, grouped KV heads, no mask: the math kernel on CUDA
    cpu = estimate_memory(TINY, step, target="cpu")  # the CPU's flash kernel keeps no seq x seq matrix
    assert math.attention_kernels == {"math": LAYERS}
    heads = 4  # tiny-llama's query heads
    scores = 2 * heads * 256 * 256 * 4
    assert math.tensor_peak_bytes - cpu.tensor_peak_bytes >= LAYERS * scores


def test_foreach_optimizer_on_cuda_holds_a_copy_of_the_state_at_the_step() -> None:
    step = StepSettings(batch_size=2, seq_length=64, policy="full", loss="fused")
    cuda = estimate_memory(TINY, step)
    cpu = estimate_memory(TINY, step, target="cpu")
    param_bytes = cpu.breakdown["parameters"]
    assert cuda.phase == "optimizer step"
    # foreach AdamW computes sqrt(exp_avg_sq) for all parameters at once (a copy of the parameters' size); the CPU's
    # loop one parameter at a time (at most the largest parameter, here a sixth of them)
    step_peak = "optimizer step"
    assert cuda.phase_peaks[step_peak] - cpu.phase_peaks[step_peak] > 0.6 * param_bytes


def test_allocator_rounding_only_adds() -> None:
    estimate = estimate_memory(TINY, SMALL_STEP, autocast="bfloat16")
    assert estimate.peak_bytes > estimate.tensor_peak_bytes
    assert estimate.reserved_bytes is not None and estimate.reserved_bytes >= estimate.peak_bytes
    assert all(value % 512 == 0 for value in estimate.breakdown.values())
    assert estimate_memory(TINY, SMALL_STEP, target="cpu").reserved_bytes is None


def test_fsdp2_shards_parameters_gradients_and_optimizer_state() -> None:
    single = estimate_memory(TINY, SMALL_STEP, target="cpu")
    sharded = estimate_memory(TINY, SMALL_STEP, target="cpu", strategy="fsdp2", world_size=4)
    assert sharded.parameters * 4 >= single.parameters > sharded.parameters * 4 - 4 * 64  # padding at most
    assert sharded.breakdown["optimizer_state"] < single.breakdown["optimizer_state"] / 3
    assert not dist.is_initialized()  # the fake process group is gone


def test_ddp_adds_persistent_gradient_buckets() -> None:
    single = estimate_memory(TINY, SMALL_STEP, target="cpu")
    ddp = estimate_memory(TINY, SMALL_STEP, target="cpu", strategy="ddp", world_size=2)
    param_bytes = single.parameters * 4
    assert ddp.breakdown["gradient_buckets"] == param_bytes
    assert ddp.peak_bytes == single.peak_bytes + param_bytes
    assert any("buckets" in note for note in ddp.notes)


def test_tracker_ignores_dtensor_shape_inference() -> None:
    """DTensor runs each new op once on global-shape fake tensors to infer shapes; that is not memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        x = distribute_tensor(torch.randn(256, 512), init_device_mesh("cpu", (1,)), [Shard(0)])
        with LiveTensorTracker() as tracker:
            torch.sinc(x)  # pointwise, sharded by DTensor on every torch here; not run on a DTensor before
        assert tracker.peak_bytes == 256 * 512 * 4
    finally:
        dist.destroy_process_group()


def test_cuda_estimates_count_two_cublas_workspaces(monkeypatch) -> None:
    """NOTE [ cuBLAS workspaces are allocated memory ]: torch's default on compute capability 9.0, one workspace per
    thread that multiplies matrices (the loop's and autograd's); none on the CPU."""
    from remat.estimate.simulate import cublas_workspace_bytes

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    if not torch.cuda.is_available():
        assert cublas_workspace_bytes() == 32 * 2**20
    default = cublas_workspace_bytes()
    cuda = estimate_memory(TINY, SMALL_STEP, target="cuda")
    assert cuda.breakdown["library_workspaces"] == 2 * default
    assert estimate_memory(TINY, SMALL_STEP, target="cpu").breakdown["library_workspaces"] == 0
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_bytes() == 4096 * 1024 * 2 + 16 * 1024 * 8
    smaller = estimate_memory(TINY, SMALL_STEP, target="cuda")
    assert cuda.peak_bytes - smaller.peak_bytes == 2 * (default - cublas_workspace_bytes())
