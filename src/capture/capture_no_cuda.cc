// Built when ELDR_CUDA is OFF: the library keeps its full C ABI and CPU reference, and the CUDA
// device reports that the kernels were not built.
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "capture_backend.h"

namespace eldr::capture {
namespace internal {

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const Geometry& /*geometry*/, int /*cuda_device*/) {
  return CudaAvailable();
}

}  // namespace internal

absl::Status CudaAvailable() {
  return absl::UnavailableError(
      "no usable GPU: libeldr_capture was built without CUDA (configure with -DELDR_CUDA=ON)");
}

}  // namespace eldr::capture
