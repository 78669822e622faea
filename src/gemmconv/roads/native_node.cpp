// gemmconv's autograd node in C++ for the convolutions that are one GEMM over views of
// their operands: a patch embedding whose input is exactly one patch a sample (x
// [N, C, R..] as rows [N, C*prod(R)]) and a channels-last 1x1 convolution of stride 1
// (x as rows [N*prod(S), C]). The Python node's hand-off to autograd's device thread
// (the GIL, the Function's Python) is what a synchronous forward+backward of such a
// convolution paid over the reshape + linear rewrite; this node runs the same GEMMs
// under the convolution's precision rule (gemmconv/core/precision.py) without Python.
//
// Built at first use by gemmconv/roads/native_node.py; gemmconv never needs it.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

// cuBLAS's reduced-precision (half-precision split-K) reductions switched off for the
// GEMMs of one scope on CUDA half operands, then restored: a convolution never uses
// them. CPU GEMMs accumulate half products in fp32 already; fp32 CUDA calls keep the
// Python node, whose TF32 rule reads torch's per-backend precision settings.
class FullPrecisionReductions {
 public:
  explicit FullPrecisionReductions(const at::Tensor& operand) {
    if (!operand.is_cuda()) {
      return;
    }
    auto& context = at::globalContext();
    if (operand.scalar_type() == at::kBFloat16) {
      bf16_ = context.allowBF16ReductionCuBLAS() ==
          at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK;
      if (bf16_) {
        context.setAllowBF16ReductionCuBLAS(false, true);
      }
    } else if (operand.scalar_type() == at::kHalf) {
      fp16_ = context.allowFP16ReductionCuBLAS() ==
          at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK;
      if (fp16_) {
        context.setAllowFP16ReductionCuBLAS(false, true);
      }
    }
  }
  ~FullPrecisionReductions() {
    if (bf16_) {
      at::globalContext().setAllowBF16ReductionCuBLAS(true, true);
    }
    if (fp16_) {
      at::globalContext().setAllowFP16ReductionCuBLAS(true, true);
    }
  }
  FullPrecisionReductions(const FullPrecisionReductions&) = delete;
  FullPrecisionReductions& operator=(const FullPrecisionReductions&) = delete;

 private:
  bool bf16_ = false;
  bool fp16_ = false;
};

// The strides of a dense tensor of ``sizes`` [A, C, S..] whose channels are innermost
// (channels-last, in any rank).
std::vector<int64_t> channels_last_strides(at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = sizes[1];
  strides[1] = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 2; --d) {
    strides[d] = stride;
    stride *= sizes[d];
  }
  strides[0] = stride;
  return strides;
}

// Whether ``t`` lies in memory as a dense tensor with ``strides`` does (a dimension of
// size 1 may have any stride).
bool laid_out_as(const at::Tensor& t, const std::vector<int64_t>& strides) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != 1 && t.stride(d) != strides[d]) {
      return false;
    }
  }
  return true;
}

// ``t`` [A, C, S..] as GEMM rows in the order the call reads its memory (channels last
// where ``channels_last``): one row a sample (``per_sample``: a one-patch input, a
// weight) or a pixel (a 1x1 convolution's operands, dY). Where ``t`` is dense in that
// layout and autograd records nothing (the forward, a backward without create_graph),
// that is one as_strided; else the channels are moved and the result reshaped, a
// permute and a view or copy: movedim alone took 6.7 of the backward's 66 us on the
// CPU machine (a one-row call, torch 2.14).
at::Tensor rows_of(const at::Tensor& t, bool channels_last, bool per_sample) {
  int64_t count = per_sample ? t.size(0) : t.numel() / std::max<int64_t>(t.size(1), 1);
  if (t.numel() > 0 && !at::GradMode::is_enabled() &&
      (channels_last ? laid_out_as(t, channels_last_strides(t.sizes()))
                     : per_sample && t.is_contiguous())) {
    int64_t width = t.numel() / count;
    return t.as_strided({count, width}, {width, 1});
  }
  at::Tensor moved = channels_last ? t.movedim(1, -1) : t;
  return per_sample ? moved.reshape({moved.size(0), -1}) : moved.reshape({-1, moved.size(-1)});
}

// GEMM rows back in an operand's shape ``sizes``, laid out as the rows were read
// (channels last where ``channels_last``): one view or as_strided, as rows_of.
at::Tensor rows_as(const at::Tensor& rows, const std::vector<int64_t>& sizes, bool channels_last) {
  if (!channels_last) {
    return rows.view(sizes);
  }
  if (!at::GradMode::is_enabled()) {
    return rows.as_strided(sizes, channels_last_strides(sizes));
  }
  std::vector<int64_t> moved(sizes.begin(), sizes.end());
  moved.erase(moved.begin() + 1);
  moved.push_back(sizes[1]);
  return rows.view(moved).movedim(-1, 1);
}

// The weight gradient's GEMM, in fp64 where gemmconv's CPU rule for long or skinny
// fp32 reductions asks it (gemmconv/core/precision.py, _reduction_dtype).
at::Tensor reduction_mm(const at::Tensor& a, const at::Tensor& b, bool widen) {
  if (!widen) {
    return at::mm(a, b);
  }
  return at::mm(a.to(at::kDouble), b.to(at::kDouble)).to(a.scalar_type());
}

// The convolution's output [N, K, O..], uninitialised, laid out as torch's convolution
// lays it out (the caller says which): channels-last, or contiguous (a one-patch
// call's [N, K, 1..]).
at::Tensor output_like(
    const at::Tensor& input, int64_t channels, bool one_patch, bool channels_last_output) {
  int64_t spatial = input.dim() - 2;
  std::vector<int64_t> sizes{input.size(0), channels};
  for (int64_t d = 0; d < spatial; ++d) {
    sizes.push_back(one_patch ? 1 : input.size(2 + d));
  }
  auto options = input.options().memory_format(std::nullopt);
  if (!channels_last_output) {
    return at::empty(sizes, options);
  }
  return at::empty_strided(sizes, channels_last_strides(sizes), options);
}

// What the backward reads besides the saved tensors, kept as one list in the context
// (flags, then the input's and the weight's sizes): each entry of saved_data is a
// string-keyed insertion and lookup. With this list and rows_of's as_strided views the
// node's forward of a one-row call took 11.0 us in place of 14.3 and its backward 59 in
// place of 64 (the CPU machine, torch 2.14; the rewrite's: 4.1 and 51).
struct Meta {
  static constexpr int64_t kOnePatch = 1, kChannelsLast = 2, kWiden = 4, kHasBias = 8;

  static std::vector<int64_t> pack(
      int64_t flags, at::IntArrayRef input_sizes, at::IntArrayRef weight_sizes) {
    std::vector<int64_t> packed;
    packed.reserve(2 + input_sizes.size() + weight_sizes.size());
    packed.push_back(flags);
    packed.push_back(static_cast<int64_t>(input_sizes.size()));
    packed.insert(packed.end(), input_sizes.begin(), input_sizes.end());
    packed.insert(packed.end(), weight_sizes.begin(), weight_sizes.end());
    return packed;
  }

  explicit Meta(const std::vector<int64_t>& packed)
      : flags(packed[0]),
        input_sizes(packed.begin() + 2, packed.begin() + 2 + packed[1]),
        weight_sizes(packed.begin() + 2 + packed[1], packed.end()) {}

  bool has(int64_t flag) const {
    return (flags & flag) != 0;
  }

  int64_t flags;
  std::vector<int64_t> input_sizes;
  std::vector<int64_t> weight_sizes;
};

class RowsGemm : public Function<RowsGemm> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& input,
      const at::Tensor& weight,
      const std::optional<at::Tensor>& bias,
      bool one_patch,
      bool channels_last,
      bool channels_last_output,
      bool widen_weight_gradient) {
    // Keep only what the backward reads: the input for dW, the weight for dx.
    bool need_dx = input.requires_grad();
    bool need_dw = weight.requires_grad();
    ctx->save_for_backward(
        {need_dw ? input : at::Tensor(), need_dx ? weight : at::Tensor()});
    int64_t flags = (one_patch ? Meta::kOnePatch : 0) |
        (channels_last ? Meta::kChannelsLast : 0) |
        (widen_weight_gradient ? Meta::kWiden : 0) | (bias.has_value() ? Meta::kHasBias : 0);
    ctx->saved_data["meta"] = Meta::pack(flags, input.sizes(), weight.sizes());

    at::Tensor x = rows_of(input, channels_last, one_patch);
    at::Tensor w = rows_of(weight, channels_last, true);
    // y is a base tensor (it takes in-place ops as torch's output does), written
    // through its rows view as the Python node's solvers write it: the same GEMM.
    at::Tensor y = output_like(input, weight.size(0), one_patch, channels_last_output);
    at::Tensor rows = rows_of(y, true, false);
    FullPrecisionReductions precision(x);
    if (bias.has_value()) {
      at::addmm_out(rows, *bias, x, w.t());
    } else {
      at::mm_out(rows, x, w.t());
    }
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    Meta meta(ctx->saved_data["meta"].toIntVector());
    bool one_patch = meta.has(Meta::kOnePatch);
    bool channels_last = meta.has(Meta::kChannelsLast);
    auto saved = ctx->get_saved_variables();
    const at::Tensor& dy = grad_outputs[0];
    at::Tensor dx, dw, db;
    // A CPU backward runs on the caller's thread, under its autocast if any.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    FullPrecisionReductions precision(dy);
    at::Tensor dy_rows = rows_of(dy, true, false);
    if (ctx->needs_input_grad(0)) {
      at::Tensor w = rows_of(saved[1], channels_last, true);
      dx = rows_as(at::mm(dy_rows, w), meta.input_sizes, channels_last);
    }
    if (ctx->needs_input_grad(1)) {
      at::Tensor x = rows_of(saved[0], channels_last, one_patch);
      at::Tensor rows = reduction_mm(dy_rows.t(), x, meta.has(Meta::kWiden));
      dw = rows_as(rows, meta.weight_sizes, channels_last);
    }
    if (meta.has(Meta::kHasBias) && ctx->needs_input_grad(2)) {
      // Summed over batch and space of dY as given, as the Python node sums it.
      std::vector<int64_t> batch_and_space{0};
      for (int64_t d = 2; d < dy.dim(); ++d) {
        batch_and_space.push_back(d);
      }
      db = dy.sum(batch_and_space);
    }
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor rows_gemm(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    bool one_patch,
    bool channels_last,
    bool channels_last_output,
    bool widen_weight_gradient) {
  // The operands arrive cast as autocast wants them; the GEMMs inside run as given.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return RowsGemm::apply(
      input, weight, bias, one_patch, channels_last, channels_last_output,
      widen_weight_gradient);
}

}  // namespace

TORCH_LIBRARY(gemmconv_native, m) {
  m.def(
      "rows_gemm(Tensor input, Tensor weight, Tensor? bias, bool one_patch, "
      "bool channels_last, bool channels_last_output, bool widen_weight_gradient) -> Tensor");
}

TORCH_LIBRARY_IMPL(gemmconv_native, Autograd, m) {
  m.impl("rows_gemm", rows_gemm);
}
