// tilerec: torch binding of the generated TW GEMM instances (cutlass_kernels/build.py links it
// with the nvcc-compiled instance objects and libcudart). The instance table comes from the
// generated tw_instances.h.
//
// Only torch's device-generic headers are used (no c10/cuda, no ATen/cuda): the caller passes
// the CUDA stream, and c10::DeviceGuard reaches the CUDA guard that a CUDA build of torch
// registers at runtime. So the same file builds against a CPU-only torch too, which is how CI
// builds, links and imports the extension on a machine without a GPU.
#include <cstdint>
#include <string>
#include <vector>

#include <torch/extension.h>
#include <c10/core/DeviceGuard.h>

#include <cuda_runtime_api.h>

#include "tw_instances.h"

namespace {

void check_operand(const at::Tensor &t, const char *name, at::ScalarType dtype, int64_t dim,
                   const at::Device &device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.dim() == 0 || t.stride(-1) == 1 || t.size(-1) <= 1, name,
              " must have unit stride in its last dimension");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned");
}

int find_instance(const std::string &name) {
  for (int i = 0; i < tilerec::kTwNumInstances; ++i) {
    if (name == tilerec::kTwInstances[i].name) return i;
  }
  return -1;
}

// yt[col_idx[...], :batch] = act(alpha * (W_t^T . xt[row_idx[...], :batch]) + beta * yt[...])
// or, with a bias, act(W_t^T . xt[...] + bias[col_idx[...]]) (alpha = 1, beta = 0), launched on
// `stream` (a cudaStream_t as an integer: torch.cuda.current_stream().cuda_stream).
void tw_gemm(const std::string &instance, const at::Tensor &tile_meta, const at::Tensor &col_idx,
             const at::Tensor &row_idx, const at::Tensor &w, int64_t lda, const at::Tensor &xt,
             at::Tensor yt, int64_t batch, double alpha, double beta,
             const c10::optional<at::Tensor> &bias, int64_t activation, int64_t stream) {
  int idx = find_instance(instance);
  TORCH_CHECK(idx >= 0, "TW GEMM instance '", instance, "' is not in this build");
  const auto &inst = tilerec::kTwInstances[idx];
  const at::ScalarType dtype = inst.is_bf16 ? at::kBFloat16 : at::kHalf;
  const at::Device device = xt.device();
  TORCH_CHECK(device.is_cuda(), "xt must be a CUDA tensor, got ", device);
  check_operand(tile_meta, "tile_meta", at::kInt, 2, device);
  check_operand(col_idx, "col_idx", at::kInt, 1, device);
  check_operand(row_idx, "row_idx", at::kInt, 1, device);
  check_operand(w, "w", dtype, 2, device);
  check_operand(xt, "xt", dtype, 2, device);
  check_operand(yt, "yt", dtype, 2, device);
  if (bias.has_value()) {
    check_operand(*bias, "bias", dtype, 1, device);
    TORCH_CHECK(bias->size(0) == yt.size(0), "bias must be (", yt.size(0), ",), got (",
                bias->size(0), ",)");
    TORCH_CHECK(alpha == 1.0 && beta == 0.0, "a launch with a bias needs alpha = 1 and beta = 0, got alpha=",
                alpha, " beta=", beta);
  }
  TORCH_CHECK(activation >= tilerec::kTwActNone && activation <= tilerec::kTwActGeluTanh,
              "activation must be a TwActivation code in [0, 3], got ", activation);
  TORCH_CHECK(tile_meta.size(1) == 4 && tile_meta.is_contiguous(),
              "tile_meta must be a contiguous (T, 4) int32 tensor");
  TORCH_CHECK(w.size(0) == 0 || w.stride(0) == lda, "w must have row pitch lda=", lda);
  TORCH_CHECK(xt.size(1) >= batch && yt.size(1) >= batch, "xt and yt must hold batch=", batch,
              " columns");
  TORCH_CHECK(batch >= 0 && batch <= (int64_t(1) << 30), "batch must be in [0, 2^30], got ", batch);
  c10::DeviceGuard guard(device);
  tilerec::TwGemmArgs args{};
  args.num_tiles = int(tile_meta.size(0));
  args.batch = int(batch);
  args.lda = int(lda);
  args.ldx = int(xt.stride(0));
  args.ldy = int(yt.stride(0));
  args.tile_meta = tile_meta.data_ptr<int>();
  args.col_idx = col_idx.data_ptr<int>();
  args.row_idx = row_idx.data_ptr<int>();
  args.w = w.data_ptr();
  args.xt = xt.data_ptr();
  args.yt = yt.data_ptr();
  args.alpha = float(alpha);
  args.beta = float(beta);
  args.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  args.activation = int(activation);
  int status = inst.launch(&args, reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream)));
  TORCH_CHECK(status != tilerec::kTwBadShape, "TW GEMM ", instance,
              ": batch, lda, ldx, ldy must be multiples of ", inst.alignment,
              " and ldx, ldy >= batch (got batch=", batch, " lda=", lda, " ldx=", args.ldx,
              " ldy=", args.ldy, ")");
  TORCH_CHECK(status != tilerec::kTwBadEpilogue, "TW GEMM ", instance,
              ": the epilogue takes a bias only with alpha = 1, beta = 0");
  TORCH_CHECK(status != tilerec::kTwTooManyBlocks, "TW GEMM ", instance, ": batch ", batch,
              " needs more than 65535 batch blocks");
  TORCH_CHECK(status == 0, "TW GEMM ", instance, " launch failed: ",
              cudaGetErrorString(cudaError_t(status)));
}

std::vector<std::string> instances() {
  std::vector<std::string> out;
  for (int i = 0; i < tilerec::kTwNumInstances; ++i) out.emplace_back(tilerec::kTwInstances[i].name);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tw_gemm", &tw_gemm,
        "TW sparse GEMM on K-major activations (one launch, all tiles), bias and activation "
        "fused in the epilogue",
        py::arg("instance"), py::arg("tile_meta"), py::arg("col_idx"), py::arg("row_idx"),
        py::arg("w"), py::arg("lda"), py::arg("xt"), py::arg("yt"), py::arg("batch"),
        py::arg("alpha"), py::arg("beta"), py::arg("bias"), py::arg("activation"),
        py::arg("stream"));
  m.def("instances", &instances, "names of the compiled TW GEMM instances");
}
